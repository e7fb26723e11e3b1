"""Where the compiled loss's chunk loop runs: the candidates for issue 52's compiled memory, measured on one CUDA GPU.
Compiled, today's loop (training/loss.py) holds every chunk's weight-gradient product at once (Inductor fuses their
adds into the fp32 sum into one kernel after the last chunk) and, on an H200, every chunk's logits too
(docs/gpu_h200_2026-11-28.md). The schedules:

  inline           traced into the step's graph, as training runs it
  grad_w_op        inline, with each chunk's weight gradient added in an op Inductor does not look into
                   (add_weight_gradient_): each chunk's product is added and freed before the next chunk's exists
  eager            outside the graph, run eagerly
  compiled_chunks  outside the graph, each chunk its own compiled call

For each: the loss alone (one micro-batch's final hidden states), compiled, against eager's loss and gradients, its
milliseconds and peak memory; then the whole training step with the leanest schedule (the one that peaked lowest of
those within 1.05× inline's time), against inline's.

    python -m dev.loss_schedules                            # GPT-2 124M's loss, 65,536 tokens in chunks of 4,096
    python -m dev.loss_schedules --schedules inline grad_w_op --tokens 4096 --chunk_tokens 1024 --device cpu
    python -m dev.compiled_memory --loss_schedules inline grad_w_op   # the whole micro-step's peak, by schedule
"""

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from model import PRESETS
from tools.bench.loss_memory import loss_function, loss_inputs, measure_loss
from tools.bench.step import make_workload, time_config_or_skip, write_random_shard
from training import loss
from training.distributed import Distributed

SCHEDULES = ("inline", "grad_w_op", "eager", "compiled_chunks")


@torch.library.custom_op("dev::add_weight_gradient_", mutates_args=("grad_w",))
def add_weight_gradient_(grad_w: torch.Tensor, grad_logits: torch.Tensor, x: torch.Tensor,
                         grad_scale: torch.Tensor | None, x_scale: torch.Tensor | None) -> None:
    """grad_w += grad_logitsᵀ @ x, as one op Inductor does not look into: traced inline, the adds of every chunk's
    product into the fp32 sum are pointwise ops Inductor fuses into one kernel after the last chunk, which holds every
    product at once (read in its CPU code)."""
    grad_w += loss.head_grad_w(grad_logits, x, grad_scale, x_scale)


@add_weight_gradient_.register_fake
def _(grad_w, grad_logits, x, grad_scale, x_scale) -> None:
    return None


@contextmanager
def loss_schedule(schedule: str) -> Iterator[None]:
    """Within it, training/loss.py's chunk loop runs as `schedule` says (compile inside it, too: torch.compile reads
    the functions when it traces)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"loss schedule {schedule!r} is none of {', '.join(SCHEDULES)}")
    saved = loss.ChunkedLinearCrossEntropy, loss.cross_entropy_chunk, loss.add_weight_gradient
    if schedule == "grad_w_op":
        loss.add_weight_gradient = lambda grad_w, grad_logits, ops: add_weight_gradient_(
            grad_w, grad_logits, ops.x, ops.grad_scale, ops.x_scale)
    if schedule in ("eager", "compiled_chunks"):
        # A stand-in for the class, not its apply replaced: torch.compile traces the apply of any autograd.Function.
        loss.ChunkedLinearCrossEntropy = SimpleNamespace(apply=torch.compiler.disable(saved[0].apply))
    if schedule == "compiled_chunks":  # (dynamic=False: every chunk but a shorter last one has the same shapes)
        loss.cross_entropy_chunk = torch.compile(saved[1], dynamic=False)
    try:
        yield
    finally:
        loss.ChunkedLinearCrossEntropy, loss.cross_entropy_chunk, loss.add_weight_gradient = saved


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def leanest_schedule(measured: dict[str, dict]) -> str | None:
    """Of the schedules besides inline whose loss alone took at most 1.05× inline's time, the one that peaked lowest
    (without peaks, off CUDA: the fastest)."""
    inline = measured.get("inline")
    fits = {name: m for name, m in measured.items() if name != "inline" and inline and m["ms"] <= 1.05 * inline["ms"]}
    if not fits:
        return None
    return min(fits, key=lambda name: (fits[name]["peak_bytes"] or 0, fits[name]["ms"]))


def measure_schedules(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, dict]:
    """The loss alone compiled under each schedule, printed against eager's."""
    config = PRESETS[args.model]
    inputs = loss_inputs(args.tokens, config.n_embd, config.padded_vocab_size, config.vocab_size, device)
    eager = measure_loss(loss_function(config.vocab_size, args.chunk_tokens, compile=False), inputs, dtype)
    measured = {}
    for schedule in args.schedules:
        with loss_schedule(schedule):
            run = measure_loss(loss_function(config.vocab_size, args.chunk_tokens, compile=True), inputs, dtype)
        errors = [relative_error(a, b) for a, b in zip(run["grads"], eager["grads"])]
        peak = f", peak {run['peak_bytes'] / 2**20:,.0f} MiB (eager's {eager['peak_bytes'] / 2**20:,.0f})" \
            if run["peak_bytes"] is not None else ""
        print(f"{schedule:16s} loss {abs(run['loss'] - eager['loss']) / abs(eager['loss']):.1e}, gradients "
              f"{max(errors):.1e} from eager's (relative); {run['ms']:,.1f} ms a call (eager's "
              f"{eager['ms']:,.1f}){peak}")
        measured[schedule] = run | {"grads": None}
    return measured


def time_whole_steps(args: argparse.Namespace, device: torch.device, schedules: tuple[str, ...]) -> None:
    """The compiled training step (bench.py's timing, on random tokens) with the loss under each schedule."""
    work = make_workload(Distributed(0, 0, 1, device), model=args.model, micro_batch_size=args.micro_batch_size,
                         dtype="bf16", device=args.device, compile=True)
    with tempfile.TemporaryDirectory(prefix="loss_schedules_") as data_dir:
        write_random_shard(data_dir, work, work.plan.model_config.vocab_size)
        for schedule in schedules:
            with loss_schedule(schedule):
                run = time_config_or_skip(work, data_dir, torch.bfloat16, True, False, steps=3, warmup=2)
            print(f"the whole step, loss {schedule}: " + (run["skipped"] if "skipped" in run else
                  f"{run['tokens_per_sec']:,.0f} tokens/s, peak {run['peak_memory_mib']:,.0f} MiB"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--model", default="gpt2", choices=PRESETS)
    parser.add_argument("--tokens", type=int, default=65_536, help="the loss alone: one micro-batch's tokens")
    parser.add_argument("--chunk_tokens", type=int, default=4096)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--micro_batch_size", type=int, default=64, help="the whole step's, at the model's block_size")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)  # a compilation a schedule
    leanest = leanest_schedule(measure_schedules(args, device, torch.bfloat16))
    if leanest is None:
        print("the whole step: not run, no schedule besides inline took within 1.05× inline's time")
        return
    time_whole_steps(args, device, ("inline", leanest))


if __name__ == "__main__":
    main()

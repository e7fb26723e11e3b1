"""Ours against build-nanogpt's full-logits loss (not a command: tools/bench.py --vs_full_logits and tools/gpu_check.py
share it): the whole training step both ways, alternating in one process, and the loss's own forward and backward on
one micro-batch of final hidden states."""

import statistics
import time

import torch
import torch.nn.functional as F

from tools.bench.step import Workload, time_config_or_skip
from training.distributed import synchronize
from training.loss import linear_cross_entropy, loss_chunk_tokens
from training.precision import autocast


def compare_with_full_logits(work: Workload, data_dir: str, dtype: torch.dtype, compile: bool, steps: int,
                             warmup: int, rounds: int, loss_alone: bool = True) -> dict:
    """Ours against build-nanogpt's full-logits loss, everything else equal, alternating for `rounds` rounds; and
    (loss_alone) the loss's own time both ways, its loss_ms and loss_share None without."""
    per_round = [[time_config_or_skip(work, data_dir, dtype, compile, False, steps, warmup, full_logits)
                  for full_logits in (True, False)] for _ in range(rounds)]
    measured = [(theirs, ours) for theirs, ours in per_round if "skipped" not in theirs and "skipped" not in ours]
    cpu = work.dist_env.device.type != "cuda"  # the process's peak resident memory never goes down: no ratio
    loss_ms = {name: time_loss(work, dtype, compile, full) for name, full in (("full_logits", True), ("ours", False))} \
        if loss_alone else None
    ours_step_ms = statistics.median(ours["ms_per_step"] for _, ours in measured) if measured and loss_ms else None
    return {"rounds": per_round,
            "speed_ratio": statistics.median(o["tokens_per_sec"] / t["tokens_per_sec"] for t, o in measured)
            if measured else None,
            "memory_ratio": None if cpu or not measured else statistics.median(
                o["peak_memory_mib"] / t["peak_memory_mib"] for t, o in measured),
            "loss_ms": loss_ms,
            "loss_share": loss_ms["ours"] * work.plan.grad_accum_steps / ours_step_ms if ours_step_ms else None}


def time_loss(work: Workload, dtype: torch.dtype, compile: bool, full_logits: bool, repeats: int = 5,
              chunk_tokens: int | None = None) -> float:
    """Milliseconds of the loss's forward + backward on one micro-batch of final hidden states (median of repeats,
    after 2 untimed calls): ours (in chunks of chunk_tokens; None: the device's), or build-nanogpt's full logits and
    cross-entropy."""
    device, config = work.dist_env.device, work.plan.model_config
    tokens = work.cfg.micro_batch_size * work.plan.seq_len
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, config.n_embd, generator=g).to(device).requires_grad_()
    weight = (0.02 * torch.randn(config.padded_vocab_size, config.n_embd, generator=g)).to(device).requires_grad_()
    targets = torch.randint(0, config.vocab_size, (tokens,), generator=g).to(device)
    chunk_tokens = chunk_tokens or loss_chunk_tokens(device)

    def loss_fn(x, weight, targets):
        if full_logits:
            return F.cross_entropy(F.linear(x, weight).float(), targets)
        return linear_cross_entropy(x, weight, targets, config.vocab_size, chunk_tokens)

    loss_fn = torch.compile(loss_fn) if compile else loss_fn
    milliseconds = []
    for _ in range(repeats + 2):
        synchronize(device)
        t0 = time.perf_counter()
        with autocast(device, dtype):
            loss = loss_fn(x, weight, targets)
        loss.backward()
        synchronize(device)
        milliseconds.append(1000 * (time.perf_counter() - t0))
        x.grad = weight.grad = None
    return statistics.median(milliseconds[2:])


def format_full_logits(f: dict) -> list[str]:
    lines = []
    for i, (theirs, ours) in enumerate(f["rounds"]):
        lines.append(f"round {i + 1}: " + " | ".join(
            f"{run['name']}: " + (run["skipped"] if "skipped" in run else
                                  f"{run['tokens_per_sec']:,.0f} tokens/s, {run['peak_memory_mib']:,.0f} MiB")
            for run in (theirs, ours)))
    if f["speed_ratio"] is not None:
        memory = f", {f['memory_ratio']:.2f}x its peak memory" if f["memory_ratio"] is not None else ""
        lines.append(f"ours against the full-logits loss: {f['speed_ratio']:.3f}x its tokens/s{memory}")
    share = f", {f['loss_share']:.1%} of our step" if f["loss_share"] is not None else ""
    lines.append(f"the loss alone, forward + backward of one micro-batch: {f['loss_ms']['ours']:.1f} ms ours, "
                 f"{f['loss_ms']['full_logits']:.1f} ms full logits{share}")
    return lines

"""Benchmark train_gpt2.py's training step: ms/step, tokens/s, MFU, peak memory and the time spent waiting for data.

    python -m tools.bench                               # CPU: small preset, B=8, T=256; CUDA: GPT-2 124M, B=64, T=1024
    python -m tools.bench --compare                     # also the plain baseline, and the speed-up over it
    python -m tools.bench --vs_full_logits --compile    # ours against build-nanogpt's loss, same dtype and compile
    python -m tools.bench --generation                  # generation tokens/s with and without the key/value cache
    python -m tools.bench --model gpt2 --micro_batch_size 16 --seq_len 512 --dtype bf16 --compile --json
    python -m tools.bench --optimizer muon              # Muon for the block matrices: compare optimizer_ms with adamw
    python -m tools.bench --activation_checkpointing blocks   # the step with recomputed blocks, its memory
    python -m tools.bench --compile --attention cudnn   # the attention kernel put first (and the kernels that ran)
    python -m tools.bench --compile --fp8_head          # the output layer's matmuls in FP8 (sm89+ GPUs)
    python -m tools.bench --plan --memory_gb 24 80      # GPT-2 124M-1.5B on 1-8 cards: ddp/fsdp × checkpointing
    torchrun --standalone --nproc_per_node=2 -m tools.bench   # 2 ranks (NCCL on GPUs, gloo on CPUs)

It runs the real step (training.train_step, its data loader, dtype choice and parallel.build_training_model) on
random tokens written to a temporary shard directory, unless --data_dir points at real shards. Each configuration
gets --warmup untimed steps (torch.compile compiles in the first), then --steps timed ones; figures are medians.

--compare first times the plain baseline of the same model, build-nanogpt's step on this device: fp32, eager, the
for-loop AdamW, no TF32, glibc's default allocator and the loss on the full logits; then the configuration asked
for, which adds what train_gpt2.py does for speed (autocast in --dtype, fused AdamW, TF32 matmuls on GPUs, freed
memory kept for reuse on CPUs: keep_freed_memory, and the chunked loss that never builds the full logits). Back to
back, baseline first, because the allocator setting cannot be undone within a process; on a shared machine,
take the median speed-up of a few runs.

--vs_full_logits compares the loss alone: build-nanogpt's (the whole (B, T, padded vocab) logits, then cross-entropy
in fp32) against ours (training/loss.py), everything else the same: dtype, compile, fused AdamW. The
two alternate for --rounds rounds in one process, so that both see the same machine; the ratios are medians over the
rounds. It also times the loss's own forward and backward on one micro-batch of final hidden states, both ways, and
gives its share of the step.

--attention puts an attention kernel first (flash, cudnn, efficient, math; auto: the device's preferred, cuDNN's on
Hopper and later; default: torch's own order), falling back to the next that runs where it cannot
(attention_kernels.py); every configuration reports the kernels its last warm-up step ran. --compile_mode is
torch.compile's mode. Both are choices measured here before either becomes a flag of train_gpt2.py.

--generation times GPT.generate (the key/value cache; on CUDA its decode step is a CUDA graph; with --compile also
with that step compiled) against a whole-context forward per token, on the --model's random weights (the speed is
the same for trained ones): --new_tokens tokens after a 16-token prompt, one sample, top-k 50, and says whether all
gave the same tokens.

--plan measures no step: it prints, for GPT-2 124M, 350M, 774M and 1.5B on 1, 2, 4 and 8 cards of each --memory_gb
GiB, the largest micro-batch that fits a card under ddp and under fsdp, with each --activation_checkpointing (- where
not even one sequence does), for GPT-2's recipe (1,024-token sequences, 524,288 tokens per step, bf16, AdamW): the
budget of memory.py (fixed_bytes, largest_micro_batch) with the activations per sequence measured here (on CUDA
with the allocator's peak, elsewhere with MemTracker), from 1- and 2-layer models of each width. With --json:
seq_len, total_batch_size, activation_bytes_per_sequence {model: {mode: bytes}} and micro_batch {memory_gb: {model:
{cards: {"ddp none", ..., "fsdp selective": size}}}}.

--json prints one object: device, world_size, model, n_layer, n_head, n_embd, parameters, micro_batch_size,
seq_len, grad_accum_steps, tokens_per_step, flops_per_token, runs (a list; for each: name, dtype, compile,
ms_per_step, optimizer_ms, tokens_per_sec, tflops, peak_tflops, mfu, peak_source, peak_memory_mib (of the timed
steps), warmup_peak_memory_mib (of the warm-up steps, where torch.compile compiles), warmup_seconds (the same
steps' time: compilation, mostly), data_wait, loss, losses: every step's, warm-up included, so that a diverging
configuration shows; attention_choice: the kernel put first, and why; attention_kernels: the kernels the last
warm-up step ran, null without warm-up steps (gpu_check's perf stage also keeps kernel_ms: that step's CUDA
kernels' milliseconds by name); a configuration that ran out of
device memory has name, dtype, compile and skipped, the reason), speedup (the last run's tokens/s over the first's
with --compare, else null), memory (state_bytes: weights, gradients and AdamW moments;
activation_bytes_per_sequence, measured with MemTracker on the CPU or the allocator's peak on CUDA;
largest_micro_batch: per --memory_gb, the largest that fits with 10 % headroom), load_average (the machine's
1-minute load before and after) and cpu_count; with --vs_full_logits, full_logits (rounds: [baseline, ours] runs per
round; speed_ratio and memory_ratio: ours over the baseline, medians over the rounds, memory null on a CPU; loss_ms:
the loss's forward + backward on one micro-batch, both ways; loss_share: its share of our step); with --generation,
generation (new_tokens; tokens_per_sec of with_cache, without_cache and with --compile with_cache_compiled;
decode_tokens_per_sec of the cached ones; best_cached, the faster of those; speedup, its tokens/s over without_cache;
same_tokens). peak_memory_mib is
CUDA's max_memory_allocated, or on a CPU the process's peak resident memory (which never goes down, so a later
run's includes the earlier's). data_wait is the share of step time spent in the data loader; optimizer_ms the time
of the optimizer step(s) within a step (--optimizer muon: Muon's, with its Newton–Schulz iterations, and AdamW's
for the rest). With several ranks, times and memory are rank 0's.
"""

import argparse
import json
import os
import sys
import tempfile

import torch

from model import GPT
from tools.bench.generation import format_generation, time_generation
from tools.bench.loss import compare_with_full_logits, format_full_logits
from tools.bench.memory import format_plan, memory_budget, memory_plan
from tools.bench.step import Workload, make_workload, time_config_or_skip, write_random_shard
from training.attention_kernels import CHOICES
from training.config import HelpFormatter, add_flags
from training.distributed import Distributed, setup_distributed, teardown_distributed
from training.errors import run_entry_point
from training.memory import GiB, MiB
from training.precision import pick_dtype

# The flags that mean what they mean in train_gpt2.py; bench.py's own defaults depend on the device.
SHARED_FLAGS = ["arch", "model", "n_layer", "n_head", "n_embd", "micro_batch_size", "seq_len", "dtype", "compile",
                "fp8_head", "device", "optimizer", "max_lr", "activation_checkpointing"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_flags(parser, SHARED_FLAGS, defaults={"model": None, "micro_batch_size": None})
    parser.add_argument("--grad_accum_steps", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--attention", choices=CHOICES, default="default",
                        help="the attention kernel put first (default: torch's own order; auto: the device's "
                             "preferred)")
    parser.add_argument("--compile_mode", default=None,
                        help="torch.compile's mode with --compile, e.g. max-autotune-no-cudagraphs (default: its own)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (compilation happens here)")
    parser.add_argument("--data_dir", default=None, help="real train shards (default: random tokens in a temp dir)")
    parser.add_argument("--compare", action="store_true", help="also time the plain fp32 eager baseline")
    parser.add_argument("--vs_full_logits", action="store_true",
                        help="time ours against build-nanogpt's full-logits loss, same dtype and compile, alternating")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of --vs_full_logits")
    parser.add_argument("--generation", action="store_true",
                        help="also time generation with and without the key/value cache")
    parser.add_argument("--new_tokens", type=int, default=256, help="tokens generated by --generation")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--memory_gb", type=float, nargs="+", default=[24, 40, 80],
                        help="device memories (GiB) to fit the largest micro-batch into, from the measured budget")
    parser.add_argument("--plan", action="store_true",
                        help="no timing: which GPT-2 size fits 1-8 cards of --memory_gb, ddp or fsdp, with each "
                             "--activation_checkpointing, and at what micro-batch")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.grad_accum_steps < 1 or args.rounds < 1:
        parser.error("--steps, --grad_accum_steps and --rounds must be at least 1, --warmup at least 0.")
    return args


def workload_for(args: argparse.Namespace, dist_env: Distributed) -> Workload:
    """The training run's config for these flags: (by default) gpt2 at B=64 on CUDA, else small at B=8."""
    cuda = dist_env.device.type == "cuda"
    shared = {name: getattr(args, name) for name in SHARED_FLAGS}
    defaults = {"model": args.model or ("gpt2" if cuda else "small"),
                "micro_batch_size": args.micro_batch_size or (64 if cuda else 8), "data_dir": args.data_dir or ""}
    return make_workload(dist_env, args.grad_accum_steps, attention=args.attention, compile_mode=args.compile_mode,
                         **shared | defaults)


def benchmark(args: argparse.Namespace, dist_env: Distributed) -> dict:
    load_before = os.getloadavg()[0]
    work = workload_for(args, dist_env)
    config, seq_len = work.plan.model_config, work.plan.seq_len
    dtype = pick_dtype(args.dtype, dist_env.device)
    with tempfile.TemporaryDirectory(prefix="bench_shards_") as tmp:
        data_dir = args.data_dir
        if data_dir is None:
            write_random_shard(tmp, work, config.vocab_size)
            data_dir = tmp
        runs = []
        if args.compare:  # first: keep_freed_memory() in the other configuration cannot be undone
            runs.append(time_config_or_skip(work, data_dir, torch.float32, False, True, args.steps, args.warmup))
        runs.append(time_config_or_skip(work, data_dir, dtype, args.compile, False, args.steps, args.warmup))
        full_logits = compare_with_full_logits(work, data_dir, dtype, args.compile, args.steps, args.warmup,
                                               args.rounds) if args.vs_full_logits else None
    generation = time_generation(config, dist_env.device, args.new_tokens, compile=args.compile) \
        if args.generation else None
    with torch.device("meta"):  # for the counts only
        model = GPT(config)
    measured = [run for run in runs if "skipped" not in run]
    memory = memory_budget(work, dtype, args.memory_gb)
    return {"device": torch.cuda.get_device_name(dist_env.device) if dist_env.device.type == "cuda"
            else str(dist_env.device), "world_size": dist_env.world_size, "model": work.cfg.model,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
            "parameters": model.num_params(), "micro_batch_size": work.cfg.micro_batch_size,
            "seq_len": seq_len, "grad_accum_steps": work.plan.grad_accum_steps,
            "tokens_per_step": work.tokens_per_step, "flops_per_token": model.flops_per_token(seq_len),
            "runs": runs, "speedup": measured[-1]["tokens_per_sec"] / measured[0]["tokens_per_sec"]
            if args.compare and len(measured) == 2 else None,
            "memory": memory, "load_average": [load_before, os.getloadavg()[0]], "cpu_count": os.cpu_count()} | (
            {"full_logits": full_logits} if full_logits else {}) | ({"generation": generation} if generation else {})


def format_report(report: dict, args: argparse.Namespace) -> str:
    r = report
    lines = [f"{r['model']}: {r['n_layer']} layers, {r['n_head']} heads, {r['n_embd']} wide, {r['parameters']:,} "
             f"parameters | {r['device']} × {r['world_size']} rank(s) | optimizer {args.optimizer}",
             f"batch: {r['tokens_per_step']:,} tokens/step = {r['micro_batch_size']} × {r['seq_len']} × "
             f"{r['world_size']} rank(s) × {r['grad_accum_steps']} micro-step(s) | model FLOPs per token "
             f"{r['flops_per_token'] / 1e6:,.1f} M (6·N + attention)",
             f"{'configuration':30s} {'ms/step':>9s} {'optim ms':>9s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'peak':>7s} "
             f"{'MFU':>6s} {'peak mem':>10s} {'data wait':>9s}"]
    for run in r["runs"]:
        if "skipped" in run:
            lines.append(f"{run['name']:30s} skipped: {run['skipped']}")
            continue
        lines.append(f"{run['name']:30s} {run['ms_per_step']:9.1f} {run['optimizer_ms']:9.1f} "
                     f"{run['tokens_per_sec']:10,.0f} {run['tflops']:8.3f} {run['peak_tflops']:7.2f} "
                     f"{100 * run['mfu']:5.1f}% "
                     f"{run['peak_memory_mib']:7,.0f} MiB {100 * run['data_wait']:8.2f}%")
    if r["speedup"] is not None:
        lines.append(f"speed-up over the baseline: {r['speedup']:.2f}x")
    kernels = [run for run in r["runs"] if run.get("attention_kernels") is not None]
    if kernels:
        lines.append("attention kernels: " + "; ".join(
            f"{run['name']}: {', '.join(run['attention_kernels']) or 'none seen'} ({run['attention_choice']})"
            for run in kernels))
    if "full_logits" in r:
        lines += format_full_logits(r["full_logits"])
    if "generation" in r:
        g = r["generation"]
        lines.append(f"generation, {g['new_tokens']} tokens: {format_generation(g)}")
    m = r["memory"]
    fits = " | ".join(f"{gb} GiB: {b}" for gb, b in m["largest_micro_batch"].items())
    lines.append(f"memory: model state {m['state_bytes'] / GiB:.2f} GiB (weights, gradients, AdamW moments) + "
                 f"{m['activation_bytes_per_sequence'] / MiB:,.0f} MiB of activations per sequence of {r['seq_len']} "
                 f"tokens (measured) -> largest micro-batch (10% headroom) {fits}")
    peak_sources = "; ".join(sorted({run["peak_source"] for run in r["runs"] if "peak_source" in run}))
    lines.append(f"(medians of {args.steps} steps after {args.warmup} warm-up steps; peak: the hardware's FLOP/s in "
                 f"the run's dtype; {peak_sources})")
    before, after = r["load_average"]
    lines.append(f"machine load (1-minute average) before/after: {before:.1f}/{after:.1f} on {r['cpu_count']} cores"
                 + (" -- other work was running, so the figures (and the speed-up) may be off: re-run when the "
                    "machine is idle, or take the median of a few runs" if before > 0.5 * r["cpu_count"] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist_env = setup_distributed(args.device)
    try:
        report = memory_plan(args.memory_gb, dist_env.device) if args.plan else benchmark(args, dist_env)
    finally:
        teardown_distributed()
    if dist_env.is_master:
        print(json.dumps(report) if args.json else format_plan(report) if args.plan else format_report(report, args))


if __name__ == "__main__":
    run_entry_point(lambda: main(sys.argv[1:]))

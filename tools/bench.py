"""Benchmark train_gpt2.py's training step: ms/step, tokens/s, MFU, peak memory and the time spent waiting for data.

    python -m tools.bench                               # CPU: small preset, B=8, T=256; CUDA: GPT-2 124M, B=64, T=1024
    python -m tools.bench --compare                     # also the plain baseline, and the speed-up over it
    python -m tools.bench --vs_full_logits --compile    # ours against build-nanogpt's loss, same dtype and compile
    python -m tools.bench --generation                  # generation tokens/s with and without the key/value cache
    python -m tools.bench --model gpt2 --micro_batch_size 16 --seq_len 512 --dtype bf16 --compile --json
    python -m tools.bench --optimizer muon              # Muon for the block matrices: compare optimizer_ms with adamw
    python -m tools.bench --activation_checkpointing blocks   # the step with recomputed blocks, its memory
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
in fp32) against ours (model.ChunkedLinearCrossEntropy), everything else the same: dtype, compile, fused AdamW. The
two alternate for --rounds rounds in one process, so that both see the same machine; the ratios are medians over the
rounds. It also times the loss's own forward and backward on one micro-batch of final hidden states, both ways, and
gives its share of the step.

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
steps), warmup_peak_memory_mib (of the warm-up steps, where torch.compile compiles), data_wait, loss, losses: every
step's, warm-up included, so that a diverging configuration shows; a configuration that ran out of
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
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from config import HelpFormatter, Plan, TrainConfig, add_flags, resolve_plan
from dataloader import DistributedDataLoader, write_shard
from distributed import Distributed, setup_distributed, synchronize, teardown_distributed
from errors import run_entry_point
from memory import (
    GiB,
    MiB,
    activation_bytes_per_sequence_from_two_depths,
    keep_freed_memory,
    largest_micro_batch,
    measure_activation_bytes_per_sequence,
    plan_micro_batches,
    state_bytes,
)
from mfu import peak_flops
from model import (
    ACTIVATION_CHECKPOINTING,
    GPT,
    PRESETS,
    GPTConfig,
    linear_cross_entropy,
    loss_chunk_tokens,
    sample_next_token,
)
from parallel import build_training_model
from precision import autocast, dtype_name, pick_dtype
from training import train_step

# The flags that mean what they mean in train_gpt2.py; bench.py's own defaults depend on the device.
SHARED_FLAGS = ["arch", "model", "n_layer", "n_head", "n_embd", "micro_batch_size", "seq_len", "dtype", "compile",
                "device", "optimizer", "max_lr", "activation_checkpointing"]
# --plan: GPT-2's sizes, on this many cards each, at GPT-2's recipe
PLAN_MODELS = {"124M": "gpt2", "350M": "gpt2-medium", "774M": "gpt2-large", "1.5B": "gpt2-xl"}
PLAN_CARDS = (1, 2, 4, 8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_flags(parser, SHARED_FLAGS, defaults={"model": None, "micro_batch_size": None})
    parser.add_argument("--grad_accum_steps", type=int, default=1, help="micro-steps per optimizer step")
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


@dataclass
class Workload:
    cfg: TrainConfig
    plan: Plan
    dist_env: Distributed

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.total_batch_size


def make_workload(args: argparse.Namespace, dist_env: Distributed) -> Workload:
    """The training run's config for these flags: (by default) gpt2 at B=64 on CUDA, else small at B=8."""
    cuda = dist_env.device.type == "cuda"
    shared = {name: getattr(args, name) for name in SHARED_FLAGS}
    cfg = TrainConfig(**shared | {"model": args.model or ("gpt2" if cuda else "small"),
                                  "micro_batch_size": args.micro_batch_size or (64 if cuda else 8),
                                  "val_every": 0, "data_dir": args.data_dir or ""})
    seq_len = cfg.seq_len or PRESETS[cfg.model].block_size
    cfg.total_batch_size = cfg.micro_batch_size * seq_len * dist_env.world_size * args.grad_accum_steps
    return Workload(cfg, resolve_plan(cfg, dist_env.world_size), dist_env)


def write_random_shard(directory: str, work: Workload, vocab_size: int) -> None:
    """Four optimizer steps' worth of random tokens (the loader wraps around). Every rank writes the same ones."""
    num_tokens = 4 * work.tokens_per_step + 1
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=num_tokens, dtype=np.int64)
    write_shard(Path(directory) / "bench_train_000000.bin", tokens)


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource  # Unix only, so imported where it is needed

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def time_config(work: Workload, data_dir: str, dtype: torch.dtype, compile: bool, plain: bool, steps: int,
                warmup: int, full_logits: bool = False) -> dict:
    """Median timings of `steps` training steps of a fresh model in one configuration (plain: the baseline; full_logits:
    ours but for build-nanogpt's loss)."""
    device, dist_env, cfg, plan = work.dist_env.device, work.dist_env, work.cfg, work.plan
    torch.set_float32_matmul_precision("highest" if plain else "high")  # TF32 on GPUs, as train_gpt2.py sets
    if not plain and device.type == "cpu":
        keep_freed_memory()
    torch.manual_seed(cfg.seed)
    model = (FullLogitsGPT if plain or full_logits else GPT)(plan.model_config)
    trainee = build_training_model(model, dist_env, dtype, cfg, compile, plain)
    loader = DistributedDataLoader(data_dir, "train", cfg.micro_batch_size, plan.seq_len, dist_env.rank,
                                   dist_env.world_size, plan.grad_accum_steps)
    peak = peak_flops(device, dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    optimizer_seconds = time_optimizer_steps(trainee.optimizer, device)
    step_seconds, data_seconds, optimizer_ms, losses = [], [], [], []
    for step in range(warmup + steps):
        if step == warmup:  # the warm-up's peak (compilation and Inductor's autotuning allocate too), then the steps'
            warmup_peak_mib = peak_memory_mib(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        optimizer_seconds.clear()
        synchronize(device)
        t0 = time.perf_counter()
        # The LR warms up over the steps to --max_lr, as a run's would: at full LR from step 0 models diverge.
        lr = cfg.max_lr * (step + 1) / (warmup + steps)
        result = train_step(trainee.model, trainee.optimizer, trainee.scaler, loader, plan.grad_accum_steps, lr,
                            cfg.grad_clip, device, dtype)
        losses.append(result.loss)
        synchronize(device)
        if step >= warmup:
            step_seconds.append(time.perf_counter() - t0)
            data_seconds.append(result.data_seconds)
            optimizer_ms.append(1000 * sum(optimizer_seconds))

    seconds = statistics.median(step_seconds)
    flops_per_sec = trainee.raw.flops_per_token(plan.seq_len) * work.tokens_per_step / seconds
    return {"name": run_name(dtype, compile, plain, full_logits), "dtype": dtype_name(dtype), "compile": compile,
            "ms_per_step": 1000 * seconds, "optimizer_ms": statistics.median(optimizer_ms),
            "tokens_per_sec": work.tokens_per_step / seconds,
            "tflops": flops_per_sec / 1e12, "peak_tflops": peak.flops * dist_env.world_size / 1e12,
            "mfu": flops_per_sec / (peak.flops * dist_env.world_size), "peak_source": peak.source,
            "peak_memory_mib": peak_memory_mib(device), "warmup_peak_memory_mib": warmup_peak_mib,
            "data_wait": sum(data_seconds) / sum(step_seconds), "loss": result.loss, "losses": losses}


def time_optimizer_steps(optimizers, device: torch.device) -> list[float]:
    """A list that every optimizer.step() of these optimizers appends its seconds to (through torch's step hooks)."""
    seconds, started = [], []

    def before(*args) -> None:  # a pre-hook that returned something would replace the step's arguments
        synchronize(device)
        started.append(time.perf_counter())

    def after(*args) -> None:
        synchronize(device)
        seconds.append(time.perf_counter() - started.pop())

    for optimizer in optimizers:
        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)
    return seconds


class FullLogitsGPT(GPT):
    """The baseline's loss, as build-nanogpt computes it: the whole (B, T, padded vocab) logits, then cross-entropy on
    an fp32 copy of them (what autocast gives F.cross_entropy), where GPT's own loss works through the vocabulary a
    chunk of tokens at a time."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if targets is None:
            return super().forward(idx)
        logits = self.lm_head(self.hidden_states(idx))  # the padded width, padding columns included, as theirs
        return None, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def run_name(dtype: torch.dtype, compile: bool, plain: bool, full_logits: bool = False) -> str:
    if plain:
        return "fp32 eager, plain (baseline)"
    return f"{dtype_name(dtype)} {'compiled' if compile else 'eager'}" + (", full logits" if full_logits else "")


def time_config_or_skip(work: Workload, data_dir: str, dtype: torch.dtype, compile: bool, plain: bool, steps: int,
                        warmup: int, full_logits: bool = False) -> dict:
    """time_config, or, if the configuration runs out of device memory, a run that says so (the fp32 baseline at
    the defaults needs ~87 GiB: more than an 80 GB GPU), so that the other configurations still get measured."""
    try:
        return time_config(work, data_dir, dtype, compile, plain, steps, warmup, full_logits)
    except torch.OutOfMemoryError:
        name = run_name(dtype, compile, plain, full_logits)
        message = (f"out of memory at B={work.cfg.micro_batch_size}, T={work.plan.seq_len}: lower "
                   "--micro_batch_size to measure it")
        print(f"{name}: {message}; going on with the rest", file=sys.stderr)
        return {"name": name, "dtype": dtype_name(dtype), "compile": compile, "skipped": message}
    finally:  # give the memory back before the next configuration
        gc.collect()
        if work.dist_env.device.type == "cuda":
            torch.cuda.empty_cache()


def compare_with_full_logits(work: Workload, data_dir: str, dtype: torch.dtype, compile: bool, steps: int,
                             warmup: int, rounds: int) -> dict:
    """Ours against build-nanogpt's full-logits loss, everything else equal, alternating for `rounds` rounds."""
    per_round = [[time_config_or_skip(work, data_dir, dtype, compile, False, steps, warmup, full_logits)
                  for full_logits in (True, False)] for _ in range(rounds)]
    measured = [(theirs, ours) for theirs, ours in per_round if "skipped" not in theirs and "skipped" not in ours]
    cpu = work.dist_env.device.type != "cuda"  # the process's peak resident memory never goes down: no ratio
    loss_ms = {name: time_loss(work, dtype, compile, full) for name, full in (("full_logits", True), ("ours", False))}
    ours_step_ms = statistics.median(ours["ms_per_step"] for _, ours in measured) if measured else None
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


def format_generation(g: dict) -> str:
    """time_generation's figures in a line: each run's tokens/s (past the second token for the cached ones)."""
    speed = g["tokens_per_sec"]
    cached = ", ".join(f"{speed[name]:,.1f} tokens/s {name.replace('_', ' ')} ({decode:,.1f} past the second token)"
                       for name, decode in g["decode_tokens_per_sec"].items())
    return (f"{cached}; {speed['without_cache']:,.1f} without the cache; {g['best_cached'].replace('_', ' ')} "
            f"{g['speedup']:.1f}x as fast as without; same tokens: {g['same_tokens']}")


def time_generation(config: GPTConfig, device: torch.device, new_tokens: int, prompt_tokens: int = 16,
                    compile: bool = False) -> dict:
    """Tokens/s of GPT.generate (with compile, also with its decode step compiled) and of a whole-context forward per
    token (one sample, top-k 50, the same seed), and whether they all gave the same tokens. With the cache, also the
    tokens/s of the steps after the second token: what is left once the prompt is read and (on CUDA) the decode step
    captured, costs that a longer generation amortises. best_cached names the faster run with the cache; speedup is
    its tokens/s over the run without."""
    torch.manual_seed(0)
    model = GPT(config).to(device).eval()
    idx = torch.randint(0, config.vocab_size, (1, prompt_tokens), device=device)

    def timed(run, n: int) -> tuple[torch.Tensor, float]:
        synchronize(device)
        t0 = time.perf_counter()
        out = run(n, torch.Generator(device=device).manual_seed(42))
        synchronize(device)
        return out, time.perf_counter() - t0

    runs = {"with_cache": lambda n, g: model.generate(idx, n, 1.0, 50, generator=g),
            "without_cache": lambda n, g: generate_without_cache(model, idx, n, 50, g)}
    if compile:
        runs["with_cache_compiled"] = lambda n, g: model.generate(idx, n, 1.0, 50, generator=g, compile=True)
    outputs, tokens_per_sec, decode_tokens_per_sec = {}, {}, {}
    for name, run in runs.items():
        timed(run, 2)  # untimed: CUDA's kernels load at their first call, and a compiled step compiles
        outputs[name], seconds = timed(run, new_tokens)
        tokens_per_sec[name] = new_tokens / seconds
        if name != "without_cache":
            _, first_two = timed(run, 2)
            decode_tokens_per_sec[name] = (new_tokens - 2) / (seconds - first_two)
    best_cached = max(decode_tokens_per_sec, key=tokens_per_sec.get)
    return {"new_tokens": new_tokens, "tokens_per_sec": tokens_per_sec, "decode_tokens_per_sec": decode_tokens_per_sec,
            "best_cached": best_cached, "speedup": tokens_per_sec[best_cached] / tokens_per_sec["without_cache"],
            "same_tokens": all(torch.equal(out, outputs["without_cache"]) for out in outputs.values())}


@torch.no_grad()
def generate_without_cache(model: GPT, idx: torch.Tensor, max_new_tokens: int, top_k: int,
                           generator: torch.Generator) -> torch.Tensor:
    """Generation without the key/value cache: every token from a forward over the whole context."""
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.block_size:])
        idx = torch.cat((idx, sample_next_token(logits[:, -1].float(), 1.0, top_k, None, generator)), dim=1)
    return idx


def benchmark(args: argparse.Namespace, dist_env: Distributed) -> dict:
    load_before = os.getloadavg()[0]
    work = make_workload(args, dist_env)
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


def memory_budget(work: Workload, dtype: torch.dtype, memory_gb: list[float]) -> dict:
    """The model's state bytes, its measured activation bytes per sequence (on the CPU unless on CUDA), and the
    largest micro-batch that fits each of memory_gb GiB: a power of two dividing GPT-2's 512-sequence batch of
    1,024 tokens, or 0 if not even one sequence fits."""
    device = work.dist_env.device if work.dist_env.device.type == "cuda" else torch.device("cpu")
    config, seq_len = work.plan.model_config, work.plan.seq_len
    per_sequence = measure_activation_bytes_per_sequence(config, seq_len, dtype, device,
                                                         activation_checkpointing=work.cfg.activation_checkpointing)
    with torch.device("meta"):
        state = state_bytes(GPT(config))
    largest = {}
    for gb in memory_gb:
        try:
            largest[f"{gb:g}"] = largest_micro_batch(int(gb * GiB), state, per_sequence, 512).size
        except ValueError:
            largest[f"{gb:g}"] = 0
    return {"state_bytes": state, "activation_bytes_per_sequence": per_sequence, "largest_micro_batch": largest}


def memory_plan(memory_gb: list[float], device: torch.device, models: dict[str, GPTConfig] | None = None,
                seq_len: int = 1024, total_batch_size: int = 524_288) -> dict:
    """--plan (see the module doc): GPT-2's sizes unless `models`, at its recipe's sequence length and batch."""
    device = device if device.type == "cuda" else torch.device("cpu")
    models = models or {name: PRESETS[preset] for name, preset in PLAN_MODELS.items()}
    per_sequence = {name: {mode: activation_bytes_per_sequence_from_two_depths(config, seq_len, torch.bfloat16, device,
                                                                               mode)
                           for mode in ACTIVATION_CHECKPOINTING} for name, config in models.items()}
    micro_batch = {}
    for gb in memory_gb:
        micro_batch[f"{gb:g}"] = by_model = {}
        for name, config in models.items():
            by_model[name] = {}
            for cards in PLAN_CARDS:
                fits = plan_micro_batches(config, per_sequence[name], int(gb * GiB), cards, seq_len, total_batch_size,
                                          torch.bfloat16)
                by_model[name][cards] = {f"{parallel} {mode}": size for (parallel, mode), size in fits.items()}
    return {"device": str(device), "seq_len": seq_len, "total_batch_size": total_batch_size,
            "activation_bytes_per_sequence": per_sequence, "micro_batch": micro_batch}


def format_plan(plan: dict) -> str:
    """--plan's tables, in Markdown (the README's are these)."""
    columns = [f"{parallel} {mode}" for parallel in ("ddp", "fsdp") for mode in ACTIVATION_CHECKPOINTING]
    lines = [f"activations per sequence of {plan['seq_len']:,} tokens, bf16, measured on {plan['device']}, "
             f"{' / '.join(ACTIVATION_CHECKPOINTING)}: " + "; ".join(
                 f"{name} " + " / ".join(f"{b / MiB:,.0f}" for b in modes.values()) + " MiB"
                 for name, modes in plan["activation_bytes_per_sequence"].items())]
    for gb, models in plan["micro_batch"].items():
        lines += ["", f"{gb} GiB per card: the largest micro-batch that fits ({plan['total_batch_size']:,} tokens "
                      "per step, AdamW; -: not even one sequence fits)", "",
                  "| model | cards | " + " | ".join(c.replace(" none", "").replace(" ", " + ") for c in columns)
                  + " |", "|---|---:|" + "---:|" * len(columns)]
        for name, by_cards in models.items():
            for cards, sizes in by_cards.items():
                lines.append(f"| {name} | {cards} | " + " | ".join(str(sizes[c] or "-") for c in columns) + " |")
    return "\n".join(lines)


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

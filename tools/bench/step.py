"""Timing train_gpt2.py's real training step (not a command: tools/bench.py and tools/gpu_check.py share it): a
configuration's median ms/step, tokens/s, MFU, peak memory, optimizer time and data wait over a few steps of a fresh
model, the full-logits baseline's model, and a configuration that runs out of memory reported instead of raised."""

import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dataloader import DistributedDataLoader, write_shard
from model import GPT, PRESETS
from training.attention_kernels import attention_kernel, choose_kernel, kernels_in_profile
from training.config import Plan, TrainConfig
from training.distributed import Distributed, synchronize
from training.inputs import resolve_plan
from training.memory import keep_freed_memory
from training.mfu import peak_flops
from training.parallel import TrainingModel, build_training_model
from training.precision import dtype_name
from training.step import train_step

T = TypeVar("T")


@dataclass
class Workload:
    cfg: TrainConfig
    plan: Plan
    dist_env: Distributed
    # How the step runs beyond train_gpt2.py's flags: choices measured here before any becomes a flag
    attention: str = "default"  # the attention kernel, one of attention_kernels.CHOICES
    compile_mode: str | None = None  # torch.compile's mode (None: its default)
    kernel_table: bool = False  # also keep the device kernels' times of the last warm-up step (CUDA only)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.total_batch_size


def make_workload(dist_env: Distributed, grad_accum_steps: int = 1, *, attention: str = "default",
                  compile_mode: str | None = None, kernel_table: bool = False, **flags) -> Workload:
    """The training run's config for these TrainConfig flags (validation off), its batch grad_accum_steps micro-steps
    of --micro_batch_size sequences on every rank, and the step's other choices (see Workload)."""
    cfg = TrainConfig(**{"val_every": 0} | flags)
    seq_len = cfg.seq_len or PRESETS[cfg.model or "gpt2"].block_size
    cfg.total_batch_size = cfg.micro_batch_size * seq_len * dist_env.world_size * grad_accum_steps
    return Workload(cfg, resolve_plan(cfg, dist_env.world_size), dist_env, attention, compile_mode, kernel_table)


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
    ours but for build-nanogpt's loss, in the autocast dtype), and the attention kernels it ran."""
    device, dist_env, cfg, plan = work.dist_env.device, work.dist_env, work.cfg, work.plan
    torch.set_float32_matmul_precision("highest" if plain else "high")  # TF32 on GPUs, as train_gpt2.py sets
    if not plain and device.type == "cpu":
        keep_freed_memory()
    torch.manual_seed(cfg.seed)
    model = (FullLogitsGPT if plain or full_logits else GPT)(plan.model_config)
    if plain or full_logits:
        cfg = replace(cfg, fp8_head=False)
    config = plan.model_config
    kernel, attention_choice = choose_kernel("default" if plain else work.attention, device, dtype,
                                             config.n_embd // config.n_head)
    peak = peak_flops(device, dtype)  # (before the steps: measured, it allocates, and the steps' peak is reset after)
    with attention_kernel(kernel):  # around the compiling step too: the compiled code keeps the kernel it traced
        trainee = build_training_model(model, dist_env, dtype, cfg, compile, plain, compile_mode=work.compile_mode)
        timed = time_steps(trainee, work, data_dir, dtype, steps, warmup)
    seconds = statistics.median(timed.step_seconds)
    flops_per_sec = trainee.raw.flops_per_token(plan.seq_len) * work.tokens_per_step / seconds
    return {"name": run_name(dtype, compile, plain, full_logits, work, cfg.fp8_head), "dtype": dtype_name(dtype),
            "compile": compile, "ms_per_step": 1000 * seconds, "optimizer_ms": statistics.median(timed.optimizer_ms),
            "tokens_per_sec": work.tokens_per_step / seconds,
            "tflops": flops_per_sec / 1e12, "peak_tflops": peak.flops * dist_env.world_size / 1e12,
            "mfu": flops_per_sec / (peak.flops * dist_env.world_size), "peak_source": peak.source,
            "peak_memory_mib": peak_memory_mib(device), "warmup_peak_memory_mib": timed.warmup_peak_mib,
            "warmup_seconds": timed.warmup_seconds,
            "data_wait": sum(timed.data_seconds) / sum(timed.step_seconds), "loss": timed.losses[-1],
            "losses": timed.losses, "attention_choice": attention_choice, "attention_kernels": timed.kernels} | (
        {"kernel_ms": timed.kernel_ms} if timed.kernel_ms is not None else {})


@dataclass
class TimedSteps:
    step_seconds: list[float]  # of the timed steps
    data_seconds: list[float]
    optimizer_ms: list[float]
    losses: list[float]  # of every step, warm-up included
    warmup_peak_mib: float
    warmup_seconds: float  # of the warm-up steps: with --compile, mostly compilation
    kernels: list[str] | None  # the attention kernels of the last warm-up step (None: no warm-up step)
    kernel_ms: dict[str, float] | None  # with Workload.kernel_table on CUDA: its device kernels' milliseconds


def time_steps(trainee: TrainingModel, work: Workload, data_dir: str, dtype: torch.dtype, steps: int,
               warmup: int) -> TimedSteps:
    """warmup untimed training steps (the last one profiled for its attention kernels), then `steps` timed ones."""
    device, cfg, plan = work.dist_env.device, work.cfg, work.plan
    loader = DistributedDataLoader(data_dir, "train", cfg.micro_batch_size, plan.seq_len, work.dist_env.rank,
                                   work.dist_env.world_size, plan.grad_accum_steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    optimizer_seconds = time_optimizer_steps(trainee.optimizer, device)
    timed = TimedSteps([], [], [], [], 0.0, 0.0, None, None)
    kernel_table = work.kernel_table and device.type == "cuda"
    for step in range(warmup + steps):
        if step == warmup:  # the warm-up's peak (compilation and Inductor's autotuning allocate too), then the steps'
            timed.warmup_peak_mib = peak_memory_mib(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        optimizer_seconds.clear()
        synchronize(device)
        t0 = time.perf_counter()
        # The LR warms up over the steps to --max_lr, as a run's would: at full LR from step 0 models diverge.
        lr = cfg.max_lr * (step + 1) / (warmup + steps)
        step_fn = functools.partial(train_step, trainee.model, trainee.optimizer, trainee.scaler, loader,
                                    plan.grad_accum_steps, lr, cfg.grad_clip, device, dtype)
        if step == warmup - 1:
            result, timed.kernels, timed.kernel_ms = profiled(step_fn, kernel_table)
        else:
            result = step_fn()
        timed.losses.append(result.loss)
        synchronize(device)
        if step < warmup:
            timed.warmup_seconds += time.perf_counter() - t0
        else:
            timed.step_seconds.append(time.perf_counter() - t0)
            timed.data_seconds.append(result.data_seconds)
            timed.optimizer_ms.append(1000 * sum(optimizer_seconds))
    return timed


def profiled(step: Callable[[], T], kernel_table: bool) -> tuple[T, list[str], dict[str, float] | None]:
    """step()'s result, the attention kernels it ran (its CPU-side ops name them), and with kernel_table the device
    time of each CUDA kernel it launched, in ms (None without)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kernel_table else [])
    with profile(activities=activities) as prof:
        result = step()
    kernels = kernels_in_profile(event.name for event in prof.events())
    if not kernel_table:
        return result, kernels, None
    return result, kernels, {event.key: event.self_device_time_total / 1000 for event in prof.key_averages()
                             if event.device_type == DeviceType.CUDA and event.self_device_time_total > 0}


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


def run_name(dtype: torch.dtype, compile: bool, plain: bool, full_logits: bool = False,
             work: Workload | None = None, fp8_head: bool = False) -> str:
    """The configuration's name: dtype and compilation, then what differs from bench.py's defaults."""
    if plain:
        return "fp32 eager, plain (baseline)"
    name = f"{dtype_name(dtype)} {'compiled' if compile else 'eager'}" + (", full logits" if full_logits else "")
    if fp8_head:
        name += ", fp8 head"
    if work is not None:
        name += (f", attention {work.attention}" if work.attention != "default" else "") + (
            f", {work.compile_mode}" if work.compile_mode and compile else "")
    return name


def time_config_or_skip(work: Workload, data_dir: str, dtype: torch.dtype, compile: bool, plain: bool, steps: int,
                        warmup: int, full_logits: bool = False) -> dict:
    """time_config, or, if the configuration runs out of device memory, a run that says so (the fp32 baseline at
    the defaults needs ~87 GiB: more than an 80 GB GPU), so that the other configurations still get measured."""
    try:
        return time_config(work, data_dir, dtype, compile, plain, steps, warmup, full_logits)
    except torch.OutOfMemoryError:
        name = run_name(dtype, compile, plain, full_logits, work, work.cfg.fp8_head and not (plain or full_logits))
        message = (f"out of memory at B={work.cfg.micro_batch_size}, T={work.plan.seq_len}: lower "
                   "--micro_batch_size to measure it")
        print(f"{name}: {message}; going on with the rest", file=sys.stderr)
        return {"name": name, "dtype": dtype_name(dtype), "compile": compile, "skipped": message}
    finally:
        release_memory(work.dist_env.device)


def release_memory(device: torch.device) -> None:
    """Give a finished configuration's memory back before the next one (compiled models hold reference cycles)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_ms(run: Callable[[], object], device: torch.device) -> float:
    """run()'s time in ms, the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return 1000 * (time.perf_counter() - start)

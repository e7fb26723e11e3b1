"""How much memory training takes, and the largest micro-batch that fits.

Training memory is a fixed part, the model's state (weights, gradients, AdamW's moments), plus a part that grows with
the micro-batch: the activations kept for backward. The first is arithmetic (state_bytes), the second is measured by
running a real forward and backward under torch's MemTracker (measure_activation_bytes_per_sequence), and
largest_micro_batch puts the two against the memory a device has.
"""

import ctypes
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker

from model import GPT, GPTConfig
from training.activation_checkpointing import set_activation_checkpointing
from training.config import TrainConfig
from training.distributed import Distributed
from training.errors import UserError
from training.inputs import resolve_plan
from training.loss import loss_chunk_tokens

ADAMW_BYTES_PER_PARAM = 8  # two fp32 moments (exp_avg, exp_avg_sq) per parameter, whatever the parameter's dtype
MiB = 2**20
GiB = 2**30


def state_bytes(model: nn.Module) -> int:
    """Bytes of the parameters, their gradients (same dtype) and AdamW's two fp32 moments: 16 per fp32 parameter.

    model.parameters() yields a tied weight (lm_head = wte) once, as the optimizer sees it. Only shapes and dtypes
    are read, so a model built on the meta device (no memory allocated) gives the same answer.
    """
    return sum(p.numel() * (2 * p.element_size() + ADAMW_BYTES_PER_PARAM) for p in model.parameters())


def measure_activation_bytes_per_sequence(config: GPTConfig, seq_len: int, dtype: torch.dtype, device: str = "cpu",
                                          batch_size: int = 2, activation_checkpointing: str = "none") -> int:
    """Activation memory of one more sequence in a micro-batch: forward + backward of a fresh model at 1 and at
    batch_size sequences, under autocast to dtype (unless fp32) and with --activation_checkpointing's recomputation,
    peak memory above the model's state, and the difference divided by batch_size - 1.

    Why a difference and not peak / batch_size: part of the peak does not grow with the batch (autocast's low-precision
    copies of the weights, one chunk of the loss's logits, the stored lm_head gradient), and dividing would spread it
    over the sequences, so the figure would depend on the batch size it was measured at. The difference is the slope;
    the fixed part is left to largest_micro_batch's headroom. The loss is measured in chunks of one sequence, so that
    its chunk is the same at 1 and at batch_size sequences and drops out of the slope (a run's own chunk, a few
    thousand tokens on a GPU, is part of the fixed cost).
    """
    if batch_size < 2:
        raise ValueError(f"batch_size must be at least 2 to measure a difference, got {batch_size}")
    torch.manual_seed(0)
    model = GPT(config).to(device)
    model.loss_chunk_tokens = seq_len
    set_activation_checkpointing(model, activation_checkpointing)
    # Unmeasured: the process's first matmuls and attention allocate cuBLAS's and cuDNN's workspaces, which would
    # otherwise land in the B=1 peak only and make the per-sequence slope 32-64 MiB low.
    _peak_activation_bytes(model, 1, seq_len, dtype)
    peak_1 = _peak_activation_bytes(model, 1, seq_len, dtype)
    peak_b = _peak_activation_bytes(model, batch_size, seq_len, dtype)
    return (peak_b - peak_1) // (batch_size - 1)


def activation_bytes_per_sequence_from_two_depths(config: GPTConfig, seq_len: int, dtype: torch.dtype,
                                                  device: str = "cpu", activation_checkpointing: str = "none") -> int:
    """measure_activation_bytes_per_sequence of config's whole depth, from models of 1 and 2 of its layers: every
    block keeps the same tensors, so the figure grows by the same amount per layer on top of what the embeddings and
    the loss keep. (Measuring GPT-2 1.5B whole would take a CPU minutes per mode, and more memory than it has.)"""
    one, two = (measure_activation_bytes_per_sequence(replace(config, n_layer=n), seq_len, dtype, device,
                                                      activation_checkpointing=activation_checkpointing)
                for n in (1, 2))
    return one + (config.n_layer - 1) * (two - one)


def _peak_activation_bytes(model: GPT, batch_size: int, seq_len: int, dtype: torch.dtype) -> int:
    """Peak bytes above parameters and gradients during one micro-step's forward + backward: on CUDA from its
    allocator's own counters, elsewhere from MemTracker."""
    device = model.transformer.wte.weight.device
    # Gradients already exist from the previous micro-step of an accumulation, so the backward adds into them instead
    # of creating them: the steady state, and the one whose peak is highest.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(batch_size)
    idx, targets = torch.randint(0, model.config.vocab_size, (2, batch_size, seq_len), generator=g).to(device)

    def forward_backward() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = model(idx, targets)
        loss.backward()

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        state = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        forward_backward()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        tracker = MemTracker()
        tracker.track_external(model)  # parameters and the gradients above: the state, subtracted below
        state = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("current").values())
        with tracker:
            forward_backward()
        peak = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    model.zero_grad(set_to_none=True)
    return peak - state


@dataclass(frozen=True)
class MicroBatch:
    size: int  # sequences per forward/backward
    reason: str  # one line a person can check: the budget, and what stopped the micro-batch from being larger


def largest_micro_batch(available_bytes: int, fixed_bytes: int, bytes_per_sequence: int, rank_batch_sequences: int,
                        headroom: float = 0.1) -> MicroBatch:
    """The largest micro-batch B with fixed_bytes + B · bytes_per_sequence <= available_bytes · (1 - headroom) that
    divides rank_batch_sequences (this rank's share of one optimizer step), so gradient accumulation adds up to
    exactly the batch asked for.

    fixed_bytes is state_bytes plus anything else resident; the headroom covers what the per-sequence slope leaves
    out (allocator fragmentation, the loss's chunk, CUDA context, autocast's weight copies). If not even one sequence
    fits, training cannot run at all, so that is a ValueError naming the numbers, not a micro-batch of 1 that would
    only fail later with an out-of-memory error.
    """
    budget = int(available_bytes * (1 - headroom))
    need_one = fixed_bytes + bytes_per_sequence
    if need_one > budget:
        raise ValueError(f"one sequence does not fit: {need_one / GiB:.2f} GiB ({fixed_bytes / GiB:.2f} GiB fixed + "
                         f"{bytes_per_sequence / GiB:.2f} GiB per sequence) > {budget / GiB:.2f} GiB "
                         f"({available_bytes / GiB:.2f} GiB less {headroom:.0%} headroom). Use a smaller model or "
                         "shorter sequences, or more memory per rank.")
    fits = min((budget - fixed_bytes) // bytes_per_sequence, rank_batch_sequences)
    size = max(b for b in range(1, fits + 1) if rank_batch_sequences % b == 0)
    if size == rank_batch_sequences:
        limit = f"the rank's whole batch of {rank_batch_sequences} sequences fits, so no accumulation"
    elif size == fits:
        limit = f"{size + 1} would not fit"
    else:
        limit = f"{fits} would fit, but {size} is the largest that divides the rank's {rank_batch_sequences} sequences"
    reason = (f"micro-batch {size}: {fixed_bytes / GiB:.2f} GiB fixed + {size} × {bytes_per_sequence / MiB:.0f} MiB "
              f"<= {budget / GiB:.2f} GiB ({available_bytes / GiB:.2f} GiB less {headroom:.0%} headroom); {limit}")
    return MicroBatch(size, reason)


def available_bytes(device: torch.device, ranks_on_node: int) -> int:
    """The memory one rank may use: a GPU's free memory; on MPS, the working set macOS recommends less what is in
    use; on a CPU, the RAM the kernel says is available, shared by the node's ranks."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    if device.type == "mps":
        return torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
    with open("/proc/meminfo") as f:  # Linux; elsewhere, the free physical pages
        meminfo = dict(line.split(":", 1) for line in f)
    return int(meminfo["MemAvailable"].split()[0]) * 1024 // ranks_on_node


def fixed_bytes(config: GPTConfig, world_size: int, parallel: str, dtype: torch.dtype) -> int:
    """What a rank holds whatever its micro-batch size.

    ddp: the whole state (state_bytes) on every rank, plus DDP's gradient buckets when there are peers (one more
    copy of the gradients, 4 of the 16 bytes/parameter).
    fsdp: the rank's 1/world_size of the state; the units FSDP gathers whole while they compute, in the compute
    dtype, weights and their gradients: the root (embeddings, tied output layer, last LayerNorm; gathered for the
    whole forward and backward) and two Blocks (the one computing and the one prefetched); and, under gradient
    accumulation, the unsharded gradients of every parameter in fp32, which FSDP2 keeps between micro-steps that do
    not reduce-scatter (FSDPParam.unsharded_accumulated_grad). The last is counted even when the rank's whole batch
    is one micro-step: it is small where that fits.
    """
    with torch.device("meta"):
        model = GPT(config)
    state = state_bytes(model)
    if parallel == "ddp":
        return state + (state // 4 if world_size > 1 else 0)
    params = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    root = params - config.n_layer * block
    gathered = 2 * (root + 2 * block) * dtype.itemsize  # weights and their gradients (fsdp refuses fp16)
    accumulated_grads = 4 * params
    return state // world_size + gathered + accumulated_grads


def compiled_loss_bytes_per_sequence(config: GPTConfig, seq_len: int, dtype: torch.dtype, chunk_tokens: int) -> int:
    """What a compiled training step on a GPU holds beyond eager's activations, per sequence: the loss's logits of
    every chunk (at the padded width, in the matmuls' dtype) and every chunk's partial weight gradient, all at once,
    where eager frees each with its chunk. Measured on an H200 (torch 2.11, GPT-2 124M, T=1024, bf16, chunks of 4,096
    tokens): compiled peaked 103 and 105 MiB a sequence above eager at B=128 and 256 while it saved less for backward
    (`dev/compiled_memory.py`); this count gives 117. Inductor's CPU code (torch 2.13) holds one chunk's logits but
    every chunk's weight-gradient product, whose adds into the fp32 sum it fuses into one kernel after the last chunk
    (tools/bench/loss_memory.py); the CUDA code is read by `python -m tools.gpu_check --stage perf`, and the candidate
    fixes are measured by `python -m dev.loss_schedules`."""
    itemsize = dtype.itemsize
    vocab = config.padded_vocab_size
    return seq_len * vocab * itemsize + seq_len * vocab * config.n_embd * itemsize // chunk_tokens


def auto_micro_batch(config: GPTConfig, seq_len: int, total_batch_size: int, world_size: int, device: torch.device,
                     dtype: torch.dtype, ranks_on_node: int, parallel: str = "ddp",
                     activation_checkpointing: str = "none", compile: bool = False) -> MicroBatch:
    """--micro_batch_size auto: measure this model's activations per sequence on the device (on MPS: on the CPU,
    whose figure is the same model's), with the run's --activation_checkpointing, and fit as many sequences as divide
    this rank's share of the batch, next to what the rank holds anyway (fixed_bytes: the whole model state under ddp,
    a shard of it under fsdp). Compiled on a GPU, each sequence also costs what the compiled loss holds
    (compiled_loss_bytes_per_sequence)."""
    rank_tokens, remainder = divmod(total_batch_size, world_size * seq_len)
    if remainder:
        raise ValueError(f"--total_batch_size {total_batch_size} is not a whole number of sequences per rank "
                         f"(--seq_len {seq_len} × {world_size} ranks)")
    measure_on = device if device.type == "cuda" else torch.device("cpu")
    per_sequence = measure_activation_bytes_per_sequence(config, seq_len, dtype, measure_on,
                                                         activation_checkpointing=activation_checkpointing)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's memory back to the device, so that it counts as free
        if compile:
            per_sequence += compiled_loss_bytes_per_sequence(config, seq_len, dtype, loss_chunk_tokens(device))
    fixed = fixed_bytes(config, world_size, parallel, dtype)
    return largest_micro_batch(available_bytes(device, ranks_on_node), fixed, per_sequence, rank_tokens)


def choose_micro_batch(cfg: TrainConfig, dist_env: Distributed, dtype: torch.dtype, print0) -> int:
    """--micro_batch_size auto: the largest micro-batch that fits the device's memory (memory.auto_micro_batch) and
    divides the rank's share of the batch; the smallest rank's choice, so that every rank takes the same.

    A rank where not even one sequence fits (by the arithmetic, or the probe itself running out of memory) takes
    part in the MIN all-reduce with 0, so that every rank learns of it and raises, none waiting for a peer."""
    plan = resolve_plan(replace(cfg, micro_batch_size=1), dist_env.world_size)  # every other flag checked first
    try:
        choice, failure = auto_micro_batch(plan.model_config, plan.seq_len, cfg.total_batch_size, dist_env.world_size,
                                           dist_env.device, dtype, int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                                           cfg.parallel, cfg.activation_checkpointing, cfg.compile), None
    except ValueError as e:
        choice, failure = None, str(e)
    except torch.OutOfMemoryError as e:
        choice, failure = None, (f"one sequence does not fit: measuring the activations of one and two sequences "
                                 f"ran out of memory ({str(e).strip().splitlines()[0]})")
    if failure and dist_env.device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's memory back, as the error leaves
    size = torch.tensor(choice.size if choice else 0, device=dist_env.device)
    if dist.is_initialized():
        dist.all_reduce(size, op=dist.ReduceOp.MIN)
    if size.item() == 0:
        reason = failure or "one sequence does not fit on another rank (its error says by how much)"
        raise UserError(f"--micro_batch_size auto: {reason.rstrip('.')}. Lower --seq_len, pick a smaller model, or "
                        "use more ranks (with --parallel fsdp, each holds a smaller share of the model).")
    print0(f"--micro_batch_size auto: {choice.reason}"
           + (f"; {size.item()}, another rank's smaller choice, on every rank" if size.item() != choice.size else ""))
    return size.item()


def plan_micro_batches(config: GPTConfig, bytes_per_sequence: dict[str, int], memory_bytes: int, cards: int,
                       seq_len: int, total_batch_size: int, dtype: torch.dtype) -> dict[tuple[str, str], int]:
    """bench.py --plan: for `cards` cards of memory_bytes each, {(parallel, activation checkpointing): the largest
    micro-batch that fits a card next to what it holds under that parallelism (fixed_bytes), or 0 if not even one
    sequence does}, from the activations per sequence of each checkpointing mode."""
    rank_sequences = total_batch_size // (seq_len * cards)
    fits = {}
    for parallel in ("ddp", "fsdp"):
        fixed = fixed_bytes(config, cards, parallel, dtype)
        for mode, per_sequence in bytes_per_sequence.items():
            try:
                fits[parallel, mode] = largest_micro_batch(memory_bytes, fixed, per_sequence, rank_sequences).size
            except ValueError:  # one sequence does not fit
                fits[parallel, mode] = 0
    return fits


def keep_freed_memory() -> None:
    """On a CPU with glibc (Linux), keep freed memory in the process for reuse instead of returning it to the OS.

    glibc hands every freed block over 32 MB straight back to the kernel, so each step's large activations and
    gradients are page-faulted and zeroed afresh in the next step (1.3-1.6x slower steps on the small preset on
    2 cores: bench.py). The price: freed blocks are reused less tightly than fresh pages, so the peak resident
    memory grows, once; it does not creep up over a run.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, Windows, musl): nothing to tune
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from <malloc.h>
    libc.mallopt(M_MMAP_MAX, 0)  # big blocks come from the heap, where freed ones are reused...
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # ...and the heap is never shrunk



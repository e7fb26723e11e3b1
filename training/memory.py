"""--micro_batch_size auto: the largest micro-batch whose memory fits the device, a fixed part (by arithmetic:
fixed_bytes) plus each sequence's activations (measured by a real forward and backward). See docs/memory.md."""

import contextlib
import ctypes
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from model import GPT, GPTConfig
from training.config import TrainConfig
from training.distributed import Distributed
from training.errors import UserError
from training.inputs import resolve_plan
from training.loss import loss_chunk_tokens
from training.recompute import set_activation_checkpointing

ADAMW_BYTES_PER_PARAM = 8  # two fp32 moments (exp_avg, exp_avg_sq) per parameter, whatever the parameter's dtype
MiB = 2**20
GiB = 2**30


def state_bytes(model: nn.Module) -> int:
    """Bytes of the parameters, their gradients and AdamW's two fp32 moments (a tied weight once; meta models too)."""
    return sum(p.numel() * (2 * p.element_size() + ADAMW_BYTES_PER_PARAM) for p in model.parameters())


def measure_activation_bytes_per_sequence(config: GPTConfig, seq_len: int, dtype: torch.dtype, device: str = "cpu",
                                          batch_size: int = 2, activation_checkpointing: str = "none") -> int:
    """Activation memory of one more sequence: a fresh model's forward and backward peak above its state at
    batch_size sequences less that at 1, over batch_size - 1. A difference, as part of the peak does not grow with
    the batch (autocast's weight copies, lm_head's gradient, the loss's one-sequence chunk): left to the headroom."""
    torch.manual_seed(0)
    on_cpu = torch.device(device).type == "cpu"
    # On the CPU, on fake tensors: MemTracker counts the same storages without the arithmetic (GPT-2 124M, T=1024,
    # bf16: 13 s instead of 70).
    with FakeTensorMode() if on_cpu else contextlib.nullcontext():
        model = GPT(config) if on_cpu else GPT(config).to(device)  # (.to cannot swap fake parameters: no need here)
        model.loss_chunk_tokens = seq_len
        set_activation_checkpointing(model, activation_checkpointing)
        # Unmeasured: the process's first matmuls and attention allocate cuBLAS's and cuDNN's workspaces, which would
        # otherwise land in the B=1 peak only and make the per-sequence slope 32-64 MiB low.
        _peak_activation_bytes(model, 1, seq_len, dtype)
        peak_1 = _peak_activation_bytes(model, 1, seq_len, dtype)
        peak_b = _peak_activation_bytes(model, batch_size, seq_len, dtype)
    return (peak_b - peak_1) // (batch_size - 1)


def _peak_activation_bytes(model: GPT, batch_size: int, seq_len: int, dtype: torch.dtype) -> int:
    """Peak bytes above parameters and gradients in one forward + backward (CUDA's counters, elsewhere MemTracker's)."""
    device = model.transformer.wte.weight.device
    # Gradients exist from the previous micro-step, as in an accumulation: the steady state, with the highest peak.
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
        from torch.distributed._tools.mem_tracker import MemTracker  # (imports torch._dynamo: a second of start-up)

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
    """The largest B dividing rank_batch_sequences with fixed_bytes + B · bytes_per_sequence <= available_bytes ·
    (1 - headroom), which covers what the slope leaves out (fragmentation, the loss's chunk, CUDA's context)."""
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
    """The memory one rank may use: a GPU's free memory, MPS's recommended working set less what is in use, or the
    RAM Linux says is available, shared by the node's ranks."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        return torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
    with open("/proc/meminfo") as f:
        meminfo = dict(line.split(":", 1) for line in f)
    return int(meminfo["MemAvailable"].split()[0]) * 1024 // ranks_on_node


def fixed_bytes(config: GPTConfig, world_size: int, parallel: str, dtype: torch.dtype) -> int:
    """What a rank holds whatever its micro-batch. ddp: the state, plus DDP's gradient buckets (4 of a parameter's 16
    bytes) with peers. fsdp: 1/world_size of the state; the gathered weights and gradients, in the compute dtype, of
    the root and two Blocks (computing, prefetched); the fp32 gradients FSDP2 keeps unsharded between micro-steps."""
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
    """What a compiled step on a GPU holds beyond eager's activations, per sequence: every chunk's logits and partial
    weight gradient at once (H200, 124M, T=1024, bf16: 103-105 MiB measured by dev/compiled_memory.py, 117 here)."""
    logits_bytes = seq_len * config.padded_vocab_size * dtype.itemsize
    return logits_bytes + logits_bytes * config.n_embd // chunk_tokens


def auto_micro_batch(config: GPTConfig, seq_len: int, total_batch_size: int, world_size: int, device: torch.device,
                     dtype: torch.dtype, ranks_on_node: int, parallel: str = "ddp",
                     activation_checkpointing: str = "none", compile: bool = False) -> MicroBatch:
    """The largest micro-batch that fits this rank: the activations per sequence measured on the device (MPS's on the
    CPU) with --activation_checkpointing (and the compiled loss's), next to fixed_bytes. (total_batch_size is a whole
    number of sequences per rank: make_plan checked.)"""
    rank_sequences = total_batch_size // (world_size * seq_len)
    measure_on = device if device.type == "cuda" else torch.device("cpu")
    per_sequence = measure_activation_bytes_per_sequence(config, seq_len, dtype, measure_on,
                                                         activation_checkpointing=activation_checkpointing)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's memory back to the device, so that it counts as free
        if compile:
            per_sequence += compiled_loss_bytes_per_sequence(config, seq_len, dtype, loss_chunk_tokens(device))
    fixed = fixed_bytes(config, world_size, parallel, dtype)
    return largest_micro_batch(available_bytes(device, ranks_on_node), fixed, per_sequence, rank_sequences)


def choose_micro_batch(cfg: TrainConfig, dist_env: Distributed, dtype: torch.dtype, print0) -> int:
    """--micro_batch_size auto: the smallest rank's auto_micro_batch on every rank. A rank where not even one sequence
    fits joins the MIN all-reduce with 0, so that every rank raises, none waiting for a peer."""
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


def keep_freed_memory() -> None:
    """With glibc, keep freed memory for reuse: glibc returns freed blocks over 32 MB to the kernel, so each step's
    activations are page-faulted and zeroed afresh (1.3-1.6x slower steps on 2 cores); the peak RSS grows, once."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, Windows, musl): nothing to tune
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from <malloc.h>
    libc.mallopt(M_MMAP_MAX, 0)  # big blocks come from the heap, where freed ones are reused...
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # ...and the heap is never shrunk



"""Where a run runs: processes, devices, precision, and the plumbing around them.

- The one error type for mistakes a user can fix (a bad flag, a missing file): entry points report a UserError as
  one paragraph and a non-zero exit, without a traceback; any other exception is a bug and keeps its traceback.
- Distributed set-up (torchrun's environment, NCCL on GPUs, gloo elsewhere), averaging across ranks.
- The device and the autocast dtype, and `build_model`: model, optimizer, GradScaler, compile and DDP in one place
  for train_gpt2.py and bench.py.
- Small helpers: atomic file writes, device synchronisation, batches to the device, bitwise determinism.
"""

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT

# ----------------------------------------------------------------------------------------------------------------
# errors a user can fix


class UserError(Exception):
    """A problem the user can fix. The message is one paragraph that names the file or flag and the fix."""


def run_entry_point(main: Callable[[], None]) -> None:
    """Call main(); a UserError becomes `error: <message>` on stderr and exit status 2, with no traceback.

    Under torchrun each rank that meets the error prints it; the checks that raise one run on every rank (or agree
    through a collective first), so no rank is left waiting for a peer that has gone.
    """
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# ----------------------------------------------------------------------------------------------------------------
# processes and devices

@dataclass
class Distributed:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def setup_distributed(device_arg: str, parallel: str = "ddp") -> Distributed:
    """One process per device. torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; without them we are the only process
    (with --parallel fsdp, in a process group of one, which FSDP needs)."""
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in
                                    (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    device_type = default_device() if device_arg == "auto" else device_arg
    if device_type == "mps" and world_size > 1:
        # gloo cannot reduce MPS tensors, so DDP and the loss average would fail at the first step.
        raise UserError(f"--device mps with {world_size} processes: a Mac has one GPU, and torch.distributed cannot "
                        "work on MPS tensors. Run one process (`python train_gpt2.py ...`, no torchrun), or "
                        "--device cpu for several CPU processes.")
    device = torch.device(f"cuda:{local_rank}" if device_type == "cuda" else device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1 and parallel == "fsdp":
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, device_id=device if device.type == "cuda" else None)
    elif world_size > 1:
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(minutes=10)))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps one TCPStore for the whole job, where a dead round's addresses are still
            # stored after a restart; a per-restart prefix makes each round meet only its own peers. (With
            # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every round gets a fresh store instead, and needs no prefix.)
            store = dist.PrefixStore(f"restart_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
            nodes, max_restarts = int(os.environ["GROUP_WORLD_SIZE"]), int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
            if rank == 0 and nodes > 1 and max_restarts > 0:
                # A node whose workers are restarted for another node's failure keeps its restart count, so
                # after a failure the nodes' prefixes can differ and their workers never meet.
                print("WARNING: restarts of a multi-node job need a fresh store per restart: export "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node before torchrun (see README, Multi-node).",
                      file=sys.stderr)
        # A timeout, so that ranks whose peer died raise instead of waiting forever in a collective. device_id
        # binds NCCL to this rank's GPU, so its barriers need not guess the device (and warn).
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timedelta(minutes=10),
                                device_id=device if device.type == "cuda" else None)
    return Distributed(rank, local_rank, world_size, device)


def average_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks, for logging (gloo's AVG is right in torch 2.13: tests/test_train.py checks)."""
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is True on any rank (a collective: every rank must call it)."""
    value = torch.tensor(float(flag), device=device)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock time covers it (GPUs run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device.type == "cuda":  # pinned memory lets the copy run asynchronously with the GPU's work
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# ----------------------------------------------------------------------------------------------------------------
# precision

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def has_native_bf16(device: torch.device) -> bool:
    """bf16 tensor cores: compute capability 8.0 (Ampere) and later, or any ROCm GPU that torch runs on.

    torch.cuda.is_bf16_supported() also says yes on V100 and T4, where bf16 is emulated: matmuls skip the tensor
    cores, flash attention is unavailable and torch.compile skips bf16, so fp16 with a GradScaler is far faster.
    """
    return torch.version.hip is not None or torch.cuda.get_device_capability(device) >= (8, 0)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype; 'auto' is the fastest that is safe on the device. torch.float32 means no autocast."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if has_native_bf16(device) else torch.float16
    if device.type == "cpu":
        # CPUs with AVX512-BF16 or AMX run bf16 matmuls 2-3x faster than fp32 (and a bf16 step ~2x faster). Others,
        # even plain AVX-512 ones, which mkldnn's own bf16 check accepts, have no bf16 arithmetic to gain from.
        return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported() \
            else torch.float32
    return torch.float32  # MPS: fp32 is the one dtype every macOS version runs correctly (see README)


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def autocast(device: torch.device | str, dtype: torch.dtype):
    """Mixed precision in dtype on the device; torch.float32 (the one "off" value everywhere) is plain fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def set_deterministic() -> None:
    """Bitwise-repeatable GPU runs, at some speed: deterministic kernels (embedding backward without atomic adds,
    ...) and a fixed cuBLAS workspace. Ops with no deterministic version warn instead of failing the run."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts, so before any GPU work
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


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


# ----------------------------------------------------------------------------------------------------------------
# the model as a run trains it

@dataclass
class TrainingModel:
    raw: torch.nn.Module  # the GPT itself (with fsdp: its parameters are shards): state_dict, validation
    model: torch.nn.Module  # what the training step calls: compiled and/or DDP-wrapped
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    parallel: str = "ddp"  # or "fsdp"

    @property
    def sharded(self) -> bool:
        return self.parallel == "fsdp"

    def full_model(self) -> torch.nn.Module:
        """A GPT with all of its weights, for HellaSwag and sampling, which run different work on each rank. With
        fsdp a collective: every rank calls it and gets its own unsharded copy."""
        if not self.sharded:
            return self.raw
        full = get_model_state_dict(self.raw, options=StateDictOptions(full_state_dict=True))
        copy = GPT(self.raw.config).to(next(iter(full.values())).device)
        copy.load_state_dict(full)
        return copy


def build_model(raw_model: torch.nn.Module, dist_env: Distributed, dtype: torch.dtype, weight_decay: float,
                learning_rate: float, compile: bool, plain: bool = False, parallel: str = "ddp") -> TrainingModel:
    """Move the model to the device, shard it (fsdp), make its optimizer and GradScaler, then compile it and wrap
    it in DDP (ddp, several ranks).

    plain: bench.py's baseline, with the for-loop AdamW instead of the fused one.
    """
    device = dist_env.device
    if compile and device.type == "mps":
        raise UserError("--compile is not supported on MPS (torch.compile's MPS backend is experimental and fails "
                        "on this model); leave --compile out.")
    if parallel == "fsdp" and dtype == torch.float16:
        raise UserError("--parallel fsdp with fp16 is not supported (its loss scaling would need a sharded "
                        "GradScaler): use --dtype bf16 on GPUs that have it, --dtype fp32, or --parallel ddp.")
    raw_model = raw_model.to(device)
    if parallel == "fsdp":
        shard(raw_model, dtype)
    optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, device.type, fused=not plain)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    model = torch.compile(raw_model) if compile else raw_model
    if dist_env.world_size > 1 and parallel == "ddp":
        model = DDP(model, device_ids=[dist_env.local_rank] if device.type == "cuda" else None)
    return TrainingModel(raw_model, model, optimizer, scaler, parallel)


def shard(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """FSDP2, in place: each Block's parameters are one shard group (gathered just before the block runs, freed
    after), the rest (embeddings, tied with the output layer, and the last LayerNorm) the root's. Under bf16 the
    gathered weights are bf16 for compute and gradients are reduced in fp32."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if dtype == torch.bfloat16 else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """Whether this backward pass reduces gradients across ranks: only the last micro-step's does, the earlier
    ones add into the local gradients (DDP: the all-reduce; FSDP: the reduce-scatter)."""
    inner = getattr(model, "_orig_mod", model)  # under torch.compile
    if isinstance(model, DDP):
        # Setting the flag rather than `with model.no_sync()` keeps one code path.
        model.require_backward_grad_sync = sync
    elif isinstance(inner, FSDPModule):
        inner.set_requires_gradient_sync(sync)


# ----------------------------------------------------------------------------------------------------------------
# files

def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable: without this a power cut can undo it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable) -> None:
    """Write a file so that a crash leaves either the old file (or none) or the complete new one at `path`.

    write(f) fills a temp file beside it (opened "wb"); then fsync, rename over `path`, fsync of the directory. On
    any failure (disk full, Ctrl-C) the temp file is removed, so no half-written gigabytes stay behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: concurrent writers never collide
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)

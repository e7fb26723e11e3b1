"""Processes and devices: torchrun's environment, the process group (NCCL on GPUs, gloo elsewhere), the collectives
every rank takes part in, and moving work to the device."""

import gc
import linecache
import os
import re
import sys
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from training.errors import UserError

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # to find our own frames in a traceback


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


TORCHRUN_RANKS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")  # what torchrun tells each worker of its place


def this_process(device_arg: str) -> Distributed:
    """This process's ranks (torchrun_ranks) and device (checked_device), checked before anything starts."""
    rank, local_rank, world_size = torchrun_ranks()
    device = checked_device(device_arg, local_rank)
    if device.type == "mps" and world_size > 1:
        raise UserError(f"--device mps with {world_size} processes: torch.distributed cannot work on MPS tensors. "
                        "Run one process (`python train_gpt2.py ...`, no torchrun), or --device cpu for several.")
    return Distributed(rank, local_rank, world_size, device)


def torchrun_ranks() -> tuple[int, int, int]:
    """(rank, local rank, world size) as torchrun set them; (0, 0, 1) where none is set. Set otherwise (by hand, left
    over in a job script) they would make this process wait for peers that never come: a UserError says which."""
    given = {name: os.environ[name] for name in TORCHRUN_RANKS if name in os.environ}
    if not given:
        return 0, 0, 1
    shown = " ".join(f"{name}={value!r}" for name, value in given.items())
    fix = ("Launch with torchrun, which sets all three (e.g. `torchrun --standalone --nproc_per_node=2 train_gpt2.py "
           "...`), or unset them (`unset RANK LOCAL_RANK WORLD_SIZE`) to run one process.")
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # what torchrun sets beside them, for every worker
        raise UserError(f"{shown} set, but not by torchrun (TORCHELASTIC_RUN_ID is not set): this process would "
                        f"wait for peers that no launcher started. {fix}")
    if len(given) < len(TORCHRUN_RANKS) or not all(re.fullmatch("[0-9]{1,9}", value) for value in given.values()):
        raise UserError(f"torchrun's ranks are not three whole numbers: {shown}. {fix}")
    rank, local_rank, world_size = (int(given[name]) for name in TORCHRUN_RANKS)
    if not rank < world_size or not local_rank < world_size:
        raise UserError(f"{shown}: a rank must be below WORLD_SIZE (ranks count from 0). {fix}")
    return rank, local_rank, world_size


def checked_device(device_arg: str, local_rank: int = 0) -> torch.device:
    """The device --device names (auto: the best this machine has; cuda: this rank's GPU, cuda:LOCAL_RANK), where
    torch knows it and this machine has it; else a UserError naming it and the fix."""
    name = default_device() if device_arg == "auto" else device_arg
    fix = "Pass --device cpu, or leave --device out for the best device this machine has."
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise UserError(f"--device {name}: not a device torch knows; pass cuda, mps or cpu (or cuda:N).") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {name}: this machine has no GPU that PyTorch can use (torch.cuda.is_available() "
                            f"is False: no NVIDIA GPU or driver, or a PyTorch built for CPUs only). {fix}")
        index, count = local_rank if device.index is None else device.index, torch.cuda.device_count()
        if index >= count:
            whose = f" (LOCAL_RANK {local_rank}: a GPU a process)" if device.index is None else ""
            raise UserError(f"--device {name}: this process needs GPU cuda:{index}{whose}, but this machine has "
                            f"{count}. Start one process a GPU, {count} a node at most (torchrun "
                            f"--nproc_per_node={count}), or name one of its GPUs, cuda:0 to cuda:{count - 1}.")
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name}: this machine has no Apple GPU that PyTorch can use "
                        f"(torch.backends.mps.is_available() is False: not a Mac with Apple silicon). {fix}")
    if device.type not in ("cpu", "mps"):
        raise UserError(f"--device {name}: this code trains and samples on cuda, mps or cpu only; pass one of them.")
    return device


def setup_distributed(device_arg: str, parallel: str = "ddp", timeout_s: float = 600) -> Distributed:
    """One process per device (this_process, checked); without torchrun the only process, in a process group of one
    with --parallel fsdp, which FSDP needs. timeout_s: how long a collective waits for a peer (--dist_timeout)."""
    dist_env = this_process(device_arg)
    device = dist_env.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist_env.world_size > 1:
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(minutes=10)))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps one TCPStore for the whole job, where a dead round's addresses stay after a
            # restart: a per-restart prefix makes each round meet only its own peers (docs/multi_node.md).
            store = dist.PrefixStore(f"restart_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
            nodes, max_restarts = int(os.environ["GROUP_WORLD_SIZE"]), int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
            if dist_env.rank == 0 and nodes > 1 and max_restarts > 0:
                # A node restarted for another node's failure keeps its restart count: the prefixes can differ.
                print("WARNING: restarts of a multi-node job need a fresh store per restart: export "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node before torchrun (see README, Multi-node).",
                      file=sys.stderr)
    elif parallel == "fsdp":
        store = dist.HashStore()
    else:
        return dist_env
    # A timeout, so that ranks whose peer died or hangs raise instead of waiting forever (gloo raises; NCCL's
    # watchdog aborts the process); device_id binds NCCL to this rank's GPU, so its barriers need not guess it.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=dist_env.rank,
                            world_size=dist_env.world_size, timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    return dist_env


def teardown_distributed() -> None:
    """Destroy the process group (if any) once the model is gone: with FSDP, device meshes in DTensor's caches (and
    the FSDP state, until collected) keep gloo's threads alive, which at exit abort about 1 finished run in 100."""
    if not dist.is_initialized():
        return
    gc.collect()  # the model's FSDP state, in reference cycles, holds the group
    dist.destroy_process_group()
    for mesh in [obj for obj in gc.get_objects() if isinstance(obj, DeviceMesh)]:
        getattr(mesh, "_pg_registry", {}).clear()  # private: where torch 2.13's meshes keep their groups


@contextmanager
def hangs_reported(timeout_s: float, rank: int):
    """A collective's timeout in the block (a peer stopped) as a UserError naming the step and our line that waited,
    so that the rank exits and torchrun --max-restarts restarts the job. Other errors pass through."""
    try:
        yield
    except RuntimeError as e:
        if "timed out" not in str(e).lower():  # gloo: "Timed out waiting 10000ms for recv operation to complete"
            raise
        # From the traceback, so that no phase of the run needs wrapping: the innermost line of ours is the
        # collective (or the backward, for DDP's all-reduce), and the nearest `step` variable the training step.
        frames = [(frame, line) for frame, line in traceback.walk_tb(e.__traceback__)
                  if frame.f_code.co_filename.startswith(PROJECT_DIR + os.sep)
                  and "site-packages" not in frame.f_code.co_filename]
        steps = [frame.f_locals["step"] for frame, _ in frames if isinstance(frame.f_locals.get("step"), int)]
        where = ""
        if frames:
            frame, line = frames[-1]
            code = linecache.getline(frame.f_code.co_filename, line).strip()
            where = f" in {frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{line}: `{code}`)"
        raise UserError(
            f"rank {rank} waited {timeout_s:g} s{f' at step {steps[-1]}' if steps else ''} for the other ranks in a "
            f"collective{where} and gave up ({str(e).strip().splitlines()[0]}). Another rank stopped making progress "
            "(a stopped process, a stuck filesystem, a dead link); this rank exits so that torchrun --max-restarts "
            "restarts the job from the newest snapshot (without restarts, rerun the command). If a rank needs longer "
            "(a long snapshot write, a slow first torch.compile), raise --dist_timeout.") from e


def average_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks (gloo's AVG is right in torch 2.13: tests/test_train.py checks)."""
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value


def agreed(work: Callable[[], object], dist_env: Distributed) -> object:
    """work() on rank 0, its result, or its UserError raised, on every rank (all stop together, none waits)."""
    result, refusal = None, None
    try:
        result = work() if dist_env.is_master else None
    except UserError as e:
        refusal = str(e)
    result, refusal = from_all_ranks((result, refusal))[0]
    if refusal is not None:
        raise UserError(refusal)
    return result


def from_all_ranks(value) -> list:
    """Every rank's value (any picklable object), by rank, on every rank (a collective: every rank must call it)."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def max_across_ranks(value: int, device: torch.device) -> int:
    """The largest of the ranks' values, on every rank (a collective: every rank must call it)."""
    tensor = torch.tensor(float(value), device=device)  # (exact for any int below 2**24)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is True on any rank (a collective: every rank must call it)."""
    return bool(max_across_ranks(int(flag), device))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock time covers it (GPUs run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def is_loaded_instance(obj: object, module: str, name: str) -> bool:
    """isinstance(obj, module.name) without importing module (fsdp's and DTensor's take a second of a start-up): where
    nothing has imported it, nothing can be an instance."""
    return module in sys.modules and isinstance(obj, getattr(sys.modules[module], name))


def is_dtensor(t: object) -> bool:
    return is_loaded_instance(t, "torch.distributed.tensor", "DTensor")


def to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device.type == "cuda":  # pinned memory lets the copy run asynchronously with the GPU's work
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)

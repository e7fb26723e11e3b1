"""Snapshots: everything a run needs to continue after a crash, written atomically, found again, restored.

The interface for the training run is `Snapshots`: `resume()` at the start and `save_if_due(step, stopping)` after
every step, and `rollback()` then `commit_rollback()` after a divergence. What a snapshot holds is decided here, in
`_capture` and `_restore`, and nowhere else: the model, optimizer and GradScaler, the data position, the RNGs, and
the run's other stateful objects (the divergence guard), each by its state_dict/load_state_dict.

Two kinds: with --parallel ddp, one file snapshot_<step>.pt that rank 0 writes; with --parallel fsdp, a directory
snapshot_<step>/ in which every rank writes its shards of the model and optimizer (torch.distributed.checkpoint,
which reshards them on loading, so a resume may use another number of ranks) and rank 0 the rest, meta.pt.

A snapshot is valid only once its final name exists: it is written under a temp name, fsynced and renamed, so a
crash mid-write leaves the previous snapshots as they were. A write that fails (a full disk, an I/O error) is
removed and reported, and training goes on: only the last snapshot of a run must be written. Bytes that change
after the write (a bit flip, a bad copy) are found by checksums: the CRC-32 that torch.save's zip container keeps
for every record, and a CRC-32 per shard file of a directory snapshot in its meta.pt.

Nothing read from a snapshot runs code. Torch files (a snapshot_*.pt, a directory's meta.pt) load with
torch.load(weights_only=True), so they hold only tensors, numbers, strings, lists and dicts; and mmap=True, so that
8 ranks resuming on one node share the file's pages instead of each reading the whole model and optimizer state
into its own memory. In a directory, torch.distributed.checkpoint would unpickle the .metadata file and the shards'
non-tensor values (the optimizer's hyperparameters) with plain pickle: load_shards reads the first with an
unpickler that knows only the classes such a file holds, and the second with weights_only=True.

A snapshot is never written from NaN or inf weights or optimizer state, and one written while the run was skipping
updates (divergence.DivergenceGuard) is marked unhealthy: it is no place to roll back to. Pruning keeps the newest
healthy snapshot whatever --keep_last says (and any newer one whose health a read error hides), so a run that goes
bad cannot prune away its last good state. A rollback is written at once, over the snapshot it restored.

Pruning deletes only what this code provably wrote (written_here): its names, with the contents it writes under
them. Anything else in --snapshot_dir is left alone, and --resume auto says which entries it ignored.
"""

import os
import pickle
import pickletools
import random
import re
import shutil
import struct
import sys
import uuid
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils.serialization.config
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from dataloader import DistributedDataLoader
from distributed import Distributed, any_rank, from_rank_0
from errors import UserError
from files import atomic_write, fsync_directory
from model import GPT, GPTConfig
from parallel import TrainingModel

STEP = r"(\d{7}|[1-9]\d{7,})"  # f"{step:07d}", exactly
SNAPSHOT_NAME = re.compile(rf"snapshot_{STEP}(\.pt)?")  # a file (ddp) or a directory (fsdp)
# ...and while they are written: files.atomic_write's temp file, save_sharded_snapshot's temp directory
TEMP_NAME = re.compile(rf"snapshot_{STEP}(\.pt\.\d+)?\.tmp")
SHARD_FILE_NAME = re.compile(r"__\d+_\d+\.distcp|\.metadata|meta\.pt(\.\d+\.tmp)?")  # in a directory snapshot
REQUIRED_KEYS = ("model", "model_config", "optimizer", "scaler", "step", "loader", "rng", "config", "wandb_id")
SHARDED_KEYS = ("model", "optimizer")  # in a directory snapshot: in the shards, not in meta.pt
META_KEYS = tuple(k for k in REQUIRED_KEYS if k not in SHARDED_KEYS)


# ----------------------------------------------------------------------------------------------------------------
# the run's interface

class Snapshots:
    """The snapshots of one run in snapshot_dir: which one to resume from, and writing new ones on the beat.

    stateful: the rest of the run's state, {name: object with state_dict() and load_state_dict()} (as torchtitan's
    checkpointer takes Stateful objects), saved under its name; each must be the same on every rank (the divergence
    guard is: every rank decides on the same numbers)."""

    def __init__(self, snapshot_dir: str, every: int, keep_last: int, resume_from: str, trainee: TrainingModel,
                 train_loader: DistributedDataLoader, run_config: dict, dist_env: Distributed,
                 print0: Callable[[str], None], stateful: dict | None = None):
        if every and keep_last < 1:
            raise UserError(f"--keep_last {keep_last} would delete every snapshot, so nothing could resume. Keep at "
                            "least 1, or turn snapshots off with --snapshot_every 0.")
        self.snapshot_dir, self.every, self.keep_last, self.resume_from = snapshot_dir, every, keep_last, resume_from
        self.trainee, self.train_loader, self.run_config = trainee, train_loader, run_config
        self.dist_env, self.print0 = dist_env, print0
        self.stateful = stateful or {}
        self.wandb_id = uuid.uuid4().hex[:12]
        self.last_saved = -1
        self.resumed_config: dict | None = None  # the flags of the run that wrote the snapshot resumed from

    def resume(self) -> tuple[int, str | None]:
        """Restore the newest snapshot (or the one --resume names). Returns the step to start at and the path
        resumed from (None for a fresh start). Every rank calls it and reads the same file."""
        found = self._choose()
        if found is None:
            return 0, None
        path, state = found
        try:
            self._restore(path, state)
        except ValueError as e:  # the shards: a value that is not plain data
            raise UserError(f"--resume: {e} Pass another snapshot, or --resume never to start over.") from e
        self.wandb_id, self.last_saved, self.resumed_config = state["wandb_id"], state["step"], state["config"]
        return state["step"] + 1, path

    def save_if_due(self, step: int, last_step: int, stopping: bool, healthy: bool = True) -> Path | None:
        """Snapshot the state after `step` every --snapshot_every steps, at the last step and when stopping; healthy:
        whether the run's last update was applied (a snapshot written while updates are skipped is no place to roll
        back to). Collective: every rank calls it; rank 0 writes. Returns the path written, if any."""
        due = (step + 1) % self.every == 0 or step == last_step or stopping if self.every else False
        if not due or step <= self.last_saved:  # nothing trained since the last one (a stop during evaluation)
            return None
        if not self._finite():
            self.print0(f"WARNING: no snapshot after step {step}: the weights or optimizer state hold NaN or inf. The "
                        f"snapshots in {self.snapshot_dir} are kept as they are.")
            return None
        state = self._capture(step, healthy)
        path = snapshot_path(self.snapshot_dir, step, self.trainee.sharded)
        failure = None
        try:
            if self.trainee.sharded:
                save_sharded_snapshot(state, self.trainee, path, self.dist_env.device)
            elif state is not None:
                save_snapshot(state, path)
        except (OSError, CheckpointException) as e:  # the temp file or directory is gone, older snapshots untouched
            failure = e
        # With ddp only rank 0 writes: every rank learns how it went, so that all stay in step, and all stop together
        # if it was the last snapshot.
        if any_rank(failure is not None, self.dist_env.device):
            self._write_failed(step, path, failure, final=step == last_step or stopping)
            return None
        if self.dist_env.is_master:
            prune_snapshots(self.snapshot_dir, self.keep_last)
            self.print0(f"snapshot written: {path}")
        self.last_saved = step
        return path

    def _write_failed(self, step: int, path: Path, failure: BaseException | None, final: bool) -> None:
        """One warning (rank 0) for a snapshot that could not be written, and training goes on; but a run must not
        end without its last snapshot, so then every rank raises."""
        usage = shutil.disk_usage(self.snapshot_dir)
        reason = (f"{type(failure).__name__}: {str(failure).strip().splitlines()[0]}" if failure is not None
                  else "the write failed on another rank")
        older = list_snapshots(self.snapshot_dir)
        newest = f"the older snapshots are intact, the newest is {older[0]}" if older else "there is no older snapshot"
        what = (f"the snapshot of step {step} could not be written to {path.parent} ({reason}; "
                f"{usage.free / 2**20:,.0f} MiB free of {usage.total / 2**20:,.0f} MiB)")
        if final:
            raise UserError(f"{what}, and it was the run's last; {newest}. Free space (or point --snapshot_dir at a "
                            "disk with room) and rerun the same command to resume from there.")
        if self.dist_env.is_master:
            print(f"WARNING: {what}; {newest}. Training goes on, and the next due snapshot tries again.",
                  file=sys.stderr)

    def rollback(self) -> tuple[int, str] | None:
        """Restore the newest healthy snapshot, all but the data loader's position: training goes on from its step
        with the data after the divergence, never the batches in between again. Returns its step and path, or None
        if there is no healthy snapshot. Collective: every rank restores the same one. The caller counts the
        rollback, then commit_rollback writes it."""
        path = self.newest_healthy()
        if path is None:
            return None
        state = load_snapshot(path, verify=False)  # rank 0 has verified it
        self._restore(path, state, data_position=False)
        return state["step"], path

    def commit_rollback(self, step: int, path: str) -> None:
        """After rollback(): write the state as it is now over the snapshot restored (_record_rollback), and delete
        the newer snapshots of the abandoned timeline. Collective."""
        self._record_rollback(Path(path), step)
        if self.dist_env.is_master:
            # The newer ones are the abandoned timeline's, all unhealthy: after a crash, --resume auto would pick
            # one of them over this timeline's snapshots, and re-read the data the rollback skipped.
            newest_first = list_snapshots(self.snapshot_dir)
            for abandoned in newest_first[:newest_first.index(Path(path))]:
                if written_here(abandoned):
                    remove(abandoned)
                    self.print0(f"removed {abandoned}: written while updates were being skipped, after {path}")
        self.last_saved = step

    def _record_rollback(self, path: Path, step: int) -> None:
        """Write the state just restored, with the data position after the divergence and the rollback counted,
        over the snapshot it came from: a crash before the next snapshot then resumes after the rollback, not
        before it (re-reading the bad batches, with --max_rollbacks reset). Atomic: the old snapshot stays until
        the new one is complete. Of a directory snapshot only meta.pt changes, as its shards hold the very weights
        and optimizer state just restored. Collective (the RNG states); rank 0 writes, and a failed write is a
        warning, as for any snapshot."""
        state = self._capture(step, healthy=True)
        if not self.dist_env.is_master:
            return
        try:
            if path.is_dir():
                state["shard_crc32"] = load_snapshot(path, verify=False).get("shard_crc32", {})  # (older: none)
                atomic_write(path / "meta.pt", lambda f: torch_save(state, f))
            else:
                save_snapshot(state, path)
        except OSError as e:
            print(f"WARNING: the rollback could not be written to {path} ({type(e).__name__}: {e}); a crash before "
                  "the next snapshot would resume from before the rollback.", file=sys.stderr)

    def newest_healthy(self) -> str | None:
        """The newest healthy snapshot in snapshot_dir (rank 0 looks, every rank gets its answer)."""
        found = newest_healthy_snapshot(self.snapshot_dir) if self.dist_env.is_master else None
        return from_rank_0(str(found) if found else None)

    def _finite(self) -> bool:
        """Whether every weight and optimizer state tensor is finite, on every rank (a collective: with fsdp each
        rank checks its own shards). A tensor's sum is NaN or inf if any of its values is (or if they are around
        1e30 and more, which is no healthy state either): one read of each tensor, 20x faster than isfinite()
        on a CPU, and less than an AdamW step (README)."""
        optimizer_state = (v for optimizer in self.trainee.optimizer for s in optimizer.state.values()
                           for v in s.values() if torch.is_tensor(v))
        tensors = [t.to_local() if isinstance(t, DTensor) else t for t in (*self.trainee.raw.parameters(),
                                                                            *optimizer_state)]
        finite = bool(torch.stack([t.sum() for t in tensors]).isfinite().all()) if tensors else True
        return not any_rank(not finite, self.dist_env.device)

    # --- what a snapshot holds

    def _capture(self, step: int, healthy: bool) -> dict | None:
        """Everything needed to continue exactly after `step` (with fsdp: but the sharded model and optimizer).
        Collective: every rank calls it; rank 0 gets it."""
        device = self.dist_env.device
        mine = (capture_rng_state(device), self.train_loader.state_dict())
        per_rank = [mine]
        if dist.is_initialized():
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, mine)
        rng_states, loader_states = zip(*per_rank)
        # The loader's position is the same on every rank by design (see dataloader.py), so one copy resumes any
        # number of ranks; check that rather than trust it, on every rank so that all of them stop together.
        if any(s != loader_states[0] for s in loader_states):
            raise RuntimeError(f"data loader positions differ across ranks at step {step}: {loader_states}")
        if not self.dist_env.is_master:
            return None
        t = self.trainee
        state = {"model_config": asdict(t.raw.config), "scaler": t.scaler.state_dict(), "step": step,
                 "loader": loader_states[0], "rng": list(rng_states), "config": self.run_config,
                 "wandb_id": self.wandb_id, "healthy": healthy}
        state |= {name: each.state_dict() for name, each in self.stateful.items()}
        if not t.sharded:
            state |= {"model": t.raw.state_dict(), "optimizer": t.optimizer.state_dict()}
        return state

    def _restore(self, path: str, state: dict, data_position: bool = True) -> None:
        """Restore everything `state` holds (the data loader's position only if data_position)."""
        t, dist_env = self.trainee, self.dist_env
        # (snapshots from before --arch lack it: gpt2; before --attention_bias, it: no biases)
        if (written := GPTConfig(**state["model_config"])) != t.raw.config:
            raise UserError(f"{path} holds a model {asdict(written)}, but this run builds {asdict(t.raw.config)}. Pass "
                            "the --arch/--model/--n_layer/--n_head/--n_embd/--block_size/--[no-]attention_bias of the "
                            "run that wrote it, or --resume never to start over.")
        written_with = state["config"].get("optimizer", "adamw")
        if written_with != self.run_config["optimizer"]:
            raise UserError(f"{path} was written by an --optimizer {written_with} run, and this run is --optimizer "
                            f"{self.run_config['optimizer']}: their optimizer states do not convert. Resume it with "
                            f"--optimizer {written_with}, or start a new run from its weights with --init_from {path} "
                            "(a fresh optimizer, schedule and data order).")
        sharded_snapshot = Path(path).is_dir()
        if sharded_snapshot != t.sharded:
            kind = "fsdp" if sharded_snapshot else "ddp"
            raise UserError(f"{path} was written by a --parallel {kind} run, and this run is --parallel "
                            f"{t.parallel}: their optimizer states are laid out differently. Resume it with --parallel "
                            f"{kind} (on any number of ranks), or start a new run from its weights with --init_from "
                            f"{path}.")
        if t.sharded:  # each rank reads its own shards, resharded if the number of ranks changed
            model_state, optimizer_state = get_state_dict(t.raw, list(t.optimizer))
            loaded = {"model": model_state, "optimizer": optimizer_state}
            load_shards(loaded, Path(path))
            set_state_dict(t.raw, list(t.optimizer), model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optimizer"])
        else:
            t.raw.load_state_dict(state["model"])
            t.optimizer.load_state_dict(state["optimizer"])
        if t.scaler.is_enabled() and not state["scaler"]:
            # A bf16 or fp32 run continued in fp16 (an A100 run moved to a V100): there is no loss scale to carry.
            self.print0(f"{path} was written without fp16, so it has no GradScaler state: the fp16 loss scale starts "
                        "fresh.")
        else:  # (a disabled scaler ignores the state of an fp16 snapshot continued in bf16 or fp32)
            t.scaler.load_state_dict(state["scaler"])
        if data_position:
            self.train_loader.load_state_dict(state["loader"])
        for name, each in self.stateful.items():
            if name in state:  # (snapshots from before the guard have none: its statistics start afresh)
                each.load_state_dict(state[name])
        if len(state["rng"]) == dist_env.world_size:
            restore_rng_state(state["rng"][dist_env.rank], dist_env.device)
        else:  # a different number of ranks: the data position carries over exactly (see dataloader.py)
            torch.manual_seed(self.run_config["seed"] + state["step"] + dist_env.rank)

    # --- which one

    def _choose(self) -> tuple[str, dict] | None:
        """Which snapshot to resume from, or None for a fresh start. Every rank reads the same one."""
        if self.resume_from == "never":
            if self.dist_env.is_master and list_snapshots(self.snapshot_dir):
                print(f"WARNING: --resume never, but {self.snapshot_dir} already holds snapshots; a later --resume "
                      "auto would pick the highest step among them, perhaps the older run's. Use a fresh "
                      "--snapshot_dir.", file=sys.stderr)
            return None
        if self.resume_from != "auto":
            # Every rank checks, so that none is left waiting in a collective for a rank 0 that has exited.
            if not Path(self.resume_from).exists():
                raise UserError(f"--resume {self.resume_from}: no such file. Pass the path of a snapshot_* file, "
                                "'auto' (the newest valid snapshot in --snapshot_dir) or 'never' (start fresh).")
            try:
                return self.resume_from, load_snapshot(self.resume_from)
            except ValueError as e:
                raise UserError(f"--resume: {e} Pass another snapshot, 'auto' or 'never'.") from e
        # Rank 0 picks the newest snapshot that loads, warning once about broken ones and foreign entries; the others
        # read the same file, or raise the same error.
        found, failure = None, None
        if self.dist_env.is_master:
            warn_of_ignored_entries(self.snapshot_dir)
            try:
                found = find_latest_snapshot(self.snapshot_dir)
            except ValueError as e:
                failure = (f"--resume auto: {e} Repair or move them away (a copy of a good snapshot elsewhere: "
                           "--resume PATH), or start over with --resume never in a fresh --snapshot_dir.")
        path, failure = from_rank_0((str(found[0]) if found else None, failure))
        if failure is not None:
            raise UserError(failure)
        if path is None:
            return None
        return path, found[1] if found else load_snapshot(path, verify=False)  # rank 0 has verified it


# ----------------------------------------------------------------------------------------------------------------
# files

def snapshot_path(snapshot_dir: str | Path, step: int, sharded: bool = False) -> Path:
    return Path(snapshot_dir) / (f"snapshot_{step:07d}" if sharded else f"snapshot_{step:07d}.pt")


def save_snapshot(state: dict, path: Path) -> None:
    check_replaceable(path)
    atomic_write(path, lambda f: torch_save(state, f))


def torch_save(obj, f) -> None:
    """torch.save with the CRC-32 of every record in the zip (torch's default, made sure of: load_snapshot checks
    them); a failed write raises the OSError behind it (ENOSPC, EIO), not torch's "unexpected pos" RuntimeError."""
    try:
        with torch.utils.serialization.config.patch({"save.compute_crc32": True}):
            torch.save(obj, f)
    except RuntimeError as e:
        if isinstance(e.__context__, OSError):
            raise e.__context__ from e
        raise


def save_sharded_snapshot(meta: dict | None, trainee: TrainingModel, path: Path, device: torch.device) -> None:
    """Every rank writes its shards of the model and optimizer into a temp directory, rank 0 adds meta (the rest of
    the snapshot, and the shard files' CRC-32s) and renames the directory into place once all are written.
    Collective; a failed write on any rank raises on every rank, with the temp directory removed."""
    tmp = path.with_name(path.name + ".tmp")
    failure = None
    if meta is not None:
        try:
            check_replaceable(path)
            check_replaceable(tmp)
            shutil.rmtree(tmp, ignore_errors=True)  # a dead run's
        except OSError as e:
            failure = e
    if any_rank(failure is not None, device):  # (and no rank writes into tmp before rank 0 has cleared it)
        raise failure or OSError(f"{path} could not be written: see rank 0's warning")
    model_state, optimizer_state = get_state_dict(trainee.raw, list(trainee.optimizer))
    try:
        # dcp.save returns once all ranks have written, or raises CheckpointException on all if one failed.
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
        if meta is not None:
            meta = meta | {"shard_crc32": {p.name: file_crc32(p) for p in tmp.iterdir()}}
            atomic_write(tmp / "meta.pt", lambda f: torch_save(meta, f))
            shutil.rmtree(path, ignore_errors=True)  # a snapshot of the same step from before a restart
            os.replace(tmp, path)
            fsync_directory(path.parent)
    except (OSError, CheckpointException) as e:
        failure = e
    # A collective, so that nobody goes on (or exits) before the snapshot is complete, and all learn if it is not.
    if any_rank(failure is not None, device):
        if meta is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise failure or OSError(f"writing {tmp} failed on another rank")


def file_crc32(path: Path) -> int:
    """CRC-32 of a file's bytes (zlib's, ~0.4 s/GB on one core: see README), read in 16 MiB pieces."""
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(16 * 2**20):
            crc = zlib.crc32(piece, crc)
    return crc


def verify_checksums(path: Path, state: dict | None = None) -> None:
    """Raise ValueError naming the file if bytes of a snapshot changed since it was written: the CRC-32 of every
    record in a torch file's zip container, and for a directory snapshot every shard file's CRC-32 in meta.pt. A
    read error is raised as the OSError it is: it says nothing about the bytes."""
    if path.is_dir():
        verify_checksums(path / "meta.pt")
        for name, crc in (state or {}).get("shard_crc32", {}).items():  # (older directory snapshots have none)
            if not (path / name).is_file() or file_crc32(path / name) != crc:
                raise ValueError(f"{path / name} is missing or its bytes changed since it was written (CRC-32 "
                                 "mismatch): a bit flip or a bad copy.")
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every record and compares its CRC-32
    except (zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{path} could not be read as a snapshot ({type(e).__name__}: {e}); it is truncated, "
                         "corrupt or not a torch file.") from e
    if bad is not None:
        raise ValueError(f"{path}: the bytes of its record {bad} changed since it was written (CRC-32 mismatch): a "
                         "bit flip or a bad copy.")


def load_snapshot(path: str | Path, verify: bool = True) -> dict:
    """Load and check a snapshot (of a directory snapshot: meta.pt, with its .metadata checked to hold nothing that
    could run code; the shards are read when restoring). Raises ValueError naming the file if it is truncated, not
    ours, unsafe, or (verify) its bytes changed since it was written; an OSError if it could not be read."""
    path = Path(path)
    sharded = path.is_dir()
    if sharded:
        read_shard_metadata(path)
    state = read_torch_file(path / "meta.pt" if sharded else path)
    missing = [k for k in (META_KEYS if sharded else REQUIRED_KEYS) if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{path} is not a training snapshot of this codebase (missing {missing}).")
    if verify:
        verify_checksums(path, state)
    return state


def list_snapshots(snapshot_dir: str | Path) -> list[Path]:
    """Snapshots in snapshot_dir (entries named as this code names them), newest (highest step) first."""
    snapshot_dir = Path(snapshot_dir)
    if not snapshot_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in snapshot_dir.iterdir() if (m := SNAPSHOT_NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def warn_of_ignored_entries(snapshot_dir: str | Path) -> None:
    """One warning naming the entries of snapshot_dir that look like snapshots but are not named as this code names
    them (nor ever touched by it), e.g. snapshot_1.pt; temp files of writes cut short are among them."""
    snapshot_dir = Path(snapshot_dir)
    ignored = sorted(p.name for p in snapshot_dir.glob("snapshot_*") if not SNAPSHOT_NAME.fullmatch(p.name))
    if ignored:
        print(f"WARNING: --resume auto ignores in {snapshot_dir}: {', '.join(ignored)} (not named as this code names "
              "snapshots: snapshot_<step, 7 digits>.pt, or snapshot_<step>/ with --parallel fsdp).", file=sys.stderr)


def find_latest_snapshot(snapshot_dir: str | Path) -> tuple[Path, dict] | None:
    """The newest snapshot that loads; broken ones are skipped with a warning naming them. None if there is none;
    ValueError naming them all if there are some and none loads (a fresh start would prune them away)."""
    failures = []
    for path in list_snapshots(snapshot_dir):
        try:
            return path, load_snapshot(path)
        except (ValueError, OSError) as e:
            print(f"WARNING: skipping snapshot: {e} Trying the next older one.", file=sys.stderr)
            failures.append(f"{path} ({type(e).__name__}: {e})" if isinstance(e, OSError) else str(e))
    if failures:
        raise ValueError(f"none of the {len(failures)} snapshots in {snapshot_dir} loads: {' '.join(failures)}")
    return None


def is_healthy(state: dict) -> bool:
    return state.get("healthy", True)  # snapshots from before the guard were not checked: trust them as before


def health_newest_first(snapshot_dir: str | Path) -> Iterator[tuple[Path, bool | None]]:
    """Each snapshot, newest first, and whether it is healthy: True; False if unhealthy or broken (it does not load,
    or its checksums fail); None if a read error leaves that unknown. Only those whose flag says healthy are
    checksummed (a read of the whole file)."""
    for path in list_snapshots(snapshot_dir):
        try:
            state = load_snapshot(path, verify=False)
            healthy = is_healthy(state)
            if healthy:
                verify_checksums(path, state)
        except ValueError:
            healthy = False
        except OSError:
            healthy = None
        yield path, healthy


def newest_healthy_snapshot(snapshot_dir: str | Path) -> Path | None:
    """The newest snapshot that loads and is healthy (see the module doc)."""
    return next((path for path, healthy in health_newest_first(snapshot_dir) if healthy), None)


def prune_snapshots(snapshot_dir: str | Path, keep_last: int) -> None:
    """Delete all but the keep_last newest of this code's snapshots, and the temp files and directories of writes
    that a crash cut short; only what written_here proves this code wrote. Kept whatever keep_last says: the newest
    healthy snapshot, and any newer one whose health a read error hides (it may be the newest healthy one)."""
    old = [path for path in list_snapshots(snapshot_dir) if written_here(path)][keep_last:]
    keep = set()
    for path, healthy in health_newest_first(snapshot_dir) if old else ():  # (nothing to prune: read no snapshot)
        if healthy is not False:
            keep.add(path)
        if healthy:
            break
    for path in old:
        if path not in keep:
            remove(path)
    # One snapshot is saved at a time, so once a save has finished every temp file or directory is a dead run's.
    for tmp in Path(snapshot_dir).iterdir():
        if TEMP_NAME.fullmatch(tmp.name) and written_here(tmp):
            remove(tmp)


def written_here(path: Path) -> bool:
    """Whether this code provably wrote `path`, so that it may delete it: a snapshot, or the temp file or directory
    of a snapshot write, by its name (SNAPSHOT_NAME, TEMP_NAME) and its contents. A file: a torch file whose
    pickle holds a snapshot's keys (snapshot_holds_keys). A directory: nothing but what save_sharded_snapshot
    writes into one (shard files, .metadata, meta.pt and its temp files), with meta.pt holding a snapshot's keys
    where it must be there (in a snapshot, not yet in the temp directory of one)."""
    if path.is_symlink() or not (SNAPSHOT_NAME.fullmatch(path.name) or TEMP_NAME.fullmatch(path.name)):
        return False
    if ".pt" in path.name:
        return path.is_file() and snapshot_holds_keys(path, REQUIRED_KEYS)
    if not path.is_dir():
        return False
    entries = list(path.iterdir())
    if not all(SHARD_FILE_NAME.fullmatch(e.name) and e.is_file() and not e.is_symlink() for e in entries):
        return False
    meta = path / "meta.pt"
    if SNAPSHOT_NAME.fullmatch(path.name) or meta.exists():  # (a temp directory has none until its shards are in)
        return snapshot_holds_keys(meta, META_KEYS)
    return True


def snapshot_holds_keys(path: Path, keys: tuple[str, ...]) -> bool:
    """Whether a torch file, complete or cut short by a crash, is a snapshot's: torch.save writes the object's
    pickle first (the zip record <archive>/data.pkl, stored), and a snapshot's names every one of `keys`. Only the
    pickle's opcodes are read (pickletools): nothing is unpickled."""
    try:
        with open(path, "rb") as f:
            header = f.read(30)  # a zip record's local header
            signature, compression = header[:4], header[8:10]
            name_length, extra_length = struct.unpack_from("<HH", header, 26)
            if signature != b"PK\x03\x04" or compression != b"\0\0" or not f.read(name_length).endswith(b"/data.pkl"):
                return False
            f.seek(extra_length, os.SEEK_CUR)
            strings = {arg for _, arg, _ in pickletools.genops(f) if isinstance(arg, str)}
    except (OSError, ValueError, struct.error):  # unreadable, or cut short: no proof
        return False
    return set(keys) <= strings


def check_replaceable(path: Path) -> None:
    """FileExistsError if something this code did not write is where it is about to write (a snapshot of the same
    step is replaced, a dead run's temp file cleared): that is never overwritten or deleted."""
    if (path.exists() or path.is_symlink()) and not written_here(path):
        raise FileExistsError(f"{path} is in the way of a snapshot and was not written by this code, so it is left "
                              "as it is: move it out of --snapshot_dir")


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------------------
# reading snapshots: nothing in them runs code

def read_torch_file(path: Path):
    """The one way a torch file of a snapshot is read (a snapshot_*.pt, a directory's meta.pt, a file with just a
    model): torch.load(weights_only=True), so it holds only tensors, numbers, strings and containers of them and
    runs no code; on the CPU, memory-mapped. ValueError naming the file if it is missing or torch cannot load it
    (torch raises even OSErrors for a truncated file); a read error of the file's first bytes is raised as the
    OSError it is."""
    try:
        with open(path, "rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"  # torch.save's container (torch's message otherwise: about mmap)
    except FileNotFoundError as e:
        raise ValueError(f"{path} could not be read as a snapshot: it is missing.") from e
    if not is_zip:
        raise ValueError(f"{path} could not be read as a snapshot: it is truncated, corrupt or not a torch file.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch's message can run to a page; its first line says what failed
        raise ValueError(f"{path} could not be read as a snapshot ({type(e).__name__}: {first_line(e)}); it is "
                         "truncated, corrupt or not a torch file.") from e


def first_line(e: BaseException) -> str:
    return str(e).strip().split("\n")[0]


# What the .metadata of a torch.distributed.checkpoint directory holds (walked with pickletools in the snapshots
# of real fsdp runs; the dtypes are allowed by their type, below). Unpickling calls what a pickle names, so any other
# name is refused: it could run code.
METADATA_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}  # (the checkpoint_id dcp.save was given)


class RefusedGlobal(pickle.UnpicklingError):
    """A name outside METADATA_GLOBALS in a .metadata pickle (the message: module.name)."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only the classes of METADATA_GLOBALS and torch's dtypes."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise RefusedGlobal(f"{module}.{name}")


def read_shard_metadata(directory: Path) -> Metadata:
    """The .metadata of a directory snapshot (the index of its shards), read with MetadataUnpickler. ValueError
    naming the file if it is missing or holds anything else; a read error is raised as the OSError it is."""
    path = directory / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except FileNotFoundError as e:
        raise ValueError(f"{directory} could not be read as a snapshot ({path} is missing): a write cut short, or "
                         "not a snapshot directory.") from e
    except RefusedGlobal as e:
        raise ValueError(f"{path} was refused: it names {e}, which a torch.distributed.checkpoint .metadata file "
                         "never holds, and unpickling it could run code. The snapshot directories of train_gpt2.py "
                         "--parallel fsdp hold no such thing: pass one of those.") from e
    except OSError:
        raise
    except Exception as e:  # anything else a damaged pickle raises
        raise ValueError(f"{directory} could not be read as a snapshot ({path}: {type(e).__name__}: "
                         f"{first_line(e)}): it is damaged, or not a snapshot directory.") from e
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} holds a {type(metadata).__name__}, not a torch.distributed.checkpoint Metadata: it "
                         "is not a snapshot directory of train_gpt2.py --parallel fsdp.")
    return metadata


class SnapshotShardReader(FileSystemReader):
    """torch.distributed.checkpoint's reader of a directory, but for its .metadata: read_shard_metadata, where
    torch unpickles it with plain pickle."""

    def read_metadata(self) -> Metadata:
        # (Without torch's rank argument: after a refusal, dcp would look for per-rank files we never write.)
        metadata = read_shard_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()  # as FileSystemReader.read_metadata does
        metadata.storage_meta.load_id = self.load_id
        return metadata


class PlainDataLoadPlanner(DefaultLoadPlanner):
    """torch.distributed.checkpoint's default planner, but for the shards' non-tensor values (the optimizer's
    hyperparameters: floats, bools, tuples): unpickled with weights_only=True first, where torch's planner uses
    weights_only=False. Bytes that load so are plain data, and then load the same way in torch's planner."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = directory

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:  # torch's reason is on a line of its long message (before its advice to trust it)
            reason = next((line.strip().split(". Please")[0] for line in str(e).splitlines()
                           if "WeightsUnpickler error:" in line), first_line(e))
            raise ValueError(f"{self.directory}: the value of {read_item.dest_index.fqn} in its shards was refused "
                             f"({reason}): it is not plain data, and unpickling it could run code. The snapshot "
                             "directories of train_gpt2.py --parallel fsdp hold no such thing: pass one of "
                             "those.") from e
        value.seek(0)
        super().load_bytes(read_item, value)


def load_shards(state: dict, directory: Path, no_dist: bool = False) -> None:
    """Fill `state` (what get_state_dict or a model's state_dict gives) from the shards of a directory snapshot:
    dcp.load, resharded to this run's ranks (no_dist: into one process without a process group), with nothing read
    that could run code. ValueError naming the file or value if anything is refused."""
    try:
        dcp.load(state, storage_reader=SnapshotShardReader(directory), planner=PlainDataLoadPlanner(directory),
                 no_dist=no_dist)
    except CheckpointException as e:  # (a BaseException) wraps what each rank raised
        errors = [error for error, _ in e.failures.values()]
        ours = next((error for error in errors if isinstance(error, ValueError)), None)
        raise ValueError(str(ours) if ours else f"{directory} could not be read as a snapshot "
                         f"({type(errors[0]).__name__}: {first_line(errors[0])}).") from e


def read_model(path: str | Path) -> GPT:
    """A plain GPT from a training snapshot (a snapshot_*.pt file, or the directory of an fsdp run's, whose shards
    torch.distributed.checkpoint puts back together in one process), or from a file with just a snapshot's "model"
    and "model_config": what sample.py, export_hf.py, evaluate.py and --init_from load. Its bytes are checked as a
    resume checks them (verify_checksums): ValueError naming the file if they changed since they were written."""
    path = Path(path)
    state = load_model_snapshot(path)
    verify_checksums(path, state)
    model = GPT(GPTConfig(**state["model_config"]))
    if path.is_dir():
        state = {"model": model.state_dict()}
        load_shards(state, path, no_dist=True)
    model.load_state_dict(state["model"])
    return model


def read_model_config(path: str | Path) -> GPTConfig:
    """The shape of the model read_model would load, without its weights (nor their checksums: read_model checks
    them when it loads them)."""
    return GPTConfig(**load_model_snapshot(path)["model_config"])


def is_snapshot_directory(path: Path) -> bool:
    """Whether `path` is a snapshot in the directory form (an fsdp run's, with its meta.pt)."""
    return path.is_dir() and (path / "meta.pt").is_file()


def load_model_snapshot(path: str | Path) -> dict:
    """What read_model, read_model_config and evaluate.py read: a snapshot's dict (of a directory snapshot, its
    meta.pt: the weights are in the shards, for load_shards), or a file's with just a snapshot's "model" and
    "model_config". FileNotFoundError or ValueError naming the file if it is none of those."""
    path = Path(path)
    if is_snapshot_directory(path):
        return load_snapshot(path, verify=False)
    if not path.is_file():
        raise FileNotFoundError(f"snapshot {path}: no such file. Pass a snapshot_*.pt written by train_gpt2.py.")
    state = read_torch_file(path)
    if not isinstance(state, dict) or "model" not in state or "model_config" not in state:
        raise ValueError(f"{path} is not a snapshot of this codebase (it lacks 'model' and 'model_config'). "
                         "Pass a snapshot_*.pt written by train_gpt2.py.")
    return state


# ----------------------------------------------------------------------------------------------------------------
# random number generators

def capture_rng_state(device: torch.device) -> dict:
    """Every generator a training process draws from: Python's, numpy's, torch's CPU one, and the training
    device's (only that one: asking CUDA on a --device cpu run would open a CUDA context on GPU 0)."""
    # numpy's state is converted to plain lists/tensors so that weights_only loading accepts it.
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device.type == "mps":
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_rng_state(state: dict, device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    elif device.type == "mps" and "mps" in state:
        torch.mps.set_rng_state(state["mps"])

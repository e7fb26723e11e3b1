"""A run's snapshots in --snapshot_dir: which one to resume from, writing new ones on the beat, pruning, rollback.

The interface for the training run is `Snapshots`: `resume()` at the start and `save_if_due(step, stopping)` after
every step, and `rollback()` then `commit_rollback()` after a divergence. What a snapshot holds is decided here, in
`_capture` and `_restore`, and nowhere else: the model, optimizer and GradScaler, the data position, the RNGs, and
the run's other stateful objects (the divergence guard), each by its state_dict/load_state_dict. How a snapshot is
written and read is snapshot.py's; which snapshots are this run's, timeline.py's.

A run acts only on the snapshots of its own timeline: --resume auto continues the current timeline's newest snapshot
that loads (else the snapshot it branched from), never another run's snapshot copied in, nor an older timeline's with
a higher step; pruning and rollbacks delete only this timeline's snapshots; and a run that would write a snapshot
under the name of one that is not its own (another run's, or the later snapshots of the timeline it branched from)
stops before its first step, naming them. The others are named once in the log and left as they are.

A snapshot is never written from NaN or inf weights or optimizer state, and one written while the run was skipping
updates (divergence.DivergenceGuard) is marked unhealthy: it is no place to roll back to. A write that fails (a full
disk, an I/O error) is removed and reported, and training goes on: only the last snapshot of a run must be written.
Pruning keeps the newest healthy snapshot whatever --keep_last says (and any newer one whose health a read error
hides), so a run that goes bad cannot prune away its last good state. A rollback is written at once, over the
snapshot it restored.
"""

import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from dataloader import DistributedDataLoader
from rundir.snapshot import (
    TEMP_NAME,
    capture_rng_state,
    check_tokenizer,
    load_shards,
    load_snapshot,
    model_config_of,
    remove,
    restore_rng_state,
    save_sharded_snapshot,
    save_snapshot,
    snapshot_path,
    tokenizer_of,
    torch_save,
    verify_checksums,
    written_here,
)
from rundir.timeline import (
    Action,
    Asks,
    Survey,
    Timeline,
    adopted_timeline,
    ask,
    decide,
    first_loadable,
    is_own,
    origin_of_weights,
    own_snapshots,
    record_timeline,
    survey,
)
from training.distributed import Distributed, any_rank, from_rank_0
from training.errors import UserError
from training.files import atomic_write
from training.parallel import TrainingModel


class Snapshots:
    """The snapshots of one run in snapshot_dir: which one to resume from, and writing new ones on the beat.

    stateful: the rest of the run's state, {name: object with state_dict() and load_state_dict()} (as torchtitan's
    checkpointer takes Stateful objects), saved under its name; each must be the same on every rank (the divergence
    guard is: every rank decides on the same numbers)."""

    def __init__(self, snapshot_dir: str, every: int, keep_last: int, resume_from: str, trainee: TrainingModel,
                 train_loader: DistributedDataLoader, run_config: dict, dist_env: Distributed,
                 print0: Callable[[str], None], stateful: dict | None = None):
        if keep_last < 1:
            raise UserError(f"--keep_last {keep_last} would delete every snapshot, so nothing could resume. Keep at "
                            "least 1 (--snapshot_every 0 leaves only the last step's and a stop's snapshots).")
        self.snapshot_dir, self.every, self.keep_last, self.resume_from = snapshot_dir, every, keep_last, resume_from
        self.init_from = run_config["init_from"]
        self.trainee, self.train_loader, self.run_config = trainee, train_loader, run_config
        self.dist_env, self.print0 = dist_env, print0
        self.stateful = stateful or {}
        self.timeline = Timeline()
        self.wandb_id = self.timeline.run  # a continued run's: its snapshot's
        self.continued = False  # whether this run continues the directory's timeline from one of its snapshots
        # What the user named on the command line is never deleted (pruning, rollbacks), even if it is this run's own.
        self.named = {Path(p).resolve() for p in (resume_from, self.init_from)
                      if p not in ("auto", "never", "scratch")}
        self.last_saved = -1
        self.surveyed: list = []  # rank 0: the snapshots in snapshot_dir when the run started (timeline.Entry)
        self.resumed_config: dict | None = None  # the flags of the run that wrote the snapshot resumed from

    def resume(self) -> tuple[int, str | None]:
        """Do what TABLE says for this directory and these flags: restore the snapshot to continue or branch from,
        or none. Returns the step to start at and the path resumed from (None for a fresh start). Every rank calls
        it and reads the same file."""
        found = self._choose()
        start = 0
        if found is not None:
            path, state = found
            try:
                self._restore(path, state)
            except ValueError as e:  # the shards: a value that is not plain data
                raise UserError(f"--resume: {e} Pass another snapshot, or --resume never to start over.") from e
            self.last_saved, self.resumed_config = state["step"], state["config"]
            if self.continued:
                self.wandb_id = state["wandb_id"]
            start = state["step"] + 1
        refusal = None
        if self.dist_env.is_master:
            refusal = self._check_the_way(start)
            if refusal is None:  # written now, before step 0: a run killed before its first snapshot is known
                try:
                    record_timeline(self.snapshot_dir, self.timeline)
                except OSError as e:
                    refusal = (f"{Path(self.snapshot_dir) / 'timeline.json'} could not be written ({type(e).__name__}: "
                               f"{e}), so this run stops before its first step. Free space, or point --snapshot_dir at "
                               "a directory that can be written.")
        if (refusal := from_rank_0(refusal)) is not None:  # every rank stops, none waits for rank 0
            raise UserError(refusal)
        return start, found[0] if found else None

    def save_if_due(self, step: int, last_step: int, stopping: bool, healthy: bool = True) -> Path | None:
        """Snapshot the state after `step` every --snapshot_every steps, at the last step and when stopping; healthy:
        whether the run's last update was applied (a snapshot written while updates are skipped is no place to roll
        back to). Collective: every rank calls it; rank 0 writes. Returns the path written, if any."""
        # (--snapshot_every 0: no periodic ones; a run's final weights and a stop's state are always written)
        due = (self.every and (step + 1) % self.every == 0) or step == last_step or stopping
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
                save_sharded_snapshot(state, self.trainee.raw, list(self.trainee.optimizer), path, self.dist_env.device)
            elif state is not None:
                save_snapshot(state, path)
        except (OSError, CheckpointException) as e:  # the temp file or directory is gone, the older ones intact
            failure = e
        # With ddp only rank 0 writes: every rank learns how it went, so that all stay in step, and all stop together
        # if it was the last snapshot.
        if any_rank(failure is not None, self.dist_env.device):
            self._write_failed(step, path, failure, final=step == last_step or stopping)
            return None
        if self.dist_env.is_master:
            prune_snapshots(self.snapshot_dir, self.keep_last, self.timeline, self.named)
            self.print0(f"snapshot written: {path}")
        self.last_saved = step
        return path

    def _write_failed(self, step: int, path: Path, failure: BaseException | None, final: bool) -> None:
        """One warning (rank 0) for a snapshot that could not be written, and training goes on; but a run must not
        end without its last snapshot, so then every rank raises."""
        usage = shutil.disk_usage(self.snapshot_dir)
        reason = (f"{type(failure).__name__}: {str(failure).strip().splitlines()[0]}" if failure is not None
                  else "the write failed on another rank")
        older = [p for p, _ in own_snapshots(self.snapshot_dir, self.timeline)]
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
        """Restore the newest healthy snapshot of this timeline, all but the data loader's position: training goes on
        from its step with the data after the divergence, never the batches in between again. Returns its step and
        path, or None if there is no healthy snapshot. Collective: every rank restores the same one. The caller
        counts the rollback, then commit_rollback writes it."""
        path = self.newest_healthy()
        if path is None:
            return None
        state = load_snapshot(path, verify=False)  # rank 0 has verified it
        self._restore(path, state, data_position=False)
        return state["step"], path

    def commit_rollback(self, step: int, path: str) -> None:
        """After rollback(): write the state as it is now over the snapshot restored (_record_rollback), and delete
        this timeline's newer snapshots, abandoned. Collective."""
        self._record_rollback(Path(path), step)
        if self.dist_env.is_master:
            # The newer ones are the abandoned timeline's, all unhealthy: after a crash, --resume auto would pick
            # one of them over the snapshot restored, and re-read the data the rollback skipped.
            for abandoned, state in own_snapshots(self.snapshot_dir, self.timeline):
                if state["step"] > step and written_here(abandoned) and abandoned.resolve() not in self.named:
                    remove_or_warn(abandoned)
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
        """The newest healthy snapshot of this timeline (rank 0 looks, every rank gets its answer)."""
        found = newest_healthy_snapshot(self.snapshot_dir, self.timeline) if self.dist_env.is_master else None
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
                 "wandb_id": self.wandb_id, "healthy": healthy, "tokenizer": self.train_loader.tokenizer.to_dict(),
                 "timeline": {"run": self.timeline.run, "branched_from": self.timeline.branched_from}}
        state |= {name: each.state_dict() for name, each in self.stateful.items()}
        if not t.sharded:
            state |= {"model": t.raw.state_dict(), "optimizer": t.optimizer.state_dict()}
        return state

    def _restore(self, path: str, state: dict, data_position: bool = True) -> None:
        """Restore everything `state` holds (the data loader's position only if data_position)."""
        t, dist_env = self.trainee, self.dist_env
        # First: another tokenizer's data usually means another vocabulary too, and the model's shape is not the cause
        check_tokenizer(path, tokenizer_of(state, path), self.run_config["data_dir"], self.train_loader.tokenizer,
                        "Resume it on data written with its tokenizer (--data_dir), or start a new run on this data "
                        "with --resume never.")
        if (written := model_config_of(state, path)) != t.raw.config:
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
        if data_position and (not isinstance(state["loader"], dict) or
                              set(state["loader"]) != set(self.train_loader.state_dict())):
            raise UserError(f"{path} holds a data position this code does not read ({state['loader']!r}): it was not "
                            "written by this version of train_gpt2.py. Pass another snapshot, or start a new run from "
                            f"its weights with --init_from {path}.")
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

    # --- which one, and this run's timeline

    def _choose(self) -> tuple[str, dict] | None:
        """What TABLE says for this directory and these flags (timeline.decide), done: this run's timeline
        (self.timeline), and the snapshot to restore, or None for a fresh start. Rank 0 decides; every rank reads
        the same snapshot, or raises the same error."""
        resume, init_from = self.resume_from, self.init_from
        state = None
        if resume not in ("auto", "never"):
            if init_from != "scratch":
                raise UserError(f"--resume {resume} and --init_from {init_from} both name the weights to start from. "
                                "Pass --resume PATH to continue or branch from a snapshot with its optimizer and data "
                                "position, or --init_from to start a new run from weights alone, not both.")
            # Every rank checks, so that none is left waiting in a collective for a rank 0 that has exited.
            if not Path(resume).exists():
                raise UserError(f"--resume {resume}: no such file. Pass the path of a snapshot_* file, "
                                "'auto' (the newest valid snapshot in --snapshot_dir) or 'never' (start fresh).")
            try:
                state = load_snapshot(resume)
            except ValueError as e:
                raise UserError(f"--resume: {e} Pass another snapshot, 'auto' or 'never'.") from e
        decision, failure = None, None
        if self.dist_env.is_master:
            try:
                found = survey(self.snapshot_dir)
                self.surveyed = found.entries  # (for _check_the_way: the directory is read once)
                asks = ask(resume, init_from, found)
                decision = self._act(decide(found.holds, asks), asks, found, state)
            except ValueError as e:  # timeline.json that is not one, or no snapshot to continue loads
                failure = (f"--resume {resume}: {e} Nothing was deleted. Repair or move them away (a copy of a good "
                           "snapshot elsewhere: --resume PATH), or start over with --resume never in a fresh "
                           f"{self._own_directory_flag()}.")
            except UserError as e:  # a refusal of the table
                failure = str(e)
        decision, failure = from_rank_0((decision, failure))
        if failure is not None:
            raise UserError(failure)
        self.timeline, self.continued, path = decision
        self.wandb_id = self.timeline.run
        if path is None:
            return None
        return path, state if state is not None and path == resume else load_snapshot(path, verify=False)

    def _act(self, action: Action, asks: Asks, found: Survey, state: dict | None) -> tuple[Timeline, bool, str | None]:
        """Rank 0: the action's timeline, whether it continues the directory's, and the snapshot to restore (None:
        none). A refusal is a UserError."""
        if action is Action.START:
            return Timeline(init_from=origin_of_weights(self.init_from)), False, None
        if action is Action.BRANCH:
            return Timeline().branch_at(self.resume_from, state), False, self.resume_from
        if action is Action.CONTINUE:
            entry = first_loadable(found.candidates, f"of this run's timeline in {self.snapshot_dir}")
            timeline = found.recorded or adopted_timeline(entry)
            return timeline, True, str(entry.path)
        if action is Action.RESTART:
            return found.recorded, False, found.recorded.resumed_from
        if action is Action.REFUSE_DAMAGED:
            first_loadable(found.candidates, f"in {self.snapshot_dir}")  # raises the ValueError naming every one
        raise UserError(self._refusal(action, asks, found, state))

    def _refusal(self, action: Action, asks: Asks, found: Survey, state: dict | None) -> str:
        """A refusal's words. Only a directory whose timeline.json records a run is refused as taken (TABLE);
        `state` is --resume PATH's snapshot, if that was asked."""
        directory, recorded, own = self.snapshot_dir, found.recorded, self._own_directory_flag()
        if action is Action.REFUSE_ORIGIN:
            return (f"--snapshot_dir {directory} holds a run started with --init_from {recorded.init_from} that was "
                    "stopped before its first snapshot. To start it again, rerun with --init_from "
                    f"{recorded.init_from}; to start another run, give it a directory of its own ({own} NEW_DIR).")
        if action is Action.REFUSE_ORIGIN_GONE:
            return (f"--snapshot_dir {directory} holds a run branched from {recorded.resumed_from}, which is gone or "
                    "no longer loads, and the branch was stopped before its first snapshot: there is nothing to "
                    f"continue it from. Put {recorded.resumed_from} back and rerun the same command, or start "
                    f"another run in a directory of its own ({own} NEW_DIR).")
        newest = found.newest()
        holds = (f"run {recorded.run}'s snapshots (newest: {newest.path.name})" if newest else
                 f"run {recorded.run}, stopped before its first snapshot")
        asked = {Asks.NEVER: "--resume never starts a new run",
                 Asks.OTHER_INIT: f"--init_from {self.init_from} starts a new run from those "
                                  "weights",
                 Asks.OTHER_PATH: f"--resume {self.resume_from} branches a new run from that snapshot"}[asks]
        again = (f"--resume {recorded.resumed_from}" if recorded.resumed_from else
                 f"--resume auto{' --init_from ' + recorded.init_from if recorded.init_from else ''}")
        if asks is Asks.OTHER_PATH:  # a directory named by the branch's first step; its metrics go beside its
            branch = Path(directory) / f"branch_{state['step'] + 1:07d}"  # parent's, in a file of their own
            own = f"--snapshot_dir {branch}"
        else:
            own = f"{own} NEW_DIR"
        return (f"--snapshot_dir {directory} holds {holds}, and {asked}: one directory holds one run, so this one "
                f"stops before it reads or writes anything there. To continue that run, rerun it with {again}; to "
                f"start this one, give it a directory of its own ({own}), or move those files away.")

    def _own_directory_flag(self) -> str:
        return "--snapshot_dir" if self.run_config.get("snapshot_dir") else "--log_dir"

    def _check_the_way(self, start: int) -> str | None:
        """Rank 0, before the first step: the snapshots of snapshot_dir that are not this timeline's are named once;
        if this run could write a snapshot under one's name (a step from `start` to --max_steps), the error that
        stops it."""
        others = [e for e in self.surveyed if not is_own(e, self.timeline)]
        if not others:
            return None
        max_steps = self.run_config["max_steps"]
        in_the_way = sorted(e.path.name + ("" if e.state is not None else " (damaged: which run wrote it is unknown)")
                            for e in others if start <= e.step < max_steps)
        if in_the_way:
            return (f"--snapshot_dir {self.snapshot_dir} holds snapshots this run did not write, at steps it "
                    f"will write ({', '.join(in_the_way[:4])}{', ...' if len(in_the_way) > 4 else ''}): "
                    "another run's, or the later snapshots of the timeline this run branched from. Writing "
                    "over them would destroy them, so this run stops before its first step. Give it a directory of "
                    f"its own (e.g. --snapshot_dir {Path(self.snapshot_dir) / f'branch_{start:07d}'}; the snapshot "
                    "it resumes from can stay where it is), or move them out of the way.")
        self.print0(f"note: {self.snapshot_dir} also holds snapshots this run's timeline did not write: "
                    f"{', '.join(e.path.name for e in others)}. They are left as they are: never resumed by --resume "
                    "auto, never pruned.")
        return None


# ----------------------------------------------------------------------------------------------------------------
# health and pruning

def is_healthy(state: dict) -> bool:
    return state.get("healthy", True)  # snapshots from before the guard were not checked: trust them as before


def health_newest_first(snapshots: list[tuple[Path, dict]]) -> Iterator[tuple[Path, bool | None]]:
    """Each snapshot, in the order given, and whether it is healthy: True; False if unhealthy or its checksums fail;
    None if a read error leaves that unknown. Only those whose flag says healthy are checksummed (a read of the whole
    file)."""
    for path, state in snapshots:
        healthy = is_healthy(state)
        if healthy:
            try:
                verify_checksums(path, state)
            except ValueError:
                healthy = False
            except OSError:
                healthy = None
        yield path, healthy


def newest_healthy_snapshot(snapshot_dir: str | Path, timeline: Timeline) -> Path | None:
    """The newest snapshot of `timeline` that loads and is healthy (see the module doc)."""
    return next((path for path, healthy in health_newest_first(own_snapshots(snapshot_dir, timeline)) if healthy), None)


def prune_snapshots(snapshot_dir: str | Path, keep_last: int, timeline: Timeline, named: set[Path] = frozenset()
                    ) -> None:
    """Delete all but the keep_last newest of `timeline`'s snapshots, and the temp files and directories of writes
    that a crash cut short; only what written_here proves this code wrote, never a file the user named (`named`,
    resolved). Kept whatever keep_last says: the newest healthy snapshot, and any newer one whose health a read error
    hides (it may be the newest healthy one). Pruning is housekeeping: what cannot be deleted is a warning."""
    own = own_snapshots(snapshot_dir, timeline)
    old = [path for path, _ in own if written_here(path) and path.resolve() not in named][keep_last:]
    keep = set()
    for path, healthy in health_newest_first(own) if old else ():  # (nothing to prune: checksum nothing)
        if healthy is not False:
            keep.add(path)
        if healthy:
            break
    # One snapshot is saved at a time, so once a save has finished every temp file or directory is a dead run's.
    temps = [tmp for tmp in Path(snapshot_dir).iterdir() if TEMP_NAME.fullmatch(tmp.name) and written_here(tmp)]
    for path in [p for p in old if p not in keep] + temps:
        remove_or_warn(path)


def remove_or_warn(path: Path) -> None:
    try:
        remove(path)
    except OSError as e:
        print(f"WARNING: could not delete {path} ({type(e).__name__}: {e.strerror or e}); it is left as it is, and "
              "training goes on. Delete it yourself once it can be.", file=sys.stderr)

"""A run's --snapshot_dir: the state table, the snapshot to resume, writing on the beat, pruning, rollback. The rules
and why: docs/reliability.md, "The state table" (which shows TABLE as table_markdown() prints it)."""

import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from dataloader import DistributedDataLoader
from rundir import snapshot
from rundir.lock import RunLock
from rundir.training_state import TrainingState
from training.distributed import Distributed, agreed, any_rank
from training.errors import UserError
from training.files import atomic_write, reason
from training.parallel import TrainingModel

RUN_FILE = "run.json"


class Holds(Enum):
    """The rows: what --snapshot_dir holds."""
    EMPTY = "no run (no run.json)"
    SNAPSHOTS = "a run, with a snapshot that loads"
    DAMAGED = "a run, every snapshot damaged"
    NOT_STARTED = "a run killed before its first snapshot"
    NOT_STARTED_INIT = "the same, started `--init_from X`"
    ORIGIN_LOST = "the same, its origin snapshot gone or damaged"


class Asks(Enum):
    """The columns: what the command line asks, against the directory's run."""
    AUTO = "`--resume auto`"
    ORIGIN = "its origin again"
    NEW = "a new run"


class Action(Enum):
    START = "start"
    CONTINUE = "continue its newest snapshot that loads"
    RESTART = "start it again"
    REFUSE_TAKEN = "refuse: another run's"
    REFUSE_DAMAGED = "refuse, naming the damaged"
    REFUSE_INIT = "refuse, naming `--init_from X`"
    REFUSE_LOST = "refuse, naming the lost snapshot"


TABLE = {  # columns: AUTO, ORIGIN, NEW
    Holds.EMPTY: (Action.START, Action.START, Action.START),
    Holds.SNAPSHOTS: (Action.CONTINUE, Action.CONTINUE, Action.REFUSE_TAKEN),
    Holds.DAMAGED: (Action.REFUSE_DAMAGED, Action.REFUSE_DAMAGED, Action.REFUSE_TAKEN),
    Holds.NOT_STARTED: (Action.RESTART, Action.RESTART, Action.REFUSE_TAKEN),
    Holds.NOT_STARTED_INIT: (Action.REFUSE_INIT, Action.RESTART, Action.REFUSE_TAKEN),
    Holds.ORIGIN_LOST: (Action.REFUSE_LOST, Action.REFUSE_LOST, Action.REFUSE_TAKEN),
}


def decide(holds: Holds, asks: Asks) -> Action:
    """What a run does with its directory: the one place that decides it."""
    return TABLE[holds][list(Asks).index(asks)]


def table_markdown() -> str:
    lines = ["| `--snapshot_dir` holds | " + " | ".join(asks.value for asks in Asks) + " |", "|---" * 4 + "|"]
    return "\n".join(lines + [f"| {holds.value} | " + " | ".join(a.value for a in row) + " |"
                              for holds, row in TABLE.items()])


# ----------------------------------------------------------------------------------------------------------------
# the directory's records: run.json names the run, snapshot_<step>.json the run that wrote that snapshot

@dataclass
class Run:
    """run.json: the run's id and origin (paths relative to the directory; a Hugging Face name as it is)."""
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    init_from: str | None = None
    resumed_from: str | None = None


RUN_FIELDS = {"run": str, "init_from": str | None, "resumed_from": str | None}
SIDECAR_FIELDS = {"run": str, "step": int}


def read_record(path: Path, fields: dict[str, type]) -> dict:
    """A JSON record this code writes (run.json, a snapshot's .json) of this format; ValueError naming the file."""
    try:
        record = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} could not be read ({type(e).__name__}: {e}).") from e
    if isinstance(record, dict) and record.get("format", snapshot.FORMAT) != snapshot.FORMAT:
        raise ValueError(f"{path} is of format {record['format']!r}, written by another version of train_gpt2.py; this "
                         f"one reads format {snapshot.FORMAT}. Use the version that wrote it, or another directory.")
    if not isinstance(record, dict) or set(record) != {"format", *fields} or \
            not all(isinstance(record[k], kind) for k, kind in fields.items()):
        raise ValueError(f"{path} is not a record as train_gpt2.py writes it ({', '.join(fields)}).")
    return {k: v for k, v in record.items() if k != "format"}


def write_record(path: Path, record: dict) -> None:
    atomic_write(path, lambda f: f.write(json.dumps({"format": snapshot.FORMAT} | record).encode()))


def read_run(snapshot_dir: Path) -> Run | None:
    path = snapshot_dir / RUN_FILE
    return Run(**read_record(path, RUN_FIELDS)) if path.exists() or path.is_symlink() else None


def sidecar(path: Path) -> Path:
    """A snapshot's .json; of a temp (snapshot_<step>.pt.<pid>.tmp, snapshot_<step>.tmp) its snapshot's."""
    return path.with_name(path.name.split(".")[0] + ".json")


@dataclass
class Entry:
    """A snapshot in the directory; run: whose its .json says (None: none); state: if it loads, else problem."""
    path: Path
    step: int
    run: str | None
    state: dict | None
    problem: str | None


def problem_of(path: Path, error: ValueError | OSError) -> str:
    """Why a snapshot cannot be used: a ValueError names the file already, an OSError does not."""
    return f"{path} ({type(error).__name__}: {error})" if isinstance(error, OSError) else str(error)


def survey(snapshot_dir: Path, owner: str | None = None) -> list[Entry]:
    """Every snapshot, newest first; one whose .json is damaged is `owner`'s (a copy of another's has its .json)."""
    found = []
    for path in snapshot.list_snapshots(snapshot_dir):
        run, state, problem = None, None, None
        try:
            if sidecar(path).exists() or sidecar(path).is_symlink():
                run = owner  # (what stays if the record is damaged)
                run = read_record(sidecar(path), SIDECAR_FIELDS)["run"]
            state = snapshot.load_snapshot(path, verify=False)
        except (ValueError, OSError) as e:
            problem = problem_of(path, e)
        found.append(Entry(path, int(snapshot.SNAPSHOT_NAME.fullmatch(path.name)[1]), run, state, problem))
    return found


def first_loadable(candidates: list[Entry], where: str) -> Entry:
    """The first that loads and whose bytes check, each before it named and skipped; ValueError if none does."""
    failures = []
    for entry in candidates:
        problem = entry.problem
        try:
            if problem is None:
                snapshot.verify_checksums(entry.path, entry.state)
                return entry
        except (ValueError, OSError) as e:
            problem = problem_of(entry.path, e)
        print(f"WARNING: skipping snapshot: {problem} Trying the next older one.", file=sys.stderr)
        failures.append(problem)
    raise ValueError(f"none of the {len(failures)} snapshots {where} loads: {' '.join(failures)}")


def health(snapshots: list[Entry]) -> Iterator[tuple[Path, bool | None]]:
    """Each snapshot and whether it is healthy: False if flagged not or its checksums fail, None if a read fails."""
    for entry in snapshots:
        healthy = entry.state["healthy"]
        try:
            if healthy:
                snapshot.verify_checksums(entry.path, entry.state)
        except ValueError:
            healthy = False
        except OSError:
            healthy = None
        yield entry.path, healthy


def remove_or_warn(path: Path) -> None:
    """Remove a snapshot (and its .json) or a temp; one that cannot be removed is a warning: this is housekeeping."""
    try:
        snapshot.remove(path)
        if snapshot.SNAPSHOT_NAME.fullmatch(path.name):  # (a temp has no .json of its own)
            sidecar(path).unlink(missing_ok=True)
    except OSError as e:
        print(f"WARNING: could not delete {path} ({type(e).__name__}: {e.strerror or e}); it is left as it is, and "
              "training goes on. Delete it yourself once it can be.", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------------------
# the run's snapshots

class Snapshots(TrainingState):

    def __init__(self, snapshot_dir: str, every: int, keep_last: int, resume_from: str, trainee: TrainingModel,
                 train_loader: DistributedDataLoader, run_config: dict, dist_env: Distributed,
                 print0: Callable[[str], None], stateful: dict | None = None, run_lock: RunLock | None = None):
        super().__init__(trainee, train_loader, run_config, dist_env, print0, stateful)
        self.dir, self.every, self.keep_last, self.resume_from = Path(snapshot_dir), every, keep_last, resume_from
        self.init_from, self.run_lock = run_config["init_from"], run_lock or RunLock()
        self.record, self.surveyed = Run(), []
        self.continued, self.last_saved = False, -1  # continued: the directory's run, from one of its snapshots
        # What the user named on the command line is never deleted (pruning, rollbacks), even if it is this run's.
        self.named = {Path(p).resolve() for p in (resume_from, self.init_from) if p not in ("auto", "never", "scratch")}
        self.resumed_config: dict | None = None  # the flags of the run that wrote the snapshot resumed from

    @property
    def run(self) -> str:
        return self.record.run

    def as_now(self, recorded: str | None) -> str | None:
        """A path run.json records, as it is from here (a Hugging Face name as it is)."""
        path = self.dir / recorded if recorded else None
        return str(path.resolve()) if path and (path.exists() or recorded.endswith(".pt")) else recorded

    def relative(self, path: str) -> str:
        return os.path.relpath(Path(path).resolve(), self.dir.resolve()) if Path(path).exists() else path

    def resume(self) -> tuple[int, str | None]:
        """Do what TABLE says, then write run.json: the step to start at and the snapshot restored (None: none)."""
        self.record, self.continued, path, self.surveyed = agreed(self._decide, self.dist_env)
        start = 0
        if path is not None:
            state = snapshot.load_snapshot(path, verify=False)  # (rank 0 has verified it)
            try:
                self.restore(path, state)
            except ValueError as e:  # the shards: a value that is not plain data
                raise UserError(f"--resume: {e} Pass another snapshot, or --resume never to start over.") from e
            self.last_saved, self.resumed_config, start = state["step"], state["config"], state["step"] + 1
        agreed(lambda: self._check_the_way(start), self.dist_env)
        return start, path

    def save_if_due(self, step: int, last_step: int, stopping: bool, healthy: bool = True) -> Path | None:
        """Snapshot the state after `step` if due (a beat, the last step, a stop); returns the path written, if any."""
        due = (self.every and (step + 1) % self.every == 0) or step == last_step or stopping
        if not due or step <= self.last_saved:  # nothing trained since the last one (a stop during evaluation)
            return None
        if not self.finite():
            self.print0(f"WARNING: no snapshot after step {step}: the weights or optimizer state hold NaN or inf. The "
                        f"snapshots in {self.dir} are kept as they are.")
            return None
        state = self.capture(step, healthy, self.run)
        path = snapshot.snapshot_path(self.dir, step, self.trainee.sharded)
        self._stop_if_moved()
        failure, ours_already, written = None, sidecar(path).exists(), False
        try:
            if self.dist_env.is_master:
                write_record(sidecar(path), {"run": self.run, "step": step})  # first: a crash after it leaves ours
        except OSError as e:
            failure = e
        try:
            if not any_rank(failure is not None, self.dist_env.device):
                if self.trainee.sharded:
                    snapshot.save_sharded_snapshot(state, self.trainee.raw, list(self.trainee.optimizer), path,
                                                   self.dist_env.device)
                elif state is not None:
                    snapshot.save_snapshot(state, path)
                written = True
        except OSError as e:  # the temp file or directory is gone, the older ones intact
            failure = e
        finally:  # (a failure, or a second Ctrl-C: the .json of a snapshot that is not there goes too)
            if self.dist_env.is_master and not written and not ours_already:
                sidecar(path).unlink(missing_ok=True)
        if any_rank(failure is not None, self.dist_env.device):
            return self._write_failed(step, path, failure, final=step == last_step or stopping)
        self._stop_if_moved()  # (moved while it was written)
        if self.dist_env.is_master:
            self._prune()
            self.print0(f"snapshot written: {path}")
        self.last_saved = step
        return path

    def _stop_if_moved(self) -> None:
        """Collective: every rank raises rank 0's UserError if the directory is no longer where the run locked it."""
        agreed(lambda: self.run_lock.check_in_place(self.dir), self.dist_env)

    def _write_failed(self, step: int, path: Path, failure: BaseException | None, final: bool) -> None:
        """A warning (rank 0), and training goes on; but a run must not end without its last snapshot."""
        self._stop_if_moved()  # (a write that failed as the directory was moved away: the move is the error)
        usage, older = shutil.disk_usage(self.dir), self._own_snapshots()
        why, last = reason(failure) if failure else "on another rank", ", and it was the run's last" if final else ""
        newest = f"the older snapshots are intact, the newest is {older[0].path}" if older else \
            "there is no older snapshot"
        what = (f"the snapshot of step {step} could not be written to {path.parent} ({why}; "
                f"{usage.free / 2**20:,.0f} MiB free of {usage.total / 2**20:,.0f} MiB){last}; {newest}")
        if final:
            raise UserError(f"{what}. Free space (or point --snapshot_dir at a disk with room) and rerun the same "
                            "command to resume from there.")
        if self.dist_env.is_master:
            print(f"WARNING: {what}. Training goes on; the next due snapshot tries again.", file=sys.stderr)

    def rollback(self) -> tuple[int, str] | None:
        """Restore the newest healthy snapshot but its data position; its step and path (None: none)."""
        path = self.newest_healthy()
        if path is None:
            return None
        state = snapshot.load_snapshot(path, verify=False)  # rank 0 has verified it
        self.restore(path, state, data_position=False)
        return state["step"], path

    def commit_rollback(self, step: int, path: str) -> None:
        """Write the state over the snapshot restored (a directory's meta.pt: its shards hold those weights), and delete
        this run's newer snapshots (all unhealthy); a failed write warns."""
        state, self.last_saved = self.capture(step, True, self.run), step
        if not self.dist_env.is_master:
            return
        try:
            if Path(path).is_dir():
                state["shard_crc32"] = snapshot.load_snapshot(path, verify=False)["shard_crc32"]
            snapshot.save_snapshot(state, Path(path) / "meta.pt" if Path(path).is_dir() else Path(path))
        except OSError as e:
            print(f"WARNING: the rollback could not be written to {path} ({reason(e)}); a crash before "
                  "the next snapshot would resume from before the rollback.", file=sys.stderr)
        for abandoned in self._own_snapshots():
            if abandoned.step > step and abandoned.path.resolve() not in self.named:
                remove_or_warn(abandoned.path)
                self.print0(f"removed {abandoned.path}: written while updates were being skipped, after {path}")

    def newest_healthy(self) -> str | None:
        """The newest healthy snapshot of this run (rank 0 looks, every rank gets its answer)."""
        return agreed(lambda: next((str(p) for p, good in health(self._own_snapshots()) if good), None), self.dist_env)

    def _own_snapshots(self) -> list[Entry]:
        """This run's snapshots that load (bytes unchecked), newest first."""
        return [e for e in survey(self.dir) if e.state and e.run == self.run]

    def _prune(self) -> None:
        """Delete all but the keep_last newest of this run's snapshots (never one named, the newest healthy one nor a
        newer one of unknown health), and the temps its writes cut short left."""
        own = self._own_snapshots()
        old, keep = [e.path for e in own if e.path.resolve() not in self.named][self.keep_last:], set()
        for path, healthy in health(own) if old else ():
            if healthy is not False:
                keep.add(path)
            if healthy:
                break
        for path in [p for p in old if p not in keep] + [p for p in self.dir.glob("snapshot_*tmp") if self._ours(p)]:
            remove_or_warn(path)

    def _ours(self, temp: Path) -> bool:
        """Whether a temp file or directory is of a write of this run's (its step's .json names the run)."""
        try:
            return read_record(sidecar(temp), SIDECAR_FIELDS)["run"] == self.run
        except ValueError:  # (no .json of this run's)
            return False

    # --- which snapshot: the table

    def _decide(self) -> tuple[Run, bool, str | None, list[Entry]]:
        """Rank 0: the run's record, whether it continues it, the snapshot to restore and the survey; or a refusal."""
        try:
            recorded = read_run(self.dir)
        except ValueError as e:
            raise UserError(self._damaged(e)) from e
        found = survey(self.dir, recorded and recorded.run)
        own = [e for e in found if recorded and e.run == recorded.run]
        origin, newest = self.as_now(recorded and recorded.resumed_from), next((e for e in own if e.state), None)
        action = decide(self._holds(recorded, own, newest, origin), self._asks(recorded, newest, origin))
        if action is Action.START:
            branch = self._branch_from()
            init_from = self.relative(self.init_from) if self.init_from != "scratch" else None
            return Run(init_from=init_from, resumed_from=branch and self.relative(branch)), False, branch, found
        if action is Action.RESTART:
            return recorded, False, origin, found
        if action in (Action.CONTINUE, Action.REFUSE_DAMAGED):  # (REFUSE_DAMAGED: raises, naming every one)
            try:
                return recorded, True, str(first_loadable(own, f"of run {recorded.run} in {self.dir}").path), found
            except ValueError as e:
                raise UserError(self._damaged(e)) from e
        raise UserError(self._refusal(action, recorded, newest))

    def _holds(self, recorded: Run | None, own: list[Entry], newest: Entry | None, origin: str | None) -> Holds:
        """TABLE's row: what the directory holds."""
        if recorded is None:
            return Holds.EMPTY
        if newest:
            return Holds.SNAPSHOTS
        if own:
            return Holds.DAMAGED
        if origin and not self._loads(origin):
            return Holds.ORIGIN_LOST
        return Holds.NOT_STARTED_INIT if recorded.init_from else Holds.NOT_STARTED

    def _asks(self, recorded: Run | None, newest: Entry | None, origin: str | None) -> Asks:
        """TABLE's column: what the command line asks, against the directory's run."""
        if self.resume_from == "never":
            return Asks.NEW
        if self.resume_from == "auto" and self.init_from == "scratch":
            return Asks.AUTO
        if recorded is None:
            return Asks.ORIGIN
        if self.resume_from != "auto":  # a branch: its origin, or the snapshot --resume auto would continue
            again = Path(self.resume_from).resolve() in (origin and Path(origin), newest and newest.path.resolve())
        else:
            again = recorded.init_from == self.relative(self.init_from)
        return Asks.ORIGIN if again else Asks.NEW

    def _damaged(self, e: ValueError) -> str:
        """The refusal when a record of the directory is not one, or no snapshot to continue loads."""
        return (f"--resume {self.resume_from}: {e} Nothing was deleted. Repair or move them away (a copy of a good "
                f"snapshot elsewhere: --resume PATH), or start over with --resume never in a fresh "
                f"{self._own_directory_flag()}.")

    def _loads(self, path: str) -> bool:
        try:
            return bool(snapshot.load_snapshot(path))
        except (ValueError, OSError):
            return False

    def _branch_from(self) -> str | None:
        """--resume PATH (None: not a branch); a UserError naming its snapshot if it is missing or does not load."""
        if self.resume_from in ("auto", "never"):
            return None
        if not Path(self.resume_from).exists():
            raise UserError(f"--resume {self.resume_from}: no such file. Pass the path of a snapshot_* file, 'auto' "
                            "(the newest valid snapshot in --snapshot_dir) or 'never' (start fresh).")
        try:
            snapshot.load_snapshot(self.resume_from)
        except ValueError as e:
            raise UserError(f"--resume: {e} Pass another snapshot, 'auto' or 'never'.") from e
        return self.resume_from

    def _refusal(self, action: Action, recorded: Run, newest: Entry | None) -> str:
        """A refusal's words, naming the paths as they are now."""
        directory, own_flag = self.dir, self._own_directory_flag()
        origin, init_from = self.as_now(recorded.resumed_from), self.as_now(recorded.init_from)
        if action is Action.REFUSE_INIT:
            return (f"--snapshot_dir {directory} holds a run started with --init_from {init_from} that was stopped "
                    f"before its first snapshot. To start it again, rerun with --init_from {init_from}; to start "
                    f"another run, give it a directory of its own ({own_flag} NEW_DIR).")
        if action is Action.REFUSE_LOST:
            return (f"--snapshot_dir {directory} holds a run branched from {origin}, which is gone or no longer "
                    "loads, and the branch was stopped before its first snapshot: there is nothing to continue it "
                    f"from. Put {origin} back and rerun the same command, or start another run in a directory of its "
                    f"own ({own_flag} NEW_DIR).")
        holds = (f"run {recorded.run}'s snapshots (newest: {newest.path.name})" if newest else
                 f"run {recorded.run}, stopped before its first snapshot")
        asked = ("--resume never starts a new run" if self.resume_from == "never" else
                 f"--init_from {self.init_from} starts a new run from those weights" if self.resume_from == "auto" else
                 f"--resume {self.resume_from} branches a new run from that snapshot")
        again = f"--resume {origin}" if origin else f"--resume auto{' --init_from ' + init_from if init_from else ''}"
        step = snapshot.SNAPSHOT_NAME.fullmatch(Path(self.resume_from).name)  # a branch's directory: its first step
        own = f"--snapshot_dir {directory}/branch_{int(step[1]) + 1:07d}" if step else f"{own_flag} NEW_DIR"
        return (f"--snapshot_dir {directory} holds {holds}, and {asked}: one directory holds one run, so this one "
                f"stops before it reads or writes anything there. To continue that run, rerun it with {again}; to "
                f"start this one, give it a directory of its own ({own}), or move those files away.")

    def _own_directory_flag(self) -> str:
        return "--snapshot_dir" if self.run_config.get("snapshot_dir") else "--log_dir"

    def _check_the_way(self, start: int) -> None:
        """Rank 0: stop if another run's snapshot is at a step this run will write, name the others; write run.json."""
        others = [e for e in self.surveyed if e.run != self.run]
        in_the_way = [e.path.name for e in others if start <= e.step < self.run_config["max_steps"]]
        if in_the_way:
            raise UserError(f"--snapshot_dir {self.dir} holds snapshots this run did not write, at steps it will "
                            f"write ({', '.join(in_the_way[:4])}{', ...' if len(in_the_way) > 4 else ''}): another "
                            "run's, or without the .json that says whose. Writing over them would destroy them, so "
                            "this run stops before its first step. Give it a directory of its own (e.g. --snapshot_dir "
                            f"{self.dir}/branch_{start:07d}), or move them out of the way.")
        if others:
            self.print0(f"note: {self.dir} also holds snapshots this run did not write: "
                        f"{', '.join(e.path.name for e in others)}. They are left as they are: never resumed by "
                        "--resume auto, never pruned.")
        try:
            write_record(self.dir / RUN_FILE, asdict(self.record))
        except OSError as e:
            raise UserError(f"{self.dir / RUN_FILE} could not be written ({reason(e)}), so this run stops before its "
                            "first step. Free space, or point --snapshot_dir at a directory that can be "
                            "written.") from e

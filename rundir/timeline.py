"""What a run does with its --snapshot_dir: the state table, and the timelines it is written in.

A *timeline* is one line of snapshots: a run started afresh (from random weights, or --init_from X), or branched
from a snapshot named by --resume PATH. Each snapshot records its timeline's id and the snapshots it descends from,
and timeline.json in the directory names the directory's timeline and its origin (scratch, --init_from X, or the
snapshot it branched from). timeline.json is written before the run's first step, so that a run killed before its
first snapshot is still known, and a directory holds one timeline: its metrics, its wandb run, its snapshots.

What a run does is one look-up in TABLE: the row is what the directory holds (survey()), the column what the user
asked (ask()), the cell one action (Action). docs/reliability.md shows TABLE as table_markdown() prints it, and a
test keeps the two equal. Besides the table, one rule: a run never writes over a snapshot it did not write, so one
that sits at a step the run will write stops it before its first step (snapshot_store.Snapshots).
"""

import json
import sys
import uuid
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from rundir.snapshot import (
    SNAPSHOT_NAME,
    is_snapshot_directory,
    list_snapshots,
    load_snapshot,
    pickle_strings,
    verify_checksums,
)
from training.files import atomic_write

TIMELINE_FILE = "timeline.json"


class Holds(Enum):
    """The rows: what --snapshot_dir holds."""
    NOTHING = "nothing (no snapshot, no timeline.json)"
    SNAPSHOTS = "its timeline, a snapshot of which loads"
    DAMAGED = "its timeline, no snapshot of which loads"
    STARTED = "its timeline, started from scratch or a snapshot, no snapshot written yet"
    STARTED_FROM_WEIGHTS = "its timeline, started --init_from X, no snapshot written yet"
    ORIGIN_GONE = "its timeline, a branch whose parent snapshot is gone or damaged, no snapshot written yet"
    UNRECORDED = "snapshots without timeline.json (older code's, or copied in), one of which loads"
    UNRECORDED_DAMAGED = "snapshots without timeline.json, none of which loads"


class Asks(Enum):
    """The columns: what the user asked, against what the directory records."""
    AUTO = "--resume auto"
    NEVER = "--resume never"
    SAME = ("the directory's origin again: the --init_from X or --resume PATH that timeline.json records (without "
            "one: that its newest snapshot was written with)")
    NEWEST = "--resume PATH, the snapshot --resume auto would continue"
    OTHER_INIT = "another --init_from X"
    OTHER_PATH = "another --resume PATH"


class Action(Enum):
    """The cells."""
    START = "start: a new timeline (random weights, or --init_from's)"
    BRANCH = "branch: a new timeline from PATH"
    CONTINUE = "continue the newest snapshot that loads (damaged ones named, skipped)"
    RESTART = "start the timeline again from its origin"
    REFUSE_TAKEN = "refuse: the directory is another run's"
    REFUSE_DAMAGED = "refuse, naming every damaged snapshot"
    REFUSE_ORIGIN = "refuse, naming the origin to pass again (--init_from X)"
    REFUSE_ORIGIN_GONE = "refuse, naming the parent snapshot that is gone"


_ = None  # a cell that cannot occur: a directory with no origin to repeat, or no snapshot to continue
S, B, C, R = Action.START, Action.BRANCH, Action.CONTINUE, Action.RESTART
TAKEN, DAMAGED = Action.REFUSE_TAKEN, Action.REFUSE_DAMAGED
# columns:                  AUTO                       NEVER  SAME                       NEWEST OTHER_INIT OTHER_PATH
TABLE: dict[Holds, tuple[Action | None, ...]] = {
    Holds.NOTHING:              (S,                        S,     _,                         _,     S,     B),
    Holds.SNAPSHOTS:            (C,                        TAKEN, C,                         C,     TAKEN, TAKEN),
    Holds.DAMAGED:              (DAMAGED,                  TAKEN, DAMAGED,                   _,     TAKEN, TAKEN),
    Holds.STARTED:              (R,                        TAKEN, R,                         _,     TAKEN, TAKEN),
    Holds.STARTED_FROM_WEIGHTS: (Action.REFUSE_ORIGIN,     TAKEN, R,                         _,     TAKEN, TAKEN),
    Holds.ORIGIN_GONE:          (Action.REFUSE_ORIGIN_GONE, TAKEN, Action.REFUSE_ORIGIN_GONE, _,    TAKEN, TAKEN),
    Holds.UNRECORDED:           (C,                        S,     C,                         C,     S,     B),
    Holds.UNRECORDED_DAMAGED:   (DAMAGED,                  S,     _,                         _,     S,     B),
}
del _, S, B, C, R, TAKEN, DAMAGED


def decide(holds: Holds, asks: Asks) -> Action:
    """What a run does: the one place that decides it."""
    action = TABLE[holds][list(Asks).index(asks)]
    if action is None:
        raise AssertionError(f"ask() gave {asks} for a directory that holds {holds}: that cannot happen")
    return action


def table_markdown() -> str:
    """TABLE as docs/reliability.md shows it: the table, then what each row, column and cell means."""
    lines = ["| holds \\ asks | " + " | ".join(f"`{asks.name}`" for asks in Asks) + " |",
             "|---" * (len(Asks) + 1) + "|"]
    lines += [f"| `{holds.name}` | " + " | ".join(f"`{a.name}`" if a else "—" for a in row) + " |"
              for holds, row in TABLE.items()]
    lines += ["", "Rows, what the directory holds:"] + [f"- `{holds.name}`: {holds.value}" for holds in Holds]
    lines += ["", "Columns, what the user asked:"] + [f"- `{asks.name}`: {asks.value}" for asks in Asks]
    lines += ["", "Cells, what the run does (—: cannot occur):"] + [f"- `{a.name}`: {a.value}" for a in Action]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# timelines

@dataclass
class Timeline:
    """A line of snapshots: run, its id (also its wandb run's); branched_from, the [timeline id, step] of each
    snapshot it descends from, oldest first; its origin: resumed_from, the snapshot it branched from, or init_from,
    the weights it started from (a path resolved, or a Hugging Face name), or neither (random weights)."""
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    branched_from: list[list] = field(default_factory=list)
    resumed_from: str | None = None
    init_from: str | None = None

    def branch_at(self, path: str | Path, state: dict) -> "Timeline":
        """A new timeline that continues from the snapshot `state`, read from `path`."""
        parent = state.get("timeline")
        ancestry = [*parent["branched_from"], [parent["run"], state["step"]]] if is_timeline(parent) else []
        return Timeline(branched_from=ancestry, resumed_from=str(Path(path).resolve()))


def is_timeline(recorded) -> bool:
    """Whether a snapshot's "timeline" (or timeline.json's) is one this code writes: a run id and a list of
    [run id, step] pairs (a snapshot from before timelines has none)."""
    return isinstance(recorded, dict) and isinstance(recorded.get("run"), str) and \
        isinstance(recorded.get("branched_from"), list) and all(
            isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and type(pair[1]) is int
            for pair in recorded["branched_from"])


def record_timeline(snapshot_dir: str | Path, timeline: Timeline) -> None:
    atomic_write(Path(snapshot_dir) / TIMELINE_FILE, lambda f: f.write(json.dumps(asdict(timeline)).encode()))


def read_timeline(snapshot_dir: str | Path) -> Timeline | None:
    """The timeline timeline.json names, None if there is none. ValueError naming the file if it is not one."""
    path = Path(snapshot_dir) / TIMELINE_FILE
    if not path.exists() and not path.is_symlink():
        return None
    try:
        recorded = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        recorded = e
    required, optional = {"run", "branched_from", "resumed_from"}, {"init_from"}  # (older code: no init_from)
    if not is_timeline(recorded) or not required <= set(recorded) <= required | optional or \
            not all(isinstance(recorded.get(key), str | None) for key in ("resumed_from", "init_from")):
        raise ValueError(f"{path} does not name a timeline as this code writes it (at a run's start, to say which "
                         "snapshots --resume auto continues). Move it away to resume the newest snapshot in the "
                         "directory, whatever run wrote it.")
    return Timeline(**recorded)


def origin_of_weights(init_from: str) -> str | None:
    """How timeline.json records --init_from: None for scratch, a path resolved, or a Hugging Face model's name."""
    if init_from == "scratch":
        return None
    return str(Path(init_from).resolve()) if Path(init_from).exists() else init_from


# ----------------------------------------------------------------------------------------------------------------
# the directory

def warn_of_ignored_entries(snapshot_dir: str | Path) -> None:
    """One warning naming the entries of snapshot_dir that look like snapshots but are not named as this code names
    them (nor ever touched by it), e.g. snapshot_1.pt; temp files of writes cut short are among them."""
    snapshot_dir = Path(snapshot_dir)
    ignored = sorted(p.name for p in snapshot_dir.glob("snapshot_*") if not SNAPSHOT_NAME.fullmatch(p.name))
    if ignored:
        print(f"WARNING: --resume auto ignores in {snapshot_dir}: {', '.join(ignored)} (not named as this code names "
              "snapshots: snapshot_<step, 7 digits>.pt, or snapshot_<step>/ with --parallel fsdp).", file=sys.stderr)


@dataclass
class Entry:
    """A snapshot in the directory: its path and step (by its name); its state if it loads (without checking its
    bytes), else why not; and the timeline id its pickle names, read even from a damaged file (None: unknown)."""
    path: Path
    step: int
    state: dict | None
    problem: str | None
    run: str | None


def entries(snapshot_dir: str | Path) -> list[Entry]:
    """Every snapshot in snapshot_dir, newest first."""
    found = []
    for path in list_snapshots(snapshot_dir):
        step = int(SNAPSHOT_NAME.fullmatch(path.name).group(1))
        try:
            state, problem = load_snapshot(path, verify=False), None
        except (ValueError, OSError) as e:
            state, problem = None, f"{path} ({type(e).__name__}: {e})" if isinstance(e, OSError) else str(e)
        if state is not None:
            recorded = state.get("timeline")
            run = recorded["run"] if is_timeline(recorded) else None
        else:
            run = run_named_by(path)
        found.append(Entry(path, step, state, problem, run))
    return found


def run_named_by(path: Path) -> str | None:
    """The timeline id in a damaged snapshot's pickle (a file cut short or flipped after it), None if unknown: the
    string after "run" in its "timeline" (the pickle writes a dict's keys and values in order)."""
    strings = pickle_strings(path / "meta.pt" if is_snapshot_directory(path) else path) or []
    after = strings[strings.index("timeline"):] if "timeline" in strings else []
    return after[after.index("run") + 1] if "run" in after[:-1] else None


def first_loadable(candidates: list[Entry], where: str) -> Entry | None:
    """The first of `candidates` that loads and whose bytes check (verify_checksums); the others before it are skipped
    with a warning naming them. None if there are none; ValueError naming them all if none loads."""
    failures = []
    for entry in candidates:
        problem = entry.problem
        if problem is None:
            try:
                verify_checksums(entry.path, entry.state)
                return entry
            except (ValueError, OSError) as e:
                problem = f"{entry.path} ({type(e).__name__}: {e})" if isinstance(e, OSError) else str(e)
        print(f"WARNING: skipping snapshot: {problem} Trying the next older one.", file=sys.stderr)
        failures.append(problem)
    if failures:
        raise ValueError(f"none of the {len(failures)} snapshots {where} loads: {' '.join(failures)}")
    return None


def find_latest_snapshot(snapshot_dir: str | Path) -> tuple[Path, dict] | None:
    """The newest snapshot in snapshot_dir that loads, whatever its timeline (see first_loadable)."""
    entry = first_loadable(entries(snapshot_dir), f"in {snapshot_dir}")
    return (entry.path, entry.state) if entry else None


def is_own(entry: Entry, timeline: Timeline) -> bool:
    """Whether `timeline` wrote this snapshot: it loads and records the timeline, or (damaged) its pickle names it."""
    return entry.run == timeline.run


@dataclass
class Survey:
    """What snapshot_dir holds: its row of TABLE, the timeline timeline.json records (None without one), the
    snapshots --resume auto would try, newest first (damaged ones among them, to be named), and every snapshot."""
    holds: Holds
    recorded: Timeline | None
    candidates: list[Entry]
    entries: list[Entry]

    def newest(self) -> Entry | None:
        """The newest candidate that loads (without checking its bytes)."""
        return next((e for e in self.candidates if e.state is not None), None)


def survey(snapshot_dir: str | Path) -> Survey:
    """The row of TABLE for snapshot_dir. ValueError naming timeline.json if it is not one."""
    warn_of_ignored_entries(snapshot_dir)
    recorded = read_timeline(snapshot_dir)
    found = entries(snapshot_dir)
    if recorded is None:
        holds = Holds.UNRECORDED if any(e.state is not None for e in found) else \
            Holds.UNRECORDED_DAMAGED if found else Holds.NOTHING
        return Survey(holds, None, found, found)
    # Its own, and damaged ones whose pickle no longer says whose: one may be the newest of its own, so the run
    # never starts over while there is one.
    candidates = [e for e in found if is_own(e, recorded) or (e.state is None and e.run is None)]
    if any(e.state is not None for e in candidates):
        holds = Holds.SNAPSHOTS
    elif candidates:
        holds = Holds.DAMAGED
    elif recorded.resumed_from and not origin_loads(recorded.resumed_from):
        holds = Holds.ORIGIN_GONE
    else:
        holds = Holds.STARTED_FROM_WEIGHTS if recorded.init_from else Holds.STARTED
    return Survey(holds, recorded, candidates, found)


def adopted_timeline(newest: Entry) -> Timeline:
    """The timeline of a directory without timeline.json: its newest snapshot's (whose older snapshots it then prunes
    as its own), or for a snapshot from before timelines, a branch from it."""
    recorded = newest.state.get("timeline")
    if is_timeline(recorded):
        return Timeline(recorded["run"], recorded["branched_from"])
    return Timeline().branch_at(newest.path, newest.state)


def origin_loads(path: str) -> bool:
    """Whether the snapshot a branch started from loads and its bytes check: restarting it from a damaged one would
    train from other weights than the branch's."""
    try:
        load_snapshot(path)
        return True
    except (ValueError, OSError):
        return False


def ask(resume: str, init_from: str, found: Survey) -> Asks:
    """The column of TABLE for --resume and --init_from, against the directory's origin: what timeline.json records,
    or without one, the flags its newest snapshot was written with."""
    newest = found.newest()
    origin = found.recorded
    if origin is None and newest is not None:
        written_with = newest.state["config"]
        resumed = written_with.get("resume", "auto")
        origin = Timeline(init_from=origin_of_weights(written_with.get("init_from", "scratch")),
                          resumed_from=None if resumed in ("auto", "never") else str(Path(resumed).resolve()))
    if resume == "never":
        return Asks.NEVER
    if resume != "auto":
        path = str(Path(resume).resolve())
        if origin is not None and origin.resumed_from == path:
            return Asks.SAME
        if newest is not None and str(newest.path.resolve()) == path:
            return Asks.NEWEST
        return Asks.OTHER_PATH
    if init_from != "scratch":
        return Asks.SAME if origin is not None and origin.init_from == origin_of_weights(init_from) else \
            Asks.OTHER_INIT
    return Asks.AUTO


def own_snapshots(snapshot_dir: str | Path, timeline: Timeline) -> list[tuple[Path, dict]]:
    """The snapshots of `timeline` in snapshot_dir that load (without checking their bytes), newest first."""
    return [(e.path, e.state) for e in entries(snapshot_dir) if e.state is not None and is_own(e, timeline)]

"""Which snapshots in --snapshot_dir are this run's: its timeline, and the directory's listing.

A timeline is a run started afresh, or branched from a snapshot named by --resume PATH (continuing the newest snapshot
of the directory's current timeline is not a branch). Each snapshot records its timeline's id and the snapshots it
descends from (snapshot_store.Snapshots writes them into its "timeline"), and timeline.json in the directory names the
current timeline; it is written before that timeline's first snapshot lands, so a crash between the two never leaves
--resume auto continuing an older timeline over a newer one. A directory without timeline.json (written before
timelines were recorded) resumes its newest snapshot, as before.
"""

import json
import sys
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from files import atomic_write
from snapshot import SNAPSHOT_NAME, list_snapshots, load_snapshot

TIMELINE_FILE = "timeline.json"


@dataclass
class Timeline:
    """A line of snapshots: run, its id; branched_from, the [timeline id, step] of each snapshot it descends from,
    oldest first; resumed_from, the path of the snapshot it branched from (where --resume auto falls back to when
    none of its own loads)."""
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    branched_from: list[list] = field(default_factory=list)
    resumed_from: str | None = None

    def owns(self, state: dict) -> bool:
        return is_timeline(recorded := state.get("timeline")) and recorded["run"] == self.run

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


def find_latest_snapshot(snapshot_dir: str | Path) -> tuple[Path, dict] | None:
    """The newest snapshot in snapshot_dir that loads, whatever its timeline (see first_loadable)."""
    return first_loadable(list_snapshots(snapshot_dir), f"in {snapshot_dir}")


def first_loadable(paths: list[Path], where: str) -> tuple[Path, dict] | None:
    """The first of `paths` that loads; broken ones are skipped with a warning naming them. None if there is none;
    ValueError naming them all if there are some and none loads (a fresh start would prune them away)."""
    failures = []
    for path in paths:
        try:
            return path, load_snapshot(path)
        except (ValueError, OSError) as e:
            print(f"WARNING: skipping snapshot: {e} Trying the next older one.", file=sys.stderr)
            failures.append(f"{path} ({type(e).__name__}: {e})" if isinstance(e, OSError) else str(e))
    if failures:
        raise ValueError(f"none of the {len(failures)} snapshots {where} loads: {' '.join(failures)}")
    return None


# ----------------------------------------------------------------------------------------------------------------
# timelines

def record_timeline(snapshot_dir: str | Path, timeline: Timeline) -> None:
    atomic_write(Path(snapshot_dir) / TIMELINE_FILE, lambda f: f.write(json.dumps(asdict(timeline)).encode()))


def read_timeline(snapshot_dir: str | Path) -> Timeline | None:
    """The timeline timeline.json names, None if there is none. ValueError naming the file if it is not one."""
    path = Path(snapshot_dir) / TIMELINE_FILE
    if not path.exists():
        return None
    try:
        recorded = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        recorded = e
    if not is_timeline(recorded) or set(recorded) != {"run", "branched_from", "resumed_from"} or \
            not isinstance(recorded["resumed_from"], str | None):
        raise ValueError(f"{path} does not name a timeline as this code writes it (before a run's first snapshot, to "
                         "say which snapshots --resume auto continues). Delete it to resume the newest snapshot in "
                         "the directory, whatever run wrote it.")
    return Timeline(**recorded)


def timeline_membership(snapshot_dir: str | Path, timeline: Timeline) -> Iterator[tuple[Path, int, bool]]:
    """Each snapshot in snapshot_dir, newest first: its path, its step (by its name) and whether it is `timeline`'s
    own (one that does not load is not)."""
    for path in list_snapshots(snapshot_dir):
        step = int(SNAPSHOT_NAME.fullmatch(path.name).group(1))
        try:
            yield path, step, timeline.owns(load_snapshot(path, verify=False))
        except (ValueError, OSError):
            yield path, step, False


def own_snapshots(snapshot_dir: str | Path, timeline: Timeline) -> list[tuple[Path, dict]]:
    """The snapshots of `timeline` in snapshot_dir that load (without checking their bytes), newest first."""
    owned = []
    for path in list_snapshots(snapshot_dir):
        try:
            state = load_snapshot(path, verify=False)
        except (ValueError, OSError):
            continue
        if timeline.owns(state):
            owned.append((path, state))
    return owned


def current_timeline(snapshot_dir: str | Path) -> tuple[Timeline, bool, tuple[Path, dict] | None]:
    """For --resume auto: the directory's current timeline, whether timeline.json names it, and its newest snapshot
    that loads, else the snapshot it branched from (None: a fresh start). Without timeline.json, the newest snapshot
    that loads, whatever wrote it, and its timeline (a branch from it, for a snapshot from before timelines).
    ValueError if there are snapshots to resume and none loads."""
    warn_of_ignored_entries(snapshot_dir)
    timeline = read_timeline(snapshot_dir)
    if timeline is None:
        found = find_latest_snapshot(snapshot_dir)
        if found is None:
            return Timeline(), False, None
        recorded = found[1].get("timeline")
        if is_timeline(recorded):
            return Timeline(recorded["run"], recorded["branched_from"]), False, found
        return Timeline().branch_at(*found), False, found
    candidates = [path for path, _, own in timeline_membership(snapshot_dir, timeline) if own]
    if timeline.resumed_from and Path(timeline.resumed_from).exists():
        candidates.append(Path(timeline.resumed_from))
    return timeline, True, first_loadable(candidates, f"of this run's timeline in {snapshot_dir}"
                                          + (f" (nor {timeline.resumed_from}, which it branched from)"
                                             if timeline.resumed_from else ""))


def continued_or_branched(snapshot_dir: str | Path, path: str, state: dict) -> tuple[Timeline, bool]:
    """The timeline of a run resumed from --resume `path`, and whether timeline.json names it already: the
    directory's current one if `path` is its newest snapshot there, else a branch. ValueError if timeline.json is
    not one."""
    timeline = read_timeline(snapshot_dir)
    if timeline is not None and timeline.owns(state) and Path(path).resolve().parent == Path(snapshot_dir).resolve():
        if not any(s["step"] > state["step"] for _, s in own_snapshots(snapshot_dir, timeline)):
            return timeline, True
    return Timeline().branch_at(path, state), False

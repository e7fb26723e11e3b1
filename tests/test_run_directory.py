"""The state table (timeline.py, issue 55): what a run does with its --snapshot_dir, in one place, and the docs.

The fast tests build each row of the table from real snapshot files (tiny ones, written as the run writes them) and
check the row survey() reads, the column ask() reads for each request, and the cell decide() gives. The slow ones run
train_gpt2.py for real, with faults, on the cases issue 55 found broken.
"""

import errno
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import ROOT, failing, flip_a_byte_in_tensor_data, make_shards, tiny_snapshots
from helpers_train import read_metrics, run_train, start_train
from rundir import store as snapshot_store
from rundir import timeline
from rundir.snapshot import REQUIRED_KEYS, list_snapshots, load_snapshot, save_snapshot, snapshot_path
from rundir.store import Snapshots
from rundir.timeline import (
    TABLE,
    Action,
    Asks,
    Holds,
    Timeline,
    adopted_timeline,
    ask,
    decide,
    entries,
    origin_of_weights,
    read_timeline,
    record_timeline,
    survey,
    table_markdown,
)
from training.errors import UserError


def test_the_docs_show_the_table_the_code_decides_from():
    assert table_markdown() in (ROOT / "docs" / "reliability.md").read_text()


def test_every_row_has_a_cell_for_every_column_and_each_cell_one_action():
    assert set(TABLE) == set(Holds) and all(len(row) == len(Asks) for row in TABLE.values())
    # The promises the table keeps: a run whose directory holds a recorded timeline never starts a new one there,
    # and one whose snapshots all fail to load never starts over.
    for holds in (Holds.SNAPSHOTS, Holds.DAMAGED, Holds.STARTED, Holds.STARTED_FROM_WEIGHTS, Holds.ORIGIN_GONE):
        assert all(a not in (Action.START, Action.BRANCH) for a in TABLE[holds])
    for holds in (Holds.DAMAGED, Holds.UNRECORDED_DAMAGED):
        assert decide(holds, Asks.AUTO) is Action.REFUSE_DAMAGED
    with pytest.raises(AssertionError, match="cannot happen"):
        decide(Holds.NOTHING, Asks.SAME)


# ----------------------------------------------------------------------------------------------------------------
# the rows, built from files

def fake_snapshot(directory: Path, step: int, timeline: Timeline | None) -> Path:
    """A snapshot file as the run writes one (the keys, the timeline), without a model: survey() reads no weights."""
    state = {key: {} for key in REQUIRED_KEYS} | {"step": step, "rng": [], "wandb_id": "w" * 12}
    if timeline is not None:  # (a new timeline's wandb run id is its id: the pickle writes the string once)
        state |= {"wandb_id": timeline.run, "timeline": {"run": timeline.run, "branched_from": timeline.branched_from}}
    path = snapshot_path(directory, step)
    save_snapshot(state, path)
    return path


def truncate(path: Path, keep: float = 0.6) -> None:
    """Cut a snapshot short, as a full disk or a bad copy does: its pickle (written first) survives."""
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


@pytest.fixture
def parent(tmp_path) -> Path:
    """A snapshot of another directory's run, step 3, for branches to start from."""
    return fake_snapshot(tmp_path / "parent", 3, Timeline())


def row(directory: Path) -> Holds:
    return survey(directory).holds


def test_the_rows_of_a_directory(tmp_path, parent):
    d = tmp_path / "run"
    d.mkdir()
    assert row(d) == Holds.NOTHING
    mine = Timeline()
    record_timeline(d, mine)
    assert row(d) == Holds.STARTED
    fake_snapshot(d, 1, mine)
    newest = fake_snapshot(d, 3, mine)
    assert row(d) == Holds.SNAPSHOTS and survey(d).newest().path == newest
    truncate(newest)  # its pickle still says whose it is: damaged, and this timeline's
    assert row(d) == Holds.SNAPSHOTS and survey(d).newest().step == 1
    assert [e.step for e in survey(d).candidates] == [3, 1]
    truncate(snapshot_path(d, 1))
    assert row(d) == Holds.DAMAGED
    # A snapshot of another timeline that loads is no snapshot of this one's: it is not resumed, nor counted.
    shutil.rmtree(d)
    d.mkdir()
    record_timeline(d, mine)
    fake_snapshot(d, 5, Timeline())
    assert row(d) == Holds.STARTED and survey(d).newest() is None
    # ...but a damaged one that no longer says whose it is may be this run's newest: never start over then.
    (d / "snapshot_0000007.pt").write_bytes(b"PK\x03\x04" + b"\0" * 26)
    assert row(d) == Holds.DAMAGED


def test_a_timeline_json_this_code_did_not_write_is_refused_naming_it(tmp_path):
    path = tmp_path / "timeline.json"
    older = {"run": "abc", "branched_from": [["xyz", 3]], "resumed_from": None}  # older code's: no init_from
    path.write_text(json.dumps(older))
    assert read_timeline(tmp_path) == Timeline("abc", [["xyz", 3]], None, None)
    for other in ("not JSON", json.dumps(older | {"notes": "mine"}), json.dumps(older | {"resumed_from": 5}),
                  json.dumps(older | {"init_from": ["gpt2"]}), json.dumps({"run": "abc", "branched_from": []}),
                  *(json.dumps(older | {"branched_from": [pair]}) for pair in (["xyz", "3"], [5, 3], ["xyz", 3, 4]))):
        path.write_text(other)
        with pytest.raises(ValueError) as refused:
            read_timeline(tmp_path)
        assert str(refused.value) == (
            f"{path} does not name a timeline as this code writes it (at a run's start, to say which snapshots "
            "--resume auto continues). Move it away to resume the newest snapshot in the directory, whatever run "
            "wrote it."), other


def test_the_rows_of_timelines_started_without_a_snapshot(tmp_path, parent):
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"x")
    record_timeline(tmp_path / "a", Timeline(init_from=str(weights.resolve())))
    assert row(tmp_path / "a") == Holds.STARTED_FROM_WEIGHTS
    branch = Timeline().branch_at(parent, load_snapshot(parent))
    record_timeline(tmp_path / "b", branch)
    assert row(tmp_path / "b") == Holds.STARTED
    parent.rename(tmp_path / "moved.pt")
    assert row(tmp_path / "b") == Holds.ORIGIN_GONE
    (tmp_path / "moved.pt").rename(parent)
    state = load_snapshot(parent)
    save_snapshot(state | {"model": {"w": torch.arange(4096.0)}}, parent)  # (the same snapshot, with a tensor)
    assert row(tmp_path / "b") == Holds.STARTED
    flip_a_byte_in_tensor_data(parent)  # back, but its bytes changed: restarting from it would train other weights
    assert row(tmp_path / "b") == Holds.ORIGIN_GONE
    truncate(parent, keep=0.05)  # no longer loads at all
    assert row(tmp_path / "b") == Holds.ORIGIN_GONE


def test_the_rows_of_snapshots_without_timeline_json(tmp_path):
    older = fake_snapshot(tmp_path, 2, None)  # from before timelines, and flags: its config is {}
    assert row(tmp_path) == Holds.UNRECORDED and survey(tmp_path).newest().path == older
    assert ask("auto", "scratch", survey(tmp_path)) == Asks.AUTO
    truncate(older)
    assert row(tmp_path) == Holds.UNRECORDED_DAMAGED


def test_the_columns_against_what_the_directory_records(tmp_path, parent):
    d = tmp_path / "run"
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"x")
    assert ask("auto", "scratch", survey(d)) == Asks.AUTO
    assert ask("never", str(weights), survey(d)) == Asks.NEVER
    assert ask("auto", str(weights), survey(d)) == Asks.OTHER_INIT
    assert ask(str(parent), "scratch", survey(d)) == Asks.OTHER_PATH
    branch = Timeline().branch_at(parent, load_snapshot(parent))
    record_timeline(d, branch)
    newest = fake_snapshot(d, 5, branch)
    assert ask(str(parent), "scratch", survey(d)) == Asks.SAME  # the branch's own command, again
    assert ask(str(newest), "scratch", survey(d)) == Asks.NEWEST
    assert ask(str(snapshot_path(d, 4)), "scratch", survey(d)) == Asks.OTHER_PATH
    # A copy of the newest kept elsewhere is another snapshot: a branch, not a continuation.
    copy = shutil.copy(newest, tmp_path / newest.name)
    assert ask(str(copy), "scratch", survey(d)) == Asks.OTHER_PATH
    # Without timeline.json: the flags its newest snapshot was written with (a branch's --resume PARENT) say it.
    copied = tmp_path / "copied"
    save_snapshot(load_snapshot(newest) | {"config": {"resume": str(parent), "init_from": "scratch"}},
                  snapshot_path(copied, 5))
    assert ask(str(parent), "scratch", survey(copied)) == Asks.SAME
    save_snapshot(load_snapshot(newest) | {"config": {"resume": "auto", "init_from": str(weights)}},
                  snapshot_path(copied, 6))  # ...or a finetune's --init_from W
    assert ask("auto", str(weights), survey(copied)) == Asks.SAME
    assert ask("auto", "gpt2", survey(copied)) == Asks.OTHER_INIT
    e = tmp_path / "finetune"
    record_timeline(e, Timeline(init_from=str(weights.resolve())))
    assert ask("auto", str(weights), survey(e)) == Asks.SAME
    assert ask("auto", "gpt2", survey(e)) == Asks.OTHER_INIT
    assert ask("auto", "scratch", survey(e)) == Asks.AUTO


def test_a_branch_of_a_branch_keeps_its_whole_ancestry(tmp_path, parent):
    first = Timeline().branch_at(parent, load_snapshot(parent))
    child = fake_snapshot(tmp_path / "b1", 6, first)
    second = Timeline().branch_at(child, load_snapshot(child))
    assert second.branched_from == [[load_snapshot(parent)["timeline"]["run"], 3], [first.run, 6]]
    assert second.resumed_from == str(child.resolve()) and second.run not in (first.run,)


def test_a_damaged_snapshot_is_the_timelines_its_pickle_still_names_file_or_directory(tmp_path):
    d, mine, other = tmp_path / "run", Timeline(), Timeline()
    record_timeline(d, mine)
    truncate(fake_snapshot(d, 5, other))
    (d / "snapshot_0000007").mkdir()  # an fsdp run's directory snapshot, its shards gone: its meta.pt names it
    fake_snapshot(tmp_path, 7, other).rename(d / "snapshot_0000007" / "meta.pt")
    assert [(e.step, e.state, e.run) for e in entries(d)] == [(7, None, other.run), (5, None, other.run)]
    assert row(d) == Holds.STARTED and survey(d).candidates == []  # another timeline's, damaged: not this one's
    (d / "snapshot_0000009").mkdir()
    fake_snapshot(tmp_path, 9, mine).rename(d / "snapshot_0000009" / "meta.pt")
    assert row(d) == Holds.DAMAGED and [e.step for e in survey(d).candidates] == [9]


def test_a_snapshot_that_does_not_load_is_listed_with_why_a_read_error_with_its_file(tmp_path, monkeypatch):
    unreadable, cut = fake_snapshot(tmp_path, 2, None), fake_snapshot(tmp_path, 1, None)
    truncate(cut)
    load = timeline.load_snapshot

    def eio_for_unreadable(path, verify=True):
        if path == unreadable:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return load(path, verify)

    monkeypatch.setattr(timeline, "load_snapshot", eio_for_unreadable)
    with pytest.raises(ValueError) as not_ours:
        load(cut)
    assert [e.problem for e in entries(tmp_path)] == [
        f"{unreadable} (OSError: [Errno {errno.EIO}] {os.strerror(errno.EIO)})", str(not_ours.value)]


def test_a_directory_without_timeline_json_takes_its_newest_snapshots_timeline_or_branches_from_an_older_codes(
        tmp_path, parent):
    first = Timeline().branch_at(parent, load_snapshot(parent))
    fake_snapshot(tmp_path / "copied", 4, first)
    adopted = adopted_timeline(survey(tmp_path / "copied").newest())
    assert (adopted.run, adopted.branched_from) == (first.run, first.branched_from)  # the same line goes on
    older = fake_snapshot(tmp_path / "older", 2, None)  # from before timelines: a branch from it, with no ancestry
    adopted = adopted_timeline(survey(tmp_path / "older").newest())
    assert adopted.branched_from == [] and adopted.resumed_from == str(older.resolve())
    assert Timeline().branch_at(older, load_snapshot(older)).branched_from == []


def test_the_same_weights_named_another_way_are_the_same_origin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("weights.pt").write_bytes(b"x")
    assert origin_of_weights("weights.pt") == str(tmp_path.resolve() / "weights.pt")
    assert origin_of_weights("gpt2") == "gpt2" and origin_of_weights("scratch") is None
    record_timeline(tmp_path / "finetune", Timeline(init_from=origin_of_weights("weights.pt")))
    assert ask("auto", str(tmp_path / "weights.pt"), survey(tmp_path / "finetune")) == Asks.SAME


def test_the_table_as_the_docs_show_it_reads_back_as_the_table():
    """table_markdown() is the docs' table: read back, it is TABLE, every row, column and cell, in order."""
    lines = table_markdown().splitlines()
    cells = [[c.strip().strip("`") for c in line.strip("|").split("|")] for line in lines[:len(Holds) + 2]]
    assert cells[0] == ["holds \\ asks", *(asks.name for asks in Asks)] and set(cells[1]) == {"---"}
    read_back = {Holds[row[0]]: tuple(None if c == "—" else Action[c] for c in row[1:]) for row in cells[2:]}
    assert list(read_back.items()) == list(TABLE.items())
    meanings = [("Rows, what the directory holds:", Holds), ("Columns, what the user asked:", Asks),
                ("Cells, what the run does (—: cannot occur):", Action)]
    assert lines[len(Holds) + 2:] == [line for title, kind in meanings
                                      for line in ("", title, *(f"- `{k.name}`: {k.value}" for k in kind))]


# --- the cells, done: Snapshots.resume() of a one-process tiny run, on real snapshots

def snapshots_in(data: Path, directory: Path, resume: str, init_from: str = "scratch", max_steps: int = 10):
    """The Snapshots of a tiny CPU run with --resume `resume` and --init_from `init_from` (conftest.tiny_snapshots')."""
    tiny = tiny_snapshots(data, directory)
    return Snapshots(str(directory), 1, 2, resume, tiny.trainee, tiny.train_loader,
                     tiny.run_config | {"init_from": init_from, "max_steps": max_steps}, tiny.dist_env, print)


@pytest.fixture
def written(data, tmp_path) -> Snapshots:
    """A run's directory: started afresh, snapshots of steps 2 and 3 (--keep_last 2 pruned 1's)."""
    run = snapshots_in(data, tmp_path / "run", "auto")
    assert run.resume() == (0, None) and not run.continued
    for step in (1, 2, 3):
        run.save_if_due(step, last_step=9, stopping=False)
    assert list_snapshots(tmp_path / "run") == [snapshot_path(tmp_path / "run", s) for s in (3, 2)]
    return run


def test_resume_auto_continues_the_directorys_timeline_and_its_wandb_run(data, written, tmp_path):
    again = snapshots_in(data, tmp_path / "run", "auto")
    assert again.resume() == (4, str(snapshot_path(tmp_path / "run", 3)))
    assert again.continued and again.timeline == written.timeline and again.wandb_id == written.wandb_id
    assert again.resumed_config["max_steps"] == 10 and again.last_saved == 3
    newest = snapshots_in(data, tmp_path / "run", str(snapshot_path(tmp_path / "run", 3)))  # NEWEST: the same
    assert newest.resume()[0] == 4 and newest.continued and newest.timeline == written.timeline


def test_a_branch_is_a_new_timeline_recorded_before_its_first_step_with_its_whole_ancestry(data, written, tmp_path):
    parent = snapshot_path(tmp_path / "run", 2)
    branch = snapshots_in(data, tmp_path / "branch", str(parent))
    assert branch.resume() == (3, str(parent))
    assert branch.timeline.branched_from == [[written.timeline.run, 2]] and not branch.continued
    assert branch.timeline.resumed_from == str(parent.resolve())
    assert branch.wandb_id == branch.timeline.run != written.timeline.run
    assert read_timeline(tmp_path / "branch") == branch.timeline
    # The same command again, before its first snapshot: the branch starts over from its parent, as itself.
    again = snapshots_in(data, tmp_path / "branch", str(parent))
    assert again.resume() == (3, str(parent)) and again.timeline == branch.timeline and not again.continued


def refusal(snapshots: Snapshots) -> str:
    with pytest.raises(UserError) as refused:
        snapshots.resume()
    return str(refused.value)


def test_a_new_run_in_a_directory_that_holds_one_is_refused_saying_how_to_continue_it(data, written, tmp_path):
    run = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    holds = f"--snapshot_dir {run} holds run {written.timeline.run}'s snapshots (newest: snapshot_0000003.pt), and"
    stops = ("one directory holds one run, so this one stops before it reads or writes anything there. To continue "
             "that run, rerun it with --resume auto; to start this one, give it a directory of its own")
    assert refusal(snapshots_in(data, run, "never")) == \
        f"{holds} --resume never starts a new run: {stops} (--log_dir NEW_DIR), or move those files away."
    other = fake_snapshot(tmp_path / "elsewhere", 6, Timeline())
    assert refusal(snapshots_in(data, run, str(other))) == (
        f"{holds} --resume {other} branches a new run from that snapshot: {stops} (--snapshot_dir "
        f"{run / 'branch_0000007'}), or move those files away.")
    assert refusal(snapshots_in(data, run, "auto", init_from="gpt2")).startswith(
        f"{holds} --init_from gpt2 starts a new run from those weights: {stops}")
    flagged = snapshots_in(data, run, "never")
    flagged.run_config["snapshot_dir"] = str(run)  # the directory named by --snapshot_dir: the fix names that flag
    assert refusal(flagged).endswith("a directory of its own (--snapshot_dir NEW_DIR), or move those files away.")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_a_refusal_names_the_command_that_continues_the_directorys_run(data, tmp_path, parent):
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"x")
    started, finetune, branch = Timeline(), Timeline(init_from=str(weights.resolve())), \
        Timeline().branch_at(parent, load_snapshot(parent))
    for name, recorded, again in (("started", started, "--resume auto"),
                                  ("finetune", finetune, f"--resume auto --init_from {weights.resolve()}"),
                                  ("branch", branch, f"--resume {parent.resolve()}")):
        record_timeline(tmp_path / name, recorded)
        assert refusal(snapshots_in(data, tmp_path / name, "never")).startswith(
            f"--snapshot_dir {tmp_path / name} holds run {recorded.run}, stopped before its first snapshot, and "
            "--resume never starts a new run: one directory holds one run, so this one stops before it reads or "
            f"writes anything there. To continue that run, rerun it with {again}; to start this one")


def test_a_run_stopped_before_its_first_snapshot_is_refused_naming_its_origin(data, tmp_path, parent):
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"x")
    record_timeline(tmp_path / "a", Timeline(init_from=str(weights.resolve())))
    assert refusal(snapshots_in(data, tmp_path / "a", "auto")) == (
        f"--snapshot_dir {tmp_path / 'a'} holds a run started with --init_from {weights.resolve()} that was stopped "
        f"before its first snapshot. To start it again, rerun with --init_from {weights.resolve()}; to start another "
        "run, give it a directory of its own (--log_dir NEW_DIR).")
    branch = Timeline().branch_at(parent, load_snapshot(parent))
    record_timeline(tmp_path / "b", branch)
    parent.unlink()
    assert refusal(snapshots_in(data, tmp_path / "b", "auto")) == (
        f"--snapshot_dir {tmp_path / 'b'} holds a run branched from {parent.resolve()}, which is gone or no longer "
        "loads, and the branch was stopped before its first snapshot: there is nothing to continue it from. Put "
        f"{parent.resolve()} back and rerun the same command, or start another run in a directory of its own "
        "(--log_dir NEW_DIR).")


def test_another_timelines_snapshot_stops_a_run_only_at_a_step_it_would_write(data, tmp_path, capsys):
    run = tmp_path / "run"
    record_timeline(run, Timeline())
    fake_snapshot(run, 5, Timeline())  # other timelines', at steps 5 and 6
    fake_snapshot(run, 6, Timeline())
    assert "snapshot_0000005.pt" in refusal(snapshots_in(data, run, "auto", max_steps=6))
    assert not (run / "snapshot_0000000.pt").exists()
    capsys.readouterr()
    assert snapshots_in(data, run, "auto", max_steps=5).resume() == (0, None)  # steps 0-4: not in its way
    assert f"note: {run} also holds snapshots this run's timeline did not write: snapshot_0000006.pt, " \
        "snapshot_0000005.pt. They are left as they are: never resumed by --resume auto, never pruned." in \
        capsys.readouterr().out


def test_a_new_run_records_its_origin_before_its_first_step(data, tmp_path):
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"x")
    for name, init_from, origin in (("finetune", str(weights), str(weights.resolve())), ("fresh", "scratch", None)):
        run = snapshots_in(data, tmp_path / name, "auto", init_from=init_from)
        assert run.resume() == (0, None)
        assert read_timeline(tmp_path / name) == Timeline(run.timeline.run, [], None, origin)


def test_a_timeline_whose_every_own_snapshot_fails_its_checksums_is_refused_naming_them(data, tmp_path, written):
    run = tmp_path / "run"
    changed = {step: flip_a_byte_in_tensor_data(snapshot_path(run, step)) for step in (3, 2)}
    refused = refusal(snapshots_in(data, run, "auto"))
    assert refused.startswith(
        f"--resume auto: none of the 2 snapshots of this run's timeline in {run} loads: {snapshot_path(run, 3)}: the "
        f"bytes of its record {changed[3]} changed since it was written")
    assert refused.endswith("bit flip or a bad copy. Nothing was deleted. Repair or move them away (a copy of a good "
                            "snapshot elsewhere: --resume PATH), or start over with --resume never in a fresh "
                            "--log_dir.")


def test_keep_last_0_is_refused_saying_what_keeps_the_final_weights(data, tmp_path):
    tiny = tiny_snapshots(data, tmp_path / "run")
    with pytest.raises(UserError) as refused:
        Snapshots(str(tmp_path / "run"), 1, 0, "auto", tiny.trainee, tiny.train_loader, tiny.run_config,
                  tiny.dist_env, print)
    assert str(refused.value) == ("--keep_last 0 would delete every snapshot, so nothing could resume. Keep at least 1 "
                                  "(--snapshot_every 0 leaves only the last step's and a stop's snapshots).")


def test_resume_path_and_init_from_together_or_a_missing_path_are_refused_in_words(data, tmp_path, parent):
    both = snapshots_in(data, tmp_path / "run", str(parent), init_from="gpt2")
    assert refusal(both) == (
        f"--resume {parent} and --init_from gpt2 both name the weights to start from. Pass --resume PATH to continue "
        "or branch from a snapshot with its optimizer and data position, or --init_from to start a new run from "
        "weights alone, not both.")
    assert refusal(snapshots_in(data, tmp_path / "run", str(tmp_path / "nowhere.pt"))) == (
        f"--resume {tmp_path / 'nowhere.pt'}: no such file. Pass the path of a snapshot_* file, 'auto' (the newest "
        "valid snapshot in --snapshot_dir) or 'never' (start fresh).")
    assert not (tmp_path / "run").exists()  # refused before it wrote anything


def test_a_timeline_json_that_cannot_be_written_stops_the_run_before_its_first_step(data, tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_store, "record_timeline", failing(errno.ENOSPC))
    assert refusal(snapshots_in(data, tmp_path / "run", "auto")) == (
        f"{tmp_path / 'run' / 'timeline.json'} could not be written (OSError: [Errno {errno.ENOSPC}] "
        f"{os.strerror(errno.ENOSPC)}), so this run stops before its first step. Free space, or point --snapshot_dir "
        "at a directory that can be written.")


def test_the_snapshots_in_a_runs_way_are_named_the_first_four_and_a_damaged_ones_run_as_unknown(data, tmp_path):
    run = tmp_path / "run"
    first = snapshots_in(data, run, "auto")
    first.resume()
    first.save_if_due(1, last_step=9, stopping=False)  # continued from: its steps from 2 on meet the ones below
    for step in (2, 3, 5, 6, 7):
        fake_snapshot(run, step, Timeline())  # other timelines'
    (run / "snapshot_0000004.pt").write_bytes(b"PK\x03\x04" + b"\0" * 26)  # damaged: whose is unknown
    assert refusal(snapshots_in(data, run, "auto", max_steps=8)) == (
        f"--snapshot_dir {run} holds snapshots this run did not write, at steps it will write (snapshot_0000002.pt, "
        "snapshot_0000003.pt, snapshot_0000004.pt (damaged: which run wrote it is unknown), snapshot_0000005.pt, ...): "
        "another run's, or the later snapshots of the timeline this run branched from. Writing over them would "
        "destroy them, so this run stops before its first step. Give it a directory of its own (e.g. --snapshot_dir "
        f"{run / 'branch_0000002'}; the snapshot it resumes from can stay where it is), or move them out of the way.")
    assert "snapshot_0000005.pt, ...): another" in refusal(snapshots_in(data, run, "auto", max_steps=7))  # 5 of them
    assert "snapshot_0000005.pt): another" in refusal(snapshots_in(data, run, "auto", max_steps=6))  # 4: no "..."


# ----------------------------------------------------------------------------------------------------------------
# real runs, with faults (issue 55's cases)

B, T = 2, 16
JOB = ["--micro_batch_size", str(B), "--seq_len", str(T), "--total_batch_size", str(B * T), "--warmup_steps", "2",
       "--max_lr", "1e-3", "--val_every", "0", "--dtype", "fp32", "--max_steps", "10", "--snapshot_every", "2",
       "--keep_last", "2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("run_directory_data")
    make_shards(directory, "train", [4000], vocab=100, tokenizer="bytes")
    make_shards(directory, "val", [500], seed=1, vocab=100, tokenizer="bytes")
    return directory


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory) -> Path:
    """A finished 10-step run, snapshots 1, 3, 5, 7 and 9 (--keep_last 5)."""
    log_dir = tmp_path_factory.mktemp("finished")
    run_train([*JOB, "--data_dir", str(data), "--keep_last", "5"], log_dir)
    return log_dir


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def files(directory: Path) -> dict[str, bytes]:
    """Every file's bytes, but run.lock's (the lock writes its holder there)."""
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file() and p.name != "run.lock"}


def refused(run, *named: str) -> None:
    assert run.proc.returncode == 2, run.output
    assert "Traceback" not in run.output and "error:" in run.proc.stderr
    for name in named:
        assert name in run.proc.stderr, run.proc.stderr


@pytest.mark.slow
def test_init_from_a_snapshot_of_the_directorys_own_run_is_refused_and_deletes_nothing(data, finished, tmp_path):
    run = shutil.copytree(finished, tmp_path / "run")
    before = files(run)
    named = snapshot_path(run, 3)
    result = run_train([*JOB, "--data_dir", str(data), "--init_from", str(named), "--max_steps", "20"], run,
                       check=False)
    refused(result, f"--init_from {named}", "one directory holds one run")
    assert files(run) == before  # the snapshot named, and every other file, as it was


@pytest.mark.slow
def test_resume_never_into_a_finished_runs_directory_is_refused_and_its_metrics_stay_its_own(data, finished,
                                                                                              tmp_path):
    run = shutil.copytree(finished, tmp_path / "run")
    before = files(run)
    refused(run_train([*JOB, "--data_dir", str(data), "--resume", "never", "--max_steps", "6"], run, check=False),
            "--resume never starts a new run")
    assert files(run) == before


@pytest.mark.slow
def test_a_crashed_branch_resumes_by_its_own_command_with_the_uninterrupted_losses(data, finished, tmp_path):
    parent = snapshot_path(finished, 3)
    parent_files = files(finished)
    branch = [*JOB, "--data_dir", str(data), "--resume", str(parent), "--snapshot_every", "1"]
    uninterrupted = run_train([*branch, "--snapshot_dir", str(tmp_path / "ref_snapshots")], tmp_path / "ref")

    logs = tmp_path / "logs"
    command = [*branch, "--snapshot_dir", str(tmp_path / "branch")]
    proc = start_train(command, logs)
    for line in proc.stdout:  # SIGKILL once its snapshot of step 6 is written, as a crash would
        if "snapshot written:" in line and line.strip().endswith("snapshot_0000006.pt"):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    assert proc.wait(timeout=120) == -signal.SIGKILL
    again = run_train(command, logs)  # the identical command: what the README and a SLURM requeue do
    assert "resuming from" in again.output and "snapshot_0000006.pt at step 7" in again.output
    timeline = read_timeline(tmp_path / "branch")
    assert losses(again.records) == losses(uninterrupted.records)  # steps 4-9, the replayed ones at their later values
    assert files(finished) == parent_files
    # Each timeline has its own wandb run: the branch is not the parent's.
    assert load_snapshot(snapshot_path(tmp_path / "branch", 9))["wandb_id"] == timeline.run != \
        load_snapshot(parent)["wandb_id"]


@pytest.mark.slow
def test_a_branch_killed_before_its_first_snapshot_whose_parent_is_gone_is_refused_naming_it(data, finished,
                                                                                               tmp_path):
    parent = shutil.copy(snapshot_path(finished, 3), tmp_path / "parent.pt")
    command = [*JOB, "--data_dir", str(data), "--resume", str(parent), "--snapshot_every", "100"]
    proc = start_train(command, tmp_path / "branch")
    for line in proc.stdout:  # killed at its first step, before any snapshot
        if line.startswith("step     4"):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    assert proc.wait(timeout=120) == -signal.SIGKILL
    Path(parent).rename(tmp_path / "moved.pt")
    for resume in ("auto", str(parent)):  # neither trains from random weights
        result = run_train([*command, "--resume", resume], tmp_path / "branch", check=False)
        refused(result, str(Path(parent).resolve()) if resume == "auto" else f"--resume {parent}")
        assert list_snapshots(tmp_path / "branch") == []


@pytest.mark.slow
def test_a_truncated_newest_snapshot_is_named_and_the_older_one_resumed_and_all_damaged_is_refused(data, finished,
                                                                                                    tmp_path):
    run = shutil.copytree(finished, tmp_path / "run")
    truncate(snapshot_path(run, 9))
    again = run_train([*JOB, "--data_dir", str(data), "--max_steps", "12"], run, check=False)
    assert again.proc.returncode == 0, again.output
    assert "skipping snapshot" in again.proc.stderr and "snapshot_0000009.pt" in again.proc.stderr
    assert "resuming from" in again.output and "snapshot_0000007.pt at step 8" in again.output
    assert load_snapshot(snapshot_path(run, 9))["step"] == 9  # written again by the run it belongs to

    for step in (5, 7, 9, 10, 11):
        truncate(snapshot_path(run, step)) if snapshot_path(run, step).exists() else None
    run_files = files(run)
    for every in ("2", "0"):
        result = run_train([*JOB, "--data_dir", str(data), "--max_steps", "12", "--snapshot_every", every], run,
                           check=False)
        refused(result, "snapshot_0000011.pt", "none of the")
        assert files(run) == run_files  # nothing deleted, nothing trained from scratch


@pytest.mark.slow
def test_snapshot_every_0_still_leaves_the_final_weights(data, tmp_path):
    run_train([*JOB, "--data_dir", str(data), "--snapshot_every", "0", "--max_steps", "3"], tmp_path)
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, 2)]


@pytest.mark.slow
def test_a_snapshot_pruning_cannot_delete_is_a_warning_and_training_goes_on(data, tmp_path):
    """A real undeletable file: a snapshot bind-mounted onto itself, which unlink refuses (EBUSY) as root."""
    first = run_train([*JOB, "--data_dir", str(data), "--max_steps", "2", "--snapshot_every", "1"], tmp_path)
    stuck = snapshot_path(tmp_path, 0)
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(stuck), str(stuck)]).returncode != 0:
        pytest.skip("needs root and mount(8) to make a file that cannot be deleted (a bind mount onto itself)")
    try:
        before = stuck.read_bytes()
        result = run_train([*JOB, "--data_dir", str(data), "--max_steps", "6", "--snapshot_every", "1"], tmp_path,
                           check=False)
        assert result.proc.returncode == 0, result.output
        assert f"could not delete {stuck}" in result.proc.stderr and "Traceback" not in result.output
        assert list_snapshots(tmp_path)[:2] == [snapshot_path(tmp_path, 5), snapshot_path(tmp_path, 4)]
        assert stuck.read_bytes() == before and len(first.train) == 2
    finally:
        subprocess.run(["umount", str(stuck)], check=True)


@pytest.mark.slow
def test_a_branch_has_its_own_metrics_and_wandb_id_even_with_its_parents_log_dir(data, finished, tmp_path):
    logs = shutil.copytree(finished, tmp_path / "logs")
    parent_metrics = (logs / "metrics.jsonl").read_bytes()
    run_train([*JOB, "--data_dir", str(data), "--resume", str(snapshot_path(logs, 5)), "--snapshot_dir",
               str(logs / "branch_0000006")], logs)
    assert (logs / "metrics.jsonl").read_bytes() == parent_metrics
    branch = read_timeline(logs / "branch_0000006")
    own = read_metrics(logs)  # (metrics.jsonl: the parent's)
    assert own and all(r.get("step", 0) <= 9 for r in own)
    records = [json.loads(line) for line in (logs / f"metrics_{branch.run}.jsonl").read_text().splitlines()]
    assert sorted(losses(records)) == [6, 7, 8, 9]

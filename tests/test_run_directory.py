"""The state table (rundir/store.py): what a run does with its --snapshot_dir, decided in one place, and the docs.

The fast tests build each row of the table with a real run's Snapshots (a tiny model in this process, snapshots
written as train_gpt2.py writes them), ask it each column's flags and check that what it does is the cell's action;
then the refusals' words. The slow ones run train_gpt2.py for real, with faults.
"""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, failing, flip_a_byte_in_tensor_data, make_shards, tiny_snapshots
from helpers_train import read_metrics, run_train, start_train
from rundir import store
from rundir.snapshot import list_snapshots, load_snapshot, snapshot_path
from rundir.store import RUN_FILE, TABLE, Action, Asks, Holds, Run, Snapshots, decide, read_run, table_markdown
from training.errors import UserError


def test_the_docs_show_the_table_the_code_decides_from():
    assert table_markdown() in (ROOT / "docs" / "reliability.md").read_text()


def test_the_table_as_printed_reads_back_as_the_table_every_cell_an_action():
    lines = table_markdown().splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0] == ["`--snapshot_dir` holds", *(asks.value for asks in Asks)] and set(cells[1]) == {"---"}
    by_words = {action.value: action for action in Action}
    assert {Holds(row[0]): tuple(by_words[c] for c in row[1:]) for row in cells[2:]} == TABLE
    assert list(TABLE) == list(Holds) and len(lines) == 2 + len(Holds)
    # A directory that records a run never starts a new one; one whose snapshots all fail never starts over.
    assert all(Action.START not in TABLE[holds] for holds in Holds if holds is not Holds.EMPTY)
    assert all(decide(holds, Asks.NEW) is Action.REFUSE_TAKEN for holds in Holds if holds is not Holds.EMPTY)


# ----------------------------------------------------------------------------------------------------------------
# every cell, done by a run's Snapshots

def snapshots_in(data: Path, directory: Path, resume: str, init_from: str = "scratch", max_steps: int = 10):
    """The Snapshots of a tiny CPU run with --resume `resume` and --init_from `init_from` (conftest.tiny_snapshots')."""
    tiny = tiny_snapshots(data, directory)
    return Snapshots(str(directory), 1, 2, resume, tiny.trainee, tiny.train_loader,
                     tiny.run_config | {"init_from": init_from, "max_steps": max_steps}, tiny.dist_env, print)


def truncate(path: Path, keep: float = 0.6) -> None:
    """Cut a snapshot short, as a full disk or a bad copy does."""
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


@pytest.fixture
def parent(data, tmp_path) -> Path:
    """Another directory's run and its snapshot of step 3, for branches to start from."""
    run = snapshots_in(data, tmp_path / "parent", "auto")
    run.resume()
    run.save_if_due(3, last_step=9, stopping=False)
    return snapshot_path(tmp_path / "parent", 3)


@pytest.fixture
def weights(tmp_path) -> Path:
    """A file named by --init_from (the Snapshots record it; the model built from it is train_gpt2's)."""
    (tmp_path / "weights.pt").write_bytes(b"weights")
    return tmp_path / "weights.pt"


def build_row(holds: Holds, data: Path, directory: Path, parent: Path, weights: Path) -> dict[Asks, tuple[str, str]]:
    """A directory that holds `holds`, made by a run as train_gpt2.py makes it; returns the --resume and --init_from
    that ask each column of it."""
    origin = (str(parent), "scratch")
    if holds in (Holds.SNAPSHOTS, Holds.DAMAGED, Holds.NOT_STARTED_INIT):
        origin = ("auto", str(weights))
    elif holds is Holds.ORIGIN_LOST:
        origin = (str(shutil.copy(parent, directory.parent / "lost.pt")), "scratch")
    if holds is not Holds.EMPTY:
        run = snapshots_in(data, directory, *origin)
        run.resume()
        if holds in (Holds.SNAPSHOTS, Holds.DAMAGED):
            for step in (1, 2):
                run.save_if_due(step, last_step=9, stopping=False)
        if holds is Holds.DAMAGED:
            for path in list_snapshots(directory):
                truncate(path)
        if holds is Holds.ORIGIN_LOST:
            Path(origin[0]).unlink()
    return {Asks.AUTO: ("auto", "scratch"), Asks.ORIGIN: origin, Asks.NEW: ("never", "scratch")}


def what_it_did(snapshots: Snapshots, before: Run | None) -> Action:
    """The action a resume() did, read from what it returned, raised and recorded."""
    try:
        snapshots.resume()
    except UserError as e:
        words = {"one directory holds one run": Action.REFUSE_TAKEN, "none of the": Action.REFUSE_DAMAGED,
                 "rerun with --init_from": Action.REFUSE_INIT, "which is gone or no longer loads": Action.REFUSE_LOST}
        return next(action for said, action in words.items() if said in str(e))
    if snapshots.continued:
        return Action.CONTINUE
    return Action.RESTART if before is not None and before.run == snapshots.run else Action.START


@pytest.mark.parametrize("asks", Asks)
@pytest.mark.parametrize("holds", Holds)
def test_each_cell_is_what_a_run_does(data, tmp_path, parent, weights, holds, asks):
    directory = tmp_path / "run"
    resume, init_from = build_row(holds, data, directory, parent, weights)[asks]
    before = read_run(directory) if (directory / RUN_FILE).exists() else None
    assert what_it_did(snapshots_in(data, directory, resume, init_from), before) is decide(holds, asks)


def test_a_start_again_keeps_the_run_and_restores_its_origin(data, tmp_path, parent):
    first = snapshots_in(data, tmp_path / "branch", str(parent))
    assert first.resume() == (4, str(parent))
    assert read_run(tmp_path / "branch") == Run(first.run, None, "../parent/snapshot_0000003.pt")
    again = snapshots_in(data, tmp_path / "branch", "auto")  # its own command would do the same
    assert again.resume() == (4, str(parent.resolve())) and again.run == first.run and not again.continued


def test_resume_auto_continues_the_directorys_run_and_its_wandb_run(data, tmp_path):
    run = snapshots_in(data, tmp_path / "run", "auto")
    assert run.resume() == (0, None) and not run.continued
    for step in (1, 2, 3):
        run.save_if_due(step, last_step=9, stopping=False)
    assert list_snapshots(tmp_path / "run") == [snapshot_path(tmp_path / "run", s) for s in (3, 2)]  # --keep_last 2
    again = snapshots_in(data, tmp_path / "run", "auto")
    assert again.resume() == (4, str(snapshot_path(tmp_path / "run", 3)))
    assert again.continued and again.run == run.run == load_snapshot(snapshot_path(tmp_path / "run", 3))["wandb_id"]
    assert again.resumed_config["max_steps"] == 10 and again.last_saved == 3


# ----------------------------------------------------------------------------------------------------------------
# the refusals' words, naming the paths as they are now

@pytest.fixture
def written(data, tmp_path) -> Snapshots:
    """A run's directory: started afresh, snapshots of steps 2 and 3."""
    run = snapshots_in(data, tmp_path / "run", "auto")
    run.resume()
    for step in (2, 3):
        run.save_if_due(step, last_step=9, stopping=False)
    return run


def refusal(snapshots: Snapshots) -> str:
    with pytest.raises(UserError) as refused:
        snapshots.resume()
    return str(refused.value)


def test_a_new_run_in_a_directory_that_holds_one_is_refused_saying_how_to_continue_it(data, written, tmp_path,
                                                                                         parent):
    run = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    holds = f"--snapshot_dir {run} holds run {written.run}'s snapshots (newest: snapshot_0000003.pt), and"
    stops = ("one directory holds one run, so this one stops before it reads or writes anything there. To continue "
             "that run, rerun it with --resume auto; to start this one, give it a directory of its own")
    assert refusal(snapshots_in(data, run, "never")) == \
        f"{holds} --resume never starts a new run: {stops} (--log_dir NEW_DIR), or move those files away."
    assert refusal(snapshots_in(data, run, str(parent))) == (
        f"{holds} --resume {parent} branches a new run from that snapshot: {stops} (--snapshot_dir "
        f"{run}/branch_0000004), or move those files away.")
    assert refusal(snapshots_in(data, run, "auto", init_from="gpt2")).startswith(
        f"{holds} --init_from gpt2 starts a new run from those weights: {stops}")
    flagged = snapshots_in(data, run, "never")
    flagged.run_config["snapshot_dir"] = str(run)  # the directory named by --snapshot_dir: the fix names that flag
    assert refusal(flagged).endswith("a directory of its own (--snapshot_dir NEW_DIR), or move those files away.")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_a_refusal_names_the_command_that_continues_the_directorys_run(data, tmp_path, parent, weights):
    for name, resume, init_from, again in (("started", "auto", "scratch", "--resume auto"),
                                           ("finetune", "auto", str(weights), f"--resume auto --init_from {weights}"),
                                           ("branch", str(parent), "scratch", f"--resume {parent}")):
        first = snapshots_in(data, tmp_path / name, resume, init_from)
        first.resume()
        assert refusal(snapshots_in(data, tmp_path / name, "never")).startswith(
            f"--snapshot_dir {tmp_path / name} holds run {first.run}, stopped before its first snapshot, and "
            "--resume never starts a new run: one directory holds one run, so this one stops before it reads or "
            f"writes anything there. To continue that run, rerun it with {again}; to start this one")


def test_a_run_stopped_before_its_first_snapshot_is_refused_naming_its_origin_where_it_is_now(data, tmp_path, parent,
                                                                                           weights):
    snapshots_in(data, tmp_path / "a", "auto", str(weights)).resume()
    assert refusal(snapshots_in(data, tmp_path / "a", "auto")) == (
        f"--snapshot_dir {tmp_path / 'a'} holds a run started with --init_from {weights} that was stopped before its "
        f"first snapshot. To start it again, rerun with --init_from {weights}; to start another run, give it a "
        "directory of its own (--log_dir NEW_DIR).")
    # A branch and its parent moved together: the parent is found where it is now, and named so.
    snapshots_in(data, tmp_path / "parent" / "branch", str(parent)).resume()
    moved = tmp_path.rename(tmp_path.with_name(tmp_path.name + "_moved")) / "parent"
    assert snapshots_in(data, moved / "branch", "auto").resume()[1] == str(moved / parent.name)
    (moved / parent.name).unlink()
    assert refusal(snapshots_in(data, moved / "branch", "auto")) == (
        f"--snapshot_dir {moved / 'branch'} holds a run branched from {moved / parent.name}, which is gone or no "
        "longer loads, and the branch was stopped before its first snapshot: there is nothing to continue it from. "
        f"Put {moved / parent.name} back and rerun the same command, or start another run in a directory of its own "
        "(--log_dir NEW_DIR).")


def test_another_runs_snapshot_stops_a_run_only_at_a_step_it_would_write(data, tmp_path, capsys, written):
    run = tmp_path / "other_runs"
    for step in (2, 3):  # written's, copied with their .json
        for path in (snapshot_path(tmp_path / "run", step), store.sidecar(snapshot_path(tmp_path / "run", step))):
            shutil.copy(path, run / path.name) if run.exists() else (run.mkdir(), shutil.copy(path, run))
    (run / "snapshot_0000005.pt").write_bytes(b"no .json beside it: whose it is is unknown")
    assert refusal(snapshots_in(data, run, "auto", max_steps=6)) == (
        f"--snapshot_dir {run} holds snapshots this run did not write, at steps it will write (snapshot_0000005.pt, "
        "snapshot_0000003.pt, snapshot_0000002.pt): another run's, or without the .json that says whose. Writing "
        "over them would destroy them, so this run stops before its first step. Give it a directory of its own (e.g. "
        f"--snapshot_dir {run}/branch_0000000), or move them out of the way.")
    assert not (run / RUN_FILE).exists()
    capsys.readouterr()
    assert snapshots_in(data, run, "auto", max_steps=2).resume() == (0, None)  # steps 0-1: not in its way
    assert f"note: {run} also holds snapshots this run did not write: snapshot_0000005.pt, snapshot_0000003.pt, " \
        "snapshot_0000002.pt. They are left as they are: never resumed by --resume auto, never pruned." in \
        capsys.readouterr().out
    for step in (6, 7):
        snapshot_path(run, step).write_bytes(b"whose?")
    names = [f"snapshot_000000{step}.pt" for step in (7, 6, 5, 3, 2)]  # four in the way of 7 steps, five of 8
    assert f"at steps it will write ({', '.join(names[1:])}): another" in \
        refusal(snapshots_in(data, run, "auto", max_steps=7))
    assert f"at steps it will write ({', '.join(names[:4])}, ...): another" in \
        refusal(snapshots_in(data, run, "auto", max_steps=8))


def test_a_snapshot_whose_json_is_damaged_is_the_directorys_runs_and_damaged(data, written, tmp_path, capsys):
    store.sidecar(snapshot_path(tmp_path / "run", 3)).write_text('{"format": 1, "run": ')
    again = snapshots_in(data, tmp_path / "run", "auto")
    assert again.resume() == (3, str(snapshot_path(tmp_path / "run", 2))) and again.run == written.run
    assert f"skipping snapshot: {store.sidecar(snapshot_path(tmp_path / 'run', 3))} could not be read" in \
        capsys.readouterr().err


def test_records_of_another_format_are_refused_naming_it_and_left_as_they_are(data, written, tmp_path):
    path = tmp_path / "run" / RUN_FILE
    path.write_text(json.dumps({"format": 2, "run": written.run, "init_from": None, "resumed_from": None}))
    assert refusal(snapshots_in(data, tmp_path / "run", "auto")).startswith(
        f"--resume auto: {path} is of format 2, written by another version of train_gpt2.py; this one reads format 1. "
        "Use the version that wrote it, or another directory. Nothing was deleted.")
    for other in ("not JSON", json.dumps({"format": 1, "run": 5, "init_from": None, "resumed_from": None}),
                  json.dumps({"run": "abc", "branched_from": [], "resumed_from": None})):  # (an older timeline.json)
        path.write_text(other)
        assert f"{path} " in refusal(snapshots_in(data, tmp_path / "run", "auto")) and path.read_text() == other
    # A snapshot of another format: named, skipped, never changed.
    snapshot = snapshot_path(tmp_path / "run", 3)
    path.write_text(json.dumps({"format": 1, "run": written.run, "init_from": None, "resumed_from": None}))
    torch_state = load_snapshot(snapshot) | {"format": 0}
    store.snapshot.save_snapshot(torch_state, snapshot)
    with pytest.raises(ValueError, match=re.escape(f"{snapshot} is a snapshot of format 0, written by another "
                                                   "version of train_gpt2.py; this one reads format 1.")):
        load_snapshot(snapshot)
    assert snapshots_in(data, tmp_path / "run", "auto").resume()[0] == 3


def test_a_run_whose_every_own_snapshot_fails_its_checksums_is_refused_naming_them(data, tmp_path, written):
    run = tmp_path / "run"
    changed = {step: flip_a_byte_in_tensor_data(snapshot_path(run, step)) for step in (3, 2)}
    refused = refusal(snapshots_in(data, run, "auto"))
    assert refused.startswith(
        f"--resume auto: none of the 2 snapshots of run {written.run} in {run} loads: {snapshot_path(run, 3)}: the "
        f"bytes of its record {changed[3]} changed since it was written")
    assert refused.endswith("bit flip or a bad copy. Nothing was deleted. Repair or move them away (a copy of a good "
                            "snapshot elsewhere: --resume PATH), or start over with --resume never in a fresh "
                            "--log_dir.")


def test_a_run_from_a_hugging_face_model_records_its_name_as_given(data, tmp_path):
    snapshots_in(data, tmp_path / "run", "auto", init_from="gpt2").resume()
    assert read_run(tmp_path / "run") == Run(read_run(tmp_path / "run").run, "gpt2", None)


def test_a_missing_resume_path_is_refused_in_words(data, tmp_path):
    # (--resume PATH with --init_from: refused at the door, tests/test_clean_errors.py)
    assert refusal(snapshots_in(data, tmp_path / "run", str(tmp_path / "nowhere.pt"))) == (
        f"--resume {tmp_path / 'nowhere.pt'}: no such file. Pass the path of a snapshot_* file, 'auto' (the newest "
        "valid snapshot in --snapshot_dir) or 'never' (start fresh).")
    assert not (tmp_path / "run").exists()  # refused before it wrote anything


def test_a_run_json_that_cannot_be_written_stops_the_run_before_its_first_step(data, tmp_path, monkeypatch):
    monkeypatch.setattr(store, "write_record", failing(errno.ENOSPC))
    assert refusal(snapshots_in(data, tmp_path / "run", "auto")) == (
        f"{tmp_path / 'run' / RUN_FILE} could not be written (OSError: [Errno {errno.ENOSPC}] "
        f"{os.strerror(errno.ENOSPC)}), so this run stops before its first step. Free space, or point --snapshot_dir "
        "at a directory that can be written.")


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
    # A branch continues its parent exactly (the same flags and data): the uninterrupted losses are finished's.
    uninterrupted = {step: loss for step, loss in losses(read_metrics(finished)).items() if step > 3}

    logs = tmp_path / "logs"
    command = [*JOB, "--data_dir", str(data), "--resume", str(parent), "--snapshot_every", "1", "--snapshot_dir",
               str(tmp_path / "branch")]
    proc = start_train(command, logs)
    for line in proc.stdout:  # SIGKILL once its snapshot of step 6 is written, as a crash would
        if "snapshot written:" in line and line.strip().endswith("snapshot_0000006.pt"):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    assert proc.wait(timeout=120) == -signal.SIGKILL
    again = run_train(command, logs)  # the identical command: what the README and a SLURM requeue do
    assert "resuming from" in again.output and "snapshot_0000006.pt at step 7" in again.output
    recorded = read_run(tmp_path / "branch")
    # steps 4-9, the replayed ones at their later values
    assert losses(again.records) == uninterrupted and sorted(uninterrupted) == list(range(4, 10))
    assert files(finished) == parent_files
    # Each run has its own wandb run: the branch is not the parent's.
    assert load_snapshot(snapshot_path(tmp_path / "branch", 9))["wandb_id"] == recorded.run != \
        load_snapshot(parent)["wandb_id"]


@pytest.mark.slow
def killed_at_its_first_step(command: list[str], log_dir: Path, first_step: int) -> None:
    """Run train_gpt2.py and SIGKILL it once it has trained its first step, before any snapshot."""
    proc = start_train(command, log_dir)
    for line in proc.stdout:
        if line.startswith(f"step {first_step:5d}"):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    assert proc.wait(timeout=120) == -signal.SIGKILL and (log_dir / RUN_FILE).exists()


@pytest.mark.slow
def test_a_branch_killed_before_its_first_snapshot_whose_parent_is_gone_is_refused_naming_it(data, finished,
                                                                                               tmp_path):
    parent = shutil.copy(snapshot_path(finished, 3), tmp_path / "parent.pt")
    command = [*JOB, "--data_dir", str(data), "--resume", str(parent), "--snapshot_every", "100"]
    killed_at_its_first_step(command, tmp_path / "branch", 4)
    Path(parent).rename(tmp_path / "moved.pt")
    for resume in ("auto", str(parent)):  # neither trains from random weights
        result = run_train([*command, "--resume", resume], tmp_path / "branch", check=False)
        refused(result, f"holds a run branched from {Path(parent).resolve()}, which is gone or no longer loads")
        assert list_snapshots(tmp_path / "branch") == []


@pytest.mark.slow
def test_an_init_from_run_killed_before_its_first_snapshot_is_refused_without_it_naming_the_flag(data, finished,
                                                                                                 tmp_path):
    weights = snapshot_path(finished, 3)
    killed_at_its_first_step([*JOB, "--data_dir", str(data), "--init_from", str(weights)], tmp_path, 0)
    result = run_train([*JOB, "--data_dir", str(data)], tmp_path, check=False)  # the flag forgotten
    refused(result, f"To start it again, rerun with --init_from {weights}")
    assert list_snapshots(tmp_path) == []  # never a fresh start from random weights
    again = run_train([*JOB, "--data_dir", str(data), "--init_from", str(weights), "--max_steps", "2"], tmp_path)
    assert sorted(losses(again.records)) == [0, 1]


@pytest.mark.slow
def test_a_moved_directory_holding_a_killed_branch_is_continued_by_the_advice_as_given(data, finished, tmp_path):
    logs = shutil.copytree(finished, tmp_path / "logs")
    command = [*JOB, "--data_dir", str(data), "--resume", str(snapshot_path(logs, 3)), "--snapshot_every", "100"]
    killed_at_its_first_step([*command, "--snapshot_dir", str(logs / "branch")], logs, 4)
    moved = logs.rename(tmp_path / "moved")
    result = run_train([*JOB, "--data_dir", str(data), "--resume", "never", "--snapshot_dir",
                        str(moved / "branch")], moved, check=False)
    advice = f"To continue that run, rerun it with --resume {snapshot_path(moved, 3).resolve()};"
    refused(result, advice)
    assert str(logs) not in result.proc.stderr  # no path that is gone
    resumed = run_train([*JOB, "--data_dir", str(data), "--resume", str(snapshot_path(moved, 3).resolve()),
                         "--snapshot_dir", str(moved / "branch")], moved)  # the advice, followed literally
    assert sorted(losses(resumed.records))[-1] == 9 and list_snapshots(moved / "branch")


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
    branch = read_run(logs / "branch_0000006")
    own = read_metrics(logs)  # (metrics.jsonl: the parent's)
    assert own and all(r.get("step", 0) <= 9 for r in own)
    records = [json.loads(line) for line in (logs / f"metrics_{branch.run}.jsonl").read_text().splitlines()]
    assert sorted(losses(records)) == [6, 7, 8, 9]

"""Faults from outside the run's code, injected for real: output directories that cannot be written (a file in the
way, a read-only mount), a full --log_dir disk, Ctrl-C at any point of a run (under torchrun too), and a shard
truncated under a running job. Each ends in a clean stop or one paragraph and exit 2, never a traceback, with the
run's snapshots and every file it did not write intact.

Runs that must be real processes (a signal, a SIGBUS, an exit status) run tests/train_with_pauses.py, which waits at
a chosen call until the test has acted: the signal lands at a known point of the run, not at a guessed moment.
"""

import os
import re
import signal
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

import train_gpt2
from conftest import fill_up, make_shards, mounted_tmpfs
from dataloader import HEADER_BYTES, DistributedDataLoader, write_shard
from helpers_train import go_on, main_in_process, read_metrics, start_paused, start_train, wait_for_pause, wait_train
from model import GPT
from rundir import snapshot
from rundir.lock import LOCK_FILE
from rundir.snapshot import list_snapshots, load_snapshot, snapshot_path
from training.errors import UserError

JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--warmup_steps", "1",
       "--val_every", "0", "--dtype", "fp32", "--no-shuffle"]  # 2 micro-steps of 32 tokens a step on 1 rank
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("data")
    # The bytes tokenizer's shards: a model 257 ids wide, not GPT-2's 50,257, is several times cheaper a step.
    make_shards(data, "train", [600, 600], seed=0, vocab=257, tokenizer="bytes")  # 9 steps each
    make_shards(data, "val", [17 * 32 + 1], seed=1, vocab=257, tokenizer="bytes")  # 17 validation batches of 32 tokens
    return data


def contents(directory: Path) -> dict[str, bytes | None]:
    """Every entry under directory and its bytes (None: not a regular file): what any write would change."""
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() and not p.is_symlink() else None
            for p in sorted(directory.rglob("*"))}


def no_model_built(monkeypatch) -> None:
    monkeypatch.setattr("train_gpt2.build_training_model", lambda *args, **kwargs: pytest.fail("built a model"))


# ----------------------------------------------------------------------------------------------------------------
# output directories that cannot be written: exit 2 before the model is built

def file_in_the_way(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"someone's file\n")
    return path


# case -> (flag, the directory to pass given tmp_path and an ExitStack for mounts, what the error says stands in
# the way given that directory)
UNWRITABLE = {
    "--snapshot_dir is a file": ("--snapshot_dir", lambda tmp, mounts: file_in_the_way(tmp / "snapshots"),
                                 lambda d: f"{d} is a file, not a directory"),
    "--log_dir is a file": ("--log_dir", lambda tmp, mounts: file_in_the_way(tmp / "logs"),
                            lambda d: f"{d} is a file, not a directory"),
    "--snapshot_dir under a file": ("--snapshot_dir", lambda tmp, mounts: file_in_the_way(tmp / "file") / "snapshots",
                                    lambda d: f"{d.parent} is a file, not a directory"),
    "--log_dir on a read-only mount": ("--log_dir", lambda tmp, mounts: mounts.enter_context(
        mounted_tmpfs(tmp / "read_only", "ro")), lambda d: "OSError: Read-only file system"),
    "--snapshot_dir to be made on a read-only mount": ("--snapshot_dir", lambda tmp, mounts: mounts.enter_context(
        mounted_tmpfs(tmp / "read_only", "ro")) / "snapshots", lambda d: "OSError: Read-only file system"),
}


@pytest.mark.parametrize("case", UNWRITABLE)
def test_an_output_directory_that_cannot_be_written_stops_the_run_before_it_builds_anything(data, tmp_path,
                                                                                            monkeypatch, case):
    flag, make, in_the_way = UNWRITABLE[case]
    with ExitStack() as mounts:
        directory = make(tmp_path, mounts)
        directories = {"--log_dir": tmp_path / "logs", "--snapshot_dir": tmp_path / "snapshots"} | {flag: directory}
        if not directories["--log_dir"].exists():
            directories["--log_dir"].mkdir()
        before = contents(tmp_path)
        no_model_built(monkeypatch)
        with pytest.raises(UserError, match=re.escape(f"{flag} {directory} cannot be written "
                                                      f"({in_the_way(directory)}), so the run would train and lose "
                                                      "every snapshot")):
            main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "2",
                             *(str(arg) for pair in directories.items() for arg in pair)])
        # Only the lock of a directory that could be written was added (and is free again); nothing else changed.
        after = contents(tmp_path)
        assert {name: value for name, value in after.items() if not name.endswith(LOCK_FILE)} == before


# ----------------------------------------------------------------------------------------------------------------
# a full --log_dir disk

@pytest.mark.parametrize("inodes", [False, True], ids=["no byte left", "no byte nor inode left"])
def test_a_full_log_disk_does_not_change_the_exit_of_a_run_whose_snapshots_were_written(data, tmp_path, capsys,
                                                                                        inodes):
    log_dir, snapshot_dir = tmp_path / "full", tmp_path / "snapshots"
    # With no inode left, not even an empty file can be made: a rerun on the disk that filled up (its run.lock left
    # by the earlier run).
    with mounted_tmpfs(log_dir, "size=1m" + (",nr_inodes=3" if inodes else "")):
        if inodes:
            (log_dir / LOCK_FILE).write_text("pid 4242 on host node7, since 2025-06-01 10:00:00 UTC\n")
        fill_up(log_dir)  # to the last byte: not even run.lock's holder line fits
        main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "2", "--log_dir", str(log_dir),
                         "--snapshot_dir", str(snapshot_dir)])
        # The holder line did not fit, and nothing was left to flush at the end (an earlier run's run.lock has
        # the page for it).
        holder = (log_dir / LOCK_FILE).read_bytes()
        assert holder.startswith(f"pid {os.getpid()} on host ".encode()) if inodes else holder == b""
        assert not read_metrics(log_dir)
    warnings = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in warnings] == (
        [f"WARNING: --log_dir {log_dir}: the disk is full"] if inodes else []) + [
        f"WARNING: could not write {log_dir}/metrics.jsonl"]
    assert "No space left on device" in warnings[-1]
    assert [load_snapshot(path)["step"] for path in list_snapshots(snapshot_dir)] == [1]


def test_a_full_disk_under_both_flags_is_exit_2_before_the_first_step_never_a_traceback(data, tmp_path):
    directory = tmp_path / "full"
    with mounted_tmpfs(directory, "size=1m"):
        fill_up(directory)
        before = contents(directory)
        # Full before the first step: the run's run.json (a few hundred bytes) cannot be written, and the run
        # stops there, before it trains steps whose snapshots could not be kept either.
        with pytest.raises(UserError, match=r"full/run.json could not be written \(OSError: \[Errno 28\] No "
                                            r"space left on device\), so this run stops before its first step"):
            main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "2", "--log_dir", str(directory)])
        assert set(contents(directory)) == set(before) | {LOCK_FILE}  # no temp file left


@pytest.mark.slow  # a process (for its exit status and all of its stderr), with wandb
def test_a_full_log_disk_with_wandb_exits_0_with_two_warnings(data, tmp_path):
    log_dir, snapshot_dir = tmp_path / "full", tmp_path / "snapshots"
    offline = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false"}
    with mounted_tmpfs(log_dir, "size=1m"):
        fill_up(log_dir)
        run = wait_train(start_train([*JOB, "--data_dir", str(data), "--max_steps", "3", "--snapshot_dir",
                                      str(snapshot_dir), "--wandb_project", "test", "--wandb_mode", "offline"],
                                     log_dir, env=offline), log_dir, timeout=300)
    # wandb's own log files under <log_dir>/wandb cannot be written either: it stops with one warning, and its
    # logging prints no traceback per record it cannot write.
    assert run.proc.stderr.splitlines() == [
        f"WARNING: could not write {log_dir}/metrics.jsonl (OSError: [Errno 28] No space left on device; 0 MiB "
        "free). Training goes on; its numbers are on stdout (and wandb, if on), and later lines are written once "
        "there is room. This warning is not repeated.",
        "WARNING: wandb stopped working (OSError: [Errno 28] No space left on device). Training goes on; its "
        f"numbers go to {log_dir}/metrics.jsonl only, wandb is off for the rest of this run."]
    assert load_snapshot(snapshot_path(snapshot_dir, 2))["step"] == 2


# ----------------------------------------------------------------------------------------------------------------
# Ctrl-C: the first SIGINT stops the run as SIGTERM does, a second aborts at once

@pytest.fixture
def sigint_kept_from_pytest():
    """A SIGINT that the code under test fails to handle (a regression) is recorded here instead of interrupting
    the whole test session; the run's own handlers replace this one while it runs."""
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGINT, previous)


def sigint_before(monkeypatch, owner, name: str, calls: set[int]) -> None:
    """A real SIGINT to this process before the given calls of owner.name (counted from 1)."""
    real, counted = getattr(owner, name), []

    def call(*args, **kwargs):
        counted.append(None)
        if len(counted) in calls:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, call)


# where -> (the call to signal the run before, its flags, the stop message's where, the step of its snapshot)
CTRL_C = {
    "while it starts": ((train_gpt2, "initial_model", 1), [], "before step 0", None),
    "while it reads a step's data": ((DistributedDataLoader, "read_ahead", 2), [], "after step 0", 0),
    "in a step": ((GPT, "forward", 3), [], "after step 1", 1),  # (2 micro-steps a step)
    # (an evaluation looks for a stop request every 16 batches)
    "in an evaluation": ((train_gpt2, "validation_loss", 2), ["--val_every", "2", "--val_tokens", str(17 * 32)],
                         "during the evaluation before step 2", 1),
}


@pytest.mark.parametrize("where", [pytest.param(w, marks=pytest.mark.slow) if w == "in an evaluation" else w
                                   for w in CTRL_C])  # (the first evaluation loads the tokenizer: seconds)
def test_ctrl_c_stops_the_run_between_steps_with_a_snapshot_as_sigterm_does(data, tmp_path, monkeypatch, capsys,
                                                                           sigint_kept_from_pytest, where):
    (owner, name, call), flags, stopped, step = CTRL_C[where]
    sigint_before(monkeypatch, owner, name, {call})
    main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "20", "--snapshot_every", "100", "--log_dir",
                     str(tmp_path), *flags])
    assert not sigint_kept_from_pytest
    assert f"stopping {stopped} on SIGINT; rerun the same command to resume" in capsys.readouterr().out
    assert list_snapshots(tmp_path) == ([snapshot_path(tmp_path, step)] if step is not None else [])
    trained = [r["step"] for r in read_metrics(tmp_path) if "loss" in r]
    assert max(trained, default=None) == step  # trained up to the snapshot, no further
    if step is not None:
        assert load_snapshot(snapshot_path(tmp_path, step))["loader"]["chunk_position"] == 2 * (step + 1)


def test_a_second_ctrl_c_during_the_snapshot_write_aborts_at_once_leaving_no_part_of_it(data, tmp_path, monkeypatch,
                                                                                       sigint_kept_from_pytest):
    # --snapshot_every 1: the first Ctrl-C in step 1, the second while step 1's snapshot (the 2nd) is written.
    sigint_before(monkeypatch, GPT, "forward", {3})
    temp_files = []
    sigint_before(monkeypatch, snapshot, "torch_save", {2})
    monkeypatch.setattr(snapshot, "torch_save", record_temp_files(snapshot.torch_save, temp_files))
    with pytest.raises(KeyboardInterrupt):
        main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "20", "--snapshot_every", "1", "--log_dir",
                         str(tmp_path)])
    assert not sigint_kept_from_pytest
    assert [Path(f).name for f in temp_files] == [f"snapshot_000000{step}.pt.{os.getpid()}.tmp" for step in (0, 1)]
    assert [p.name for p in tmp_path.glob("snapshot_*.pt*")] == ["snapshot_0000000.pt"]  # and the temp file is gone
    assert load_snapshot(snapshot_path(tmp_path, 0))["step"] == 0
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [0, 1]


def record_temp_files(torch_save, names: list[str]):
    def save(obj, f):
        names.append(f.name)
        return torch_save(obj, f)
    return save


# ...and as processes, for their exit status: a real Ctrl-C at a known point of a real run

@pytest.mark.slow  # a process
def test_a_run_stopped_by_ctrl_c_exits_0_as_on_sigterm_and_a_second_ctrl_c_kills_it_by_sigint(data, tmp_path):
    proc = start_paused([*JOB, "--data_dir", str(data), "--max_steps", "20", "--snapshot_every", "1"], tmp_path,
                        [("forward", 3), ("torch_save", 2)])
    markers = wait_for_pause(proc, tmp_path, "forward", 3)
    proc.send_signal(signal.SIGINT)
    go_on(markers)
    markers = wait_for_pause(proc, tmp_path, "torch_save", 2)  # step 1's snapshot, begun: its temp file is there
    assert sorted(p.name for p in tmp_path.glob("snapshot_*.pt*")) == ["snapshot_0000000.pt",
                                                                    "snapshot_0000001.pt.%d.tmp" % proc.pid]
    proc.send_signal(signal.SIGINT)
    run = wait_train(proc, tmp_path, timeout=120, check=False)
    assert run.proc.returncode == -signal.SIGINT  # 130 in a shell: killed by SIGINT, as Python ends on Ctrl-C
    assert run.proc.stderr.splitlines()[-1] == ("aborted by a second Ctrl-C: the steps since the last snapshot are "
                                                "lost; a snapshot being written was removed, the older ones are as "
                                                "they were.")
    assert "Traceback" not in run.proc.stderr
    assert [p.name for p in tmp_path.glob("snapshot_*.pt*")] == ["snapshot_0000000.pt"]

    # The same run once more, with one Ctrl-C: it stops after step 1 with its snapshot, and exits 0 as on SIGTERM.
    go_on(markers)
    proc = start_paused([*JOB, "--data_dir", str(data), "--max_steps", "20", "--snapshot_every", "100"], tmp_path,
                        [("forward", 3)])
    markers = wait_for_pause(proc, tmp_path, "forward", 3)  # step 2: it resumed from snapshot 0, at step 1
    proc.send_signal(signal.SIGINT)
    go_on(markers)
    run = wait_train(proc, tmp_path, timeout=120, check=False)
    assert run.proc.returncode == 0 and "Traceback" not in run.proc.stderr, run.output[-4000:]
    assert f"resuming from {snapshot_path(tmp_path, 0)} at step 1" in run.proc.stdout
    assert "stopping after step 2 on SIGINT; rerun the same command to resume" in run.proc.stdout
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, 2), snapshot_path(tmp_path, 0)]


@pytest.mark.slow  # torchrun
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_on_torchrun_stops_every_rank_after_the_same_step_with_one_snapshot(data, tmp_path, presses):
    """A terminal sends Ctrl-C's SIGINT to its foreground process group: torchrun, as its workers run in sessions of
    their own. torchrun sends each worker one SIGINT; at a second Ctrl-C it sends SIGTERM, which changes nothing."""
    proc = start_paused([*JOB, "--data_dir", str(data), "--max_steps", "20", "--snapshot_every", "100"], tmp_path,
                        [("forward", 3)], nproc=2)
    markers = wait_for_pause(proc, tmp_path, "forward", 3, ranks=2)  # both ranks in step 2 (1 micro-step a step)
    for _ in range(presses):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.5)
    go_on(markers)
    run = wait_train(proc, tmp_path, timeout=300, check=False)
    assert run.proc.returncode == 1  # torchrun's own SignalException, as on SIGTERM
    assert "Sending process" in run.proc.stderr and "closing signal SIGINT" in run.proc.stderr
    assert run.proc.stdout.count("stopping after step 2 on SIGINT; rerun the same command to resume") == 1
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, 2)]
    assert max(r["step"] for r in run.train) == 2
    # Both ranks' data positions went into the snapshot and agreed (Snapshots checks it): at the start of step 3.
    assert load_snapshot(snapshot_path(tmp_path, 2))["loader"]["chunk_position"] == 2 * 3


# ----------------------------------------------------------------------------------------------------------------
# a shard truncated under the run: exit 2 naming it, with a snapshot of the last step trained

@pytest.mark.slow  # a process (a memory map's SIGBUS would kill it)
def test_a_shard_truncated_under_a_run_stops_it_with_a_snapshot_and_exit_2_naming_the_shard(data, tmp_path):
    data = copy_of(data, tmp_path / "data")
    shard = data / "test_train_000000.bin"
    proc = start_paused([*JOB, "--data_dir", str(data), "--max_steps", "20", "--snapshot_every", "2"],
                        tmp_path / "logs", [("read_ahead", 4)])  # before step 3's batches are read
    markers = wait_for_pause(proc, tmp_path / "logs", "read_ahead", 4)
    os.truncate(shard, 0)  # what a copy over it does first: through a memory map, the next read was a SIGBUS
    go_on(markers)
    run = wait_train(proc, tmp_path / "logs", timeout=300, check=False)
    assert run.proc.returncode == 2, run.output[-4000:]  # not -7 (135 in a shell): a Bus error
    newest = snapshot_path(tmp_path / "logs", 2)
    assert run.proc.stderr.splitlines()[-1] == (
        f"error: {shard}: the shard is now 0 bytes, shorter than the 2,224 (600 tokens) it had when the run "
        "started, so tokens 192 to 224 could not be read: it was truncated or rewritten in place while the run read "
        f"it. Every rank stopped after step 2; the newest snapshot is {newest}: restore the shard and rerun the same "
        "command to resume from it. (A run trains on exactly the shards it started with, so any change to one under "
        "it stops it, a new file renamed over it too: write new or re-made shards into another directory, for a new "
        "run.)")
    assert list_snapshots(tmp_path / "logs") == [newest, snapshot_path(tmp_path / "logs", 1)]
    assert load_snapshot(newest)["loader"]["chunk_position"] == 6  # step 3 starts there after the resume


def copy_of(data: Path, directory: Path) -> Path:
    """A copy of the shards, to truncate one of them."""
    directory.mkdir()
    for path in data.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    return directory


@pytest.mark.slow  # torchrun, and a resume compared against an uninterrupted run
def test_a_shard_truncated_under_two_ranks_stops_both_with_one_snapshot_and_the_restored_shard_resumes_exactly(
        data, tmp_path):
    data = copy_of(data, tmp_path / "data")
    shard = data / "test_train_000000.bin"
    tokens = np.fromfile(shard, dtype="<u2", offset=HEADER_BYTES)
    logs = tmp_path / "logs"
    proc = start_paused([*JOB, "--data_dir", str(data), "--max_steps", "6", "--snapshot_every", "100"], logs,
                        [("read_ahead", 4)], nproc=2)
    markers = wait_for_pause(proc, logs, "read_ahead", 4, ranks=2)
    # Cut within the memory map's last page, a memory map read zeros from here on, silently.
    os.truncate(shard, HEADER_BYTES + 2 * 100)
    go_on(markers)
    run = wait_train(proc, logs, timeout=300, check=False)
    assert run.proc.returncode != 0 and "exitcode  : 2" in run.output
    assert len(re.findall(f"^error: {re.escape(str(shard))}: the shard is now 1,224 bytes.* Every rank stopped after "
                          "step 2; the newest snapshot is", run.proc.stderr, re.M)) == 2, run.output[-4000:]
    assert list_snapshots(logs) == [snapshot_path(logs, 2)]

    write_shard(shard, tokens)  # restored: the rerun (on 1 rank) trains steps 3-5 as an uninterrupted run does
    main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "6", "--log_dir", str(logs)])
    main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "6", "--log_dir", str(tmp_path / "reference")])
    resumed = {r["step"]: r["loss"] for r in read_metrics(logs) if "loss" in r and r["step"] >= 3}
    reference = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "reference") if "loss" in r}
    assert resumed.keys() == {3, 4, 5} and all(abs(resumed[s] / reference[s] - 1) < 1e-4 for s in resumed)

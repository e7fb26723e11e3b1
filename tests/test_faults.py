"""Faults from outside the run's code, injected for real: output directories that cannot be written (a file in the
way, a read-only mount) and a full --log_dir disk. Each ends in a clean run or one paragraph and exit 2, never a
traceback, with the run's snapshots and every file it did not write intact.
"""

import os
import re
from contextlib import ExitStack
from pathlib import Path

import pytest

from conftest import fill_up, make_shards, mounted_tmpfs
from errors import UserError
from helpers_train import main_in_process, read_metrics, start_train, wait_train
from run_lock import LOCK_FILE
from snapshot import list_snapshots, load_snapshot, snapshot_path

JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--warmup_steps", "1",
       "--val_every", "0", "--dtype", "fp32", "--no-shuffle"]  # 2 micro-steps of 32 tokens a step on 1 rank


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("data")
    make_shards(data, "train", [600, 600], seed=0)  # 9 steps each
    make_shards(data, "val", [200], seed=1)
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


def test_a_full_disk_under_both_flags_is_exit_2_naming_the_snapshot_that_failed_never_a_traceback(data, tmp_path):
    directory = tmp_path / "full"
    with mounted_tmpfs(directory, "size=1m"):
        fill_up(directory)
        before = contents(directory)
        with pytest.raises(UserError, match=r"the snapshot of step 1 could not be written to .*full \(OSError: "
                                            r"\[Errno 28\] No space left on device; 0 MiB free of 1 MiB\), and it was "
                                            "the run's last; there is no older snapshot"):
            main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "2", "--log_dir", str(directory)])
        assert set(contents(directory)) == set(before) | {LOCK_FILE, "metrics.jsonl"}  # no temp file left


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

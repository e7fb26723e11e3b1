"""One run per output directory (rundir/lock.py): a second run on a directory that a run still uses exits 2 at once,
naming the holder, and touches nothing there; the lock dies with its holder, however it ends; a directory moved
while its run trains stops the run, which writes nothing at the old path."""

import errno
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import failing, make_shards, tiny_snapshots
from helpers_train import main_in_process, read_metrics, records_so_far, run_train, start_train
from rundir import lock as run_lock
from rundir.lock import LOCK_FILE, locked
from rundir.snapshot import list_snapshots, snapshot_path
from rundir.store import Snapshots
from training.distributed import Distributed
from training.errors import UserError

JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--warmup_steps", "1",
       "--val_every", "0", "--dtype", "fp32"]
HOLDER = r"pid {pid} on host {host}, since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d"
EARLIER_HOLDER = "pid 4242 on host node7, since 2025-06-01 10:00:00 UTC\n"  # a run.lock an earlier run left


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("data")
    make_shards(data, "train", [600], seed=0, vocab=257, tokenizer="bytes")
    make_shards(data, "val", [200], seed=1, vocab=257, tokenizer="bytes")
    return data


def refusal(flag: str, directory: Path, pid: int) -> str:
    """The start of the error a run prints for a directory that the process `pid` (on this host) holds."""
    return (f"{flag} {re.escape(str(directory.resolve()))} is in use by another run \\("
            + HOLDER.format(pid=pid, host=re.escape(socket.gethostname())))


def files(directory: Path) -> dict[str, tuple[int, int]]:
    """Each file in directory, with its size and modification time: what a write anywhere in it would change."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()}


@pytest.mark.parametrize("held", ["--log_dir", "--snapshot_dir"])
def test_a_run_refuses_a_directory_that_another_holds_and_writes_nothing(data, tmp_path, held):
    logs, snapshots = tmp_path / "logs", tmp_path / "snapshots"
    directory = {"--log_dir": logs, "--snapshot_dir": snapshots}[held]
    args = [*JOB, "--data_dir", str(data), "--max_steps", "2", "--log_dir", str(logs), "--snapshot_dir", str(snapshots)]
    directory.mkdir()
    with locked(directory, held):  # this process holds it, as another run would
        with pytest.raises(UserError, match=refusal(held, directory, os.getpid())):
            main_in_process(args)
    assert not read_metrics(logs) and not list_snapshots(snapshots)
    assert {p.name for p in tmp_path.glob("*/*")} <= {LOCK_FILE}

    main_in_process(args)  # the holder ended: the same command now runs, and leaves the directories free again
    assert [r["step"] for r in read_metrics(logs) if "loss" in r] == [0, 1]
    for flag, directory in (("--log_dir", logs), ("--snapshot_dir", snapshots)):
        with locked(directory, flag):
            pass


def no_flock(monkeypatch, error: int) -> None:
    """flock(2) failing as on a filesystem without locks (none here has one to mount)."""
    def flock(*args):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(run_lock.fcntl, "flock", flock)


@pytest.mark.parametrize("error", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_where_the_filesystem_has_no_locks_the_run_exits_2_naming_the_flag_to_run_unlocked(data, tmp_path,
                                                                                          monkeypatch, error):
    no_flock(monkeypatch, error)
    with pytest.raises(UserError, match=re.escape(
            f"{tmp_path.resolve() / LOCK_FILE} cannot be locked (OSError: {os.strerror(error)}). Put it on a "
            "filesystem with locks (Lustre: mount with `flock`; NFS has them unless mounted `nolock`), or, if you make "
            "sure that no second run writes there, pass --no-run_lock.")):
        main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "2", "--log_dir", str(tmp_path)])
    assert not read_metrics(tmp_path)


def test_no_run_lock_trains_unlocked_and_says_so(data, tmp_path, monkeypatch, capsys):
    no_flock(monkeypatch, errno.ENOLCK)
    main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "2", "--log_dir", str(tmp_path), "--no-run_lock"])
    assert capsys.readouterr().err.splitlines() == [f"WARNING: --no-run_lock: nothing stops a second run from "
                                                    f"writing into {tmp_path.resolve()} alongside this one."]
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [0, 1]
    assert not (tmp_path / LOCK_FILE).exists()


# Each is a run.lock this code did not create, and the first words of the refusal after "<path> ".


def test_a_run_lock_left_by_an_earlier_run_is_taken_over(data, tmp_path):
    (tmp_path / LOCK_FILE).write_text(EARLIER_HOLDER)
    main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "1", "--log_dir", str(tmp_path)])
    assert re.fullmatch(HOLDER.format(pid=os.getpid(), host=re.escape(socket.gethostname())) + r" \S+\n",
                        (tmp_path / LOCK_FILE).read_text())


# ----------------------------------------------------------------------------------------------------------------
# real runs

LONG_JOB = [*JOB, "--max_steps", "100000", "--snapshot_every", "2", "--keep_last", "2"]  # runs until it is stopped


@contextmanager
def paused_first_run(data: Path, logs: Path) -> Iterator[subprocess.Popen]:
    """A run that has trained and written a snapshot, then stopped with SIGSTOP: it still holds its lock, and while
    a second run tries the directory, only the second run can change anything in it. SIGKILLed at the end."""
    first = start_train([*LONG_JOB, "--data_dir", str(data)], logs)
    try:
        deadline = time.monotonic() + 120
        while not (list_snapshots(logs) and any("loss" in r for r in records_so_far(logs))):
            assert first.poll() is None and time.monotonic() < deadline, "the first run ended or never stepped"
            time.sleep(0.1)
        os.kill(first.pid, signal.SIGSTOP)
        # The signal is not the stop: until waitpid reports it, the run can still be writing (a snapshot's temp
        # file was seen growing after the kill, and the files compared against differed).
        os.waitpid(first.pid, os.WUNTRACED)
        yield first
    finally:
        first.kill()  # a stopped process dies of SIGKILL too
        first.communicate()


@pytest.mark.slow  # three runs at once
def test_a_second_run_exits_2_at_once_naming_the_first_and_the_first_ones_death_frees_the_directory(data, tmp_path):
    logs = tmp_path / "logs"
    with paused_first_run(data, logs) as first:
        before = files(logs)
        started = time.monotonic()
        second = run_train([*LONG_JOB, "--data_dir", str(data)], logs, timeout=90, check=False)
        seconds = time.monotonic() - started
        assert second.proc.returncode == 2, second.output[-4000:]
        assert re.search("^error: " + refusal("--log_dir", logs, first.pid), second.proc.stderr, re.M)
        assert "model:" not in second.proc.stdout  # it stopped before building anything
        assert files(logs) == before  # metrics.jsonl, the snapshots and the lock file, as the first run left them
        print(f"the second run exited 2 after {seconds:.1f} s (mostly Python and torch starting)")

        first.kill()  # SIGKILL: no chance to clean up, and nothing to clean up
        first.wait()
        newest = list_snapshots(logs)[0]
        rerun = start_train([*LONG_JOB, "--data_dir", str(data)], logs)
        try:
            deadline = time.monotonic() + 120
            while not any(r.get("event") == "resume" for r in records_so_far(logs)):
                assert rerun.poll() is None and time.monotonic() < deadline, rerun.communicate()[1][-4000:]
                time.sleep(0.1)
            rerun.send_signal(signal.SIGTERM)  # it resumed: stop it with a snapshot
            stdout, stderr = rerun.communicate(timeout=120)
        finally:
            rerun.kill()
    assert rerun.returncode == 0, stderr[-4000:]
    resumed_at = int(re.search(r"snapshot_(\d+)", newest.name).group(1)) + 1
    assert f"resuming from {newest} at step {resumed_at}" in stdout


@pytest.mark.slow  # torchrun
def test_a_second_two_rank_run_exits_2_on_both_ranks(data, tmp_path):
    logs = tmp_path / "logs"
    with paused_first_run(data, logs) as first:
        before = files(logs)
        second = run_train([*LONG_JOB, "--data_dir", str(data)], logs, nproc=2, timeout=120, check=False)
        assert files(logs) == before
    # Rank 0 holds the lock for the job; rank 1 learns of the refusal from it, and both exit 2, neither waiting.
    assert len(re.findall("^error: " + refusal("--log_dir", logs, first.pid), second.output, re.M)) == 2
    assert second.proc.returncode != 0 and "exitcode  : 2" in second.output, second.output[-4000:]


# ----------------------------------------------------------------------------------------------------------------
# the refusals' words, checked without a run (mutation testing found them unchecked: docs/reliability.md)

def test_a_directory_that_cannot_be_made_names_what_stands_in_its_way(tmp_path):
    (tmp_path / "notes.txt").write_text("a file")
    os.mkfifo(tmp_path / "pipe")
    for blocker, what in (("notes.txt", "is a file, not a directory"), ("pipe", "is not a directory")):
        with pytest.raises(UserError, match=re.escape(f"--log_dir {tmp_path / blocker / 'run'} cannot be written "
                                                      f"({tmp_path / blocker} {what}), so the run")):
            run_lock.check_writable(tmp_path / blocker / "run", "--log_dir")
    # Nothing in the way: the error itself, by its class and words. (Root writes anywhere: the denial is planted.)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "open", failing(errno.EACCES))  # (Python makes it a PermissionError)
        with pytest.raises(UserError) as refused:
            run_lock.check_writable(tmp_path / "run", "--log_dir")
    assert str(refused.value) == (
        f"--log_dir {tmp_path / 'run'} cannot be written (PermissionError: {os.strerror(errno.EACCES)}), so the run "
        "would train and lose every snapshot (or metrics.jsonl line) it writes there; it stops before training. Pass "
        "a --log_dir that this user can write, on a filesystem mounted read-write (or move the file in the way, or "
        "make the directory writable), then rerun.")
    # A symbolic link loop where the directory should be: what stat says of it, not mkdir's "File exists".
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(UserError, match=re.escape(f"--log_dir {tmp_path / 'loop'} cannot be written (OSError: "
                                                  f"{os.strerror(errno.ELOOP)}), so the run")):
        run_lock.check_writable(tmp_path / "loop", "--log_dir")


@pytest.mark.parametrize("fails, error, flag", [("open", errno.EROFS, "--log_dir"), ("flock", errno.EIO,
                                                                                      "--snapshot_dir")])
def test_a_lock_file_that_cannot_be_opened_or_locked_is_refused_naming_it_and_the_error(tmp_path, monkeypatch, fails,
                                                                                        error, flag):
    # (flock's errors that mean "no locks on this filesystem" have their own words: the test above)
    with monkeypatch.context() as patch:
        patch.setattr(os if fails == "open" else fcntl, fails, failing(error))
        with pytest.raises(UserError) as refused, locked(tmp_path, flag):
            pass
    assert str(refused.value) == (f"{tmp_path / LOCK_FILE} cannot be locked (OSError: {os.strerror(error)}). Make "
                                  f"it writable, or pass another {flag}.")


def test_a_holder_line_that_is_not_utf8_is_still_shown(tmp_path):
    with locked(tmp_path, "--log_dir") as fd:
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"pid 7 on host n\xe9ud-3\n", 0)  # (a Latin-1 host name)
        with pytest.raises(UserError) as refused, locked(tmp_path, "--log_dir"):
            pass
    assert str(refused.value) == (
        f"--log_dir {tmp_path} is in use by another run (pid 7 on host n\ufffdud-3; its lock: {tmp_path / LOCK_FILE}). "
        "Two runs in one directory delete each other's snapshots and mix their metrics.jsonl lines, so this run stops "
        "before touching it. Wait for that run to end or stop it (a requeued SLURM job can start while the old job's "
        "processes are still ending), or give this run another --log_dir. The lock goes when its process exits, "
        "however it ends.")


def test_a_directory_to_write_is_made_with_its_parents_and_a_full_disk_only_warns(tmp_path, monkeypatch, capsys):
    run_lock.check_writable(tmp_path / "a" / "b" / "run", "--log_dir")
    assert (tmp_path / "a" / "b" / "run").is_dir() and list((tmp_path / "a" / "b" / "run").iterdir()) == []
    with monkeypatch.context() as patch:
        patch.setattr(os, "open", failing(errno.ENOSPC))
        run_lock.check_writable(tmp_path / "a", "--snapshot_dir")
    assert capsys.readouterr().err == (f"WARNING: --snapshot_dir {tmp_path / 'a'}: the disk is full "
                                       f"({os.strerror(errno.ENOSPC)}). Training starts; writes there fail until "
                                       "there is room again.\n")


# ----------------------------------------------------------------------------------------------------------------
# a directory moved under its run

def test_a_locked_directory_moved_or_removed_is_named_with_where_it_is_now(tmp_path):
    logs, moved = tmp_path / "logs", tmp_path / "moved"
    with run_lock.lock_run_directories({"--log_dir": str(logs)}, Distributed(0, 0, 1, torch.device("cpu"))) as held:
        held.check_in_place(logs)  # in place: nothing to say
        os.rename(logs, moved)
        with pytest.raises(UserError) as refused:
            held.check_in_place(logs)
        assert str(refused.value) == (
            f"--log_dir {logs} is no longer the directory this run locked: it was moved (now: {moved}) or removed "
            f"while the run trained. The run stops, writing nothing at {logs}. To go on, rerun the same command with "
            f"--log_dir {moved}.")
        shutil.rmtree(moved)
        with pytest.raises(UserError, match=re.escape(f"To go on, put {logs} back.")):
            held.check_in_place(logs)


def test_a_snapshot_due_after_its_directory_moved_stops_the_run_writing_nothing_there(data, tmp_path):
    logs, moved = tmp_path / "logs", tmp_path / "moved"
    tiny = tiny_snapshots(data, logs)
    with run_lock.lock_run_directories({"--log_dir": str(logs)}, tiny.dist_env) as held:
        snapshots = Snapshots(str(logs), 1, 2, "never", tiny.trainee, tiny.train_loader, tiny.run_config,
                              tiny.dist_env, print, None, held)
        snapshots.save_if_due(0, last_step=9, stopping=False)
        os.rename(logs, moved)
        with pytest.raises(UserError, match=re.escape(f"--log_dir {logs} is no longer the directory this run locked")):
            snapshots.save_if_due(1, last_step=9, stopping=False)
    assert not logs.exists() and list_snapshots(moved) == [snapshot_path(moved, 0)]


@pytest.mark.slow  # a real run, moved while it trains
def test_a_run_whose_directory_is_moved_stops_writing_nothing_at_the_old_path_and_resumes_where_it_is_now(data,
                                                                                                        tmp_path):
    logs, moved = tmp_path / "logs", tmp_path / "moved"
    run = start_train([*LONG_JOB, "--data_dir", str(data)], logs)
    try:
        deadline = time.monotonic() + 120
        while not list_snapshots(logs):
            assert run.poll() is None and time.monotonic() < deadline, "the run ended or never wrote a snapshot"
            time.sleep(0.05)
        os.rename(logs, moved)
        stdout, stderr = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 2, stderr[-4000:]
    assert (f"error: --log_dir {logs.resolve()} is no longer the directory this run locked: it was moved (now: "
            f"{moved.resolve()}) or removed while the run trained. The run stops, writing nothing at {logs.resolve()}. "
            f"To go on, rerun the same command with --log_dir {moved.resolve()}.") in stderr
    assert not logs.exists()  # nothing written at the old path, so no second run can lock a new directory there
    # The advice, followed literally, resumes the run where it is now.
    newest = list_snapshots(moved)[0]
    resumed = run_train([*JOB, "--data_dir", str(data), "--max_steps", str(int(newest.name[9:16]) + 2)], moved)
    assert f"resuming from {newest} at step {int(newest.name[9:16]) + 1}" in resumed.proc.stdout

"""One run per output directory (run_lock.py): a second run on a directory that a run still uses exits 2 at once,
naming the holder, and touches nothing there; the lock dies with its holder, however it ends."""

import errno
import fcntl
import os
import re
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import failing, make_shards
from helpers_train import main_in_process, read_metrics, records_so_far, run_train, start_train
from rundir import lock as run_lock
from rundir.lock import LOCK_FILE, lock_directory
from rundir.snapshot import list_snapshots
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
    other_run = lock_directory(directory, held)  # this process holds it, as another run would
    with pytest.raises(UserError, match=refusal(held, directory, os.getpid())):
        main_in_process(args)
    assert not read_metrics(logs) and not list_snapshots(snapshots)
    assert {p.name for p in tmp_path.glob("*/*")} <= {LOCK_FILE}

    other_run.close()  # the holder ends: the same command now runs, and leaves the directories free again
    main_in_process(args)
    assert [r["step"] for r in read_metrics(logs) if "loss" in r] == [0, 1]
    for flag, directory in (("--log_dir", logs), ("--snapshot_dir", snapshots)):
        lock_directory(directory, flag).close()


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
            f"{tmp_path.resolve() / LOCK_FILE} cannot be locked: the filesystem of --log_dir {tmp_path.resolve()} has "
            f"no flock(2) (OSError: {os.strerror(error)}).") + ".* pass --no-run_lock to run without the lock"):
        main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "2", "--log_dir", str(tmp_path)])
    assert not read_metrics(tmp_path)


def test_no_run_lock_trains_unlocked_and_says_so(data, tmp_path, monkeypatch, capsys):
    no_flock(monkeypatch, errno.ENOLCK)
    main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "2", "--log_dir", str(tmp_path), "--no-run_lock"])
    assert capsys.readouterr().err.splitlines() == [f"WARNING: --no-run_lock: nothing stops a second run from "
                                                    f"writing into {tmp_path.resolve()} alongside this one."]
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [0, 1]
    assert not (tmp_path / LOCK_FILE).exists()


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_hard_link(path: Path) -> None:
    (path.parent.parent / "elsewhere").write_bytes(b"another file's bytes\n")
    os.link(path.parent.parent / "elsewhere", path)


def make_symlink(path: Path) -> None:
    (path.parent.parent / "elsewhere").write_bytes(b"another file's bytes\n")
    path.symlink_to(path.parent.parent / "elsewhere")


# Each is a run.lock this code did not create, and the first words of the refusal after "<path> ".
NOT_OURS = {
    "a directory": (Path.mkdir, "is not a regular file"),
    "a FIFO": (make_fifo, "is not a regular file"),
    "a symlink to a file": (make_symlink, "is a symbolic link, which the lock never follows"),
    "a symlink to nothing": (lambda path: path.symlink_to(path.parent.parent / "nothing"), "is a symbolic link"),
    "a hard link": (make_hard_link, "has 2 names (it is hard-linked to another file)"),
    "a file with other contents": (lambda path: path.write_bytes(b"[lock]\nowner = someone\n"),
                                   "holds something this code did not write (b'[lock]\\nowner = someone\\n')"),
    "half a holder line": (lambda path: path.write_bytes(b"pid 4242 on host node7, sin"), "holds something"),
}


@pytest.mark.parametrize("kind", NOT_OURS)
def test_a_run_lock_this_code_did_not_create_is_refused_and_left_as_it_is(data, tmp_path, kind, monkeypatch):
    make, refusal = NOT_OURS[kind]
    logs = tmp_path / "logs"
    logs.mkdir()
    make(logs / LOCK_FILE)
    outside = {p: (p.lstat().st_mode, p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*")}
    monkeypatch.setattr("train_gpt2.build_training_model", lambda *args, **kwargs: pytest.fail("built a model"))
    with pytest.raises(UserError, match=re.escape(f"{logs.resolve() / LOCK_FILE} {refusal}")):
        main_in_process([*JOB, "--data_dir", str(data), "--max_steps", "2", "--log_dir", str(logs)])
    # Nothing changed, neither the lock file (or what it points to) nor anything else, and nothing was added.
    assert {p: (p.lstat().st_mode, p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*")} == outside


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


def test_a_symlinked_run_lock_is_refused_saying_the_link_is_removed_and_its_target_kept(tmp_path):
    (tmp_path / "elsewhere").write_text("another file")
    (tmp_path / LOCK_FILE).symlink_to(tmp_path / "elsewhere")
    path = tmp_path / LOCK_FILE
    with pytest.raises(UserError) as refused:
        lock_directory(tmp_path, "--snapshot_dir")
    assert str(refused.value) == (
        f"{path} is a symbolic link, which the lock never follows (it would write into the file the link points to), "
        f"so --snapshot_dir {tmp_path} cannot be locked, and an unlocked run could share the directory with a second "
        f"run that deletes its snapshot files. Remove the link {path} (the file it points to is left as it is), or "
        "pass another --snapshot_dir; then rerun.")


def test_no_flock_names_the_mount_options_that_give_locks_and_the_flag_that_runs_without(tmp_path):
    message = run_lock.no_flock(tmp_path / LOCK_FILE, "--snapshot_dir", OSError(errno.ENOLCK, "No locks available"))
    assert message == (
        f"{tmp_path / LOCK_FILE} cannot be locked: the filesystem of --snapshot_dir {tmp_path} has no flock(2) "
        "(OSError: No locks available). Put --snapshot_dir on a filesystem with locks (on Lustre, mount it with the "
        "`flock` option; NFS has them unless mounted `nolock`), or, if you make sure yourself that no second run "
        "writes into that directory, pass --no-run_lock to run without the lock.")


@pytest.mark.parametrize("broken", ["write fails", "short write", "nothing works"])
def test_a_holder_line_not_written_whole_leaves_no_part_of_a_line_and_the_lock_held(tmp_path, monkeypatch, broken):
    # A full disk (or an I/O error) while the lock writes its holder's name: the lock is taken all the same, and
    # run.lock holds no half line (which the next run would refuse as not ours) and not the earlier holder's name.
    path = tmp_path / LOCK_FILE
    path.write_text(EARLIER_HOLDER)
    real_pwrite = os.pwrite
    with monkeypatch.context() as patch:
        patch.setattr(os, "pwrite", lambda fd, line, at: real_pwrite(fd, line[:10], at) if broken == "short write"
                      else failing(errno.ENOSPC)())
        if broken == "nothing works":  # not even the truncation: the earlier holder's line stays, whole
            patch.setattr(os, "ftruncate", failing(errno.EIO))
        lock = lock_directory(tmp_path, "--log_dir")
    with lock:
        assert path.read_text() == (EARLIER_HOLDER if broken == "nothing works" else "")
        with pytest.raises(UserError, match=re.escape("is in use by another run (" + (
                EARLIER_HOLDER.strip() if broken == "nothing works" else
                "a process that has not written its name yet") + "; its lock")):
            lock_directory(tmp_path, "--log_dir")  # (flock: a second open file of this process is refused too)
    lock_directory(tmp_path, "--log_dir").close()  # and the next run takes it over


def test_the_lock_file_is_opened_without_blocking_or_being_inherited_and_readable_by_all(tmp_path):
    # O_NONBLOCK: a FIFO put in place of run.lock between its check and its open cannot hang the run; close-on-exec:
    # the processes a run starts (a torch compile worker, a data tool) never hold its lock after it has ended.
    umask = os.umask(0o022)
    try:
        with lock_directory(tmp_path, "--log_dir") as lock:
            assert fcntl.fcntl(lock.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
            assert fcntl.fcntl(lock.fileno(), fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert stat.S_IMODE((tmp_path / LOCK_FILE).stat().st_mode) == 0o644  # whoever can read the directory sees
    finally:  # who holds it
        os.umask(umask)


@pytest.mark.parametrize("fails, error, flag", [("open", errno.EROFS, "--log_dir"), ("flock", errno.EIO,
                                                                                      "--snapshot_dir")])
def test_a_lock_file_that_cannot_be_opened_or_locked_is_refused_naming_it_and_the_error(tmp_path, monkeypatch, fails,
                                                                                        error, flag):
    # (flock's errors that mean "no locks on this filesystem" have their own words: the test above)
    with monkeypatch.context() as patch:
        patch.setattr(os if fails == "open" else fcntl, fails, failing(error))
        with pytest.raises(UserError) as refused:
            lock_directory(tmp_path, flag)
    assert str(refused.value) == (
        f"{tmp_path / LOCK_FILE} could not be opened or locked (OSError: {os.strerror(error)}), so {flag} {tmp_path} "
        "cannot be locked, and an unlocked run could share the directory with a second run that deletes its snapshot "
        f"files. Make {tmp_path} writable, or remove {tmp_path / LOCK_FILE} if it is in the way, or pass another "
        f"{flag}; then rerun.")


def test_a_hard_link_made_between_the_check_and_the_open_is_refused_by_the_opened_files_own_check(tmp_path,
                                                                                                  monkeypatch):
    make_hard_link(tmp_path / LOCK_FILE)
    before = files(tmp_path)
    with monkeypatch.context() as patch:  # the check before opening found no run.lock; the link came just after
        patch.setattr(os, "lstat", failing(errno.ENOENT))
        with pytest.raises(UserError) as refused:
            lock_directory(tmp_path, "--snapshot_dir")
    assert str(refused.value) == (
        f"{tmp_path / LOCK_FILE} has 2 names (it is hard-linked to another file), and the lock of --snapshot_dir "
        f"{tmp_path} writes into it, which would change that other file too. Remove {tmp_path / LOCK_FILE} (the other "
        "name keeps its contents), then rerun.")
    assert files(tmp_path) == before


def test_a_holder_line_that_is_not_utf8_is_still_shown(tmp_path):
    with lock_directory(tmp_path, "--log_dir") as lock:
        os.ftruncate(lock.fileno(), 0)
        os.pwrite(lock.fileno(), b"pid 7 on host n\xe9ud-3\n", 0)  # (a Latin-1 host name)
        with pytest.raises(UserError) as refused:
            lock_directory(tmp_path, "--log_dir")
    assert str(refused.value) == (
        f"--log_dir {tmp_path} is in use by another run (pid 7 on host n\ufffdud-3; its lock: {tmp_path / LOCK_FILE}). "
        "Two runs writing into one directory delete each other's snapshot files and mix their metrics.jsonl lines, so "
        "this run stops before touching it. Wait for that run to end or stop it (a requeued SLURM job can start while "
        "the old job's processes are still ending), or give this run another --log_dir. The lock goes when the "
        "process holding it exits, however it ends: after a crash there is nothing to delete.")


@pytest.mark.parametrize("length", [60, 61])
def test_a_foreign_run_lock_is_shown_up_to_60_bytes(tmp_path, length):
    contents = b"x" * length
    (tmp_path / LOCK_FILE).write_bytes(contents)
    with pytest.raises(UserError, match=re.escape(f"holds something this code did not write ({contents[:60]!r}"
                                                  f"{'...' if length > 60 else ''}): the lock")):
        lock_directory(tmp_path, "--log_dir")


def test_a_directory_to_write_is_made_with_its_parents_and_a_full_disk_only_warns(tmp_path, monkeypatch, capsys):
    run_lock.check_writable(tmp_path / "a" / "b" / "run", "--log_dir")
    assert (tmp_path / "a" / "b" / "run").is_dir() and list((tmp_path / "a" / "b" / "run").iterdir()) == []
    with monkeypatch.context() as patch:
        patch.setattr(os, "open", failing(errno.ENOSPC))
        run_lock.check_writable(tmp_path / "a", "--snapshot_dir")
    assert capsys.readouterr().err == (f"WARNING: --snapshot_dir {tmp_path / 'a'}: the disk is full "
                                       f"({os.strerror(errno.ENOSPC)}). Training starts; writes there fail until "
                                       "there is room again.\n")

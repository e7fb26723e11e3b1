"""One run per output directory, and output directories that can be written. Two runs writing into one --log_dir or
--snapshot_dir (a command started twice, or a requeued SLURM job starting while the old job's processes still run)
would delete each other's temporary snapshot files, fail their writes and interleave metrics.jsonl lines; a
directory that cannot be written would let a run train for days and lose every snapshot.

So before the run builds anything, each directory it writes into is made if missing and probed with a real write (a
temp file created and removed: permission bits say nothing to root, nor about a read-only mount); one that cannot
be written stops the run, exit 2, naming it. Then the run holds an exclusive flock(2) on <dir>/run.lock in each of
them until it ends, and a second run exits 2 at once naming the holder (host, pid, since when), which the holder
writes into the file. The kernel drops the lock when the holding process exits, however it dies, so a crash or
SIGKILL leaves no stale lock to delete. On NFS the lock is taken on the server, so runs on different nodes see each
other's (a crashed node's lock lasts until the server gives up on it: the NFSv4 lease, 90 s by default on Linux).
Under torchrun, global rank 0 checks and holds the directories for the whole job and tells the other ranks whether it
got them, so that on a refusal every rank exits 2 together.

A lock that cannot be taken is an error, never a warning: a run that went on unlocked is exactly the run the lock is
there to stop. Only where the filesystem has no flock at all may the user turn the lock off (--no-run_lock). The
lock never harms a file it did not make: run.lock is opened without following a symlink, must be a regular file
with no other name (hard link), and is written only if it is empty or holds a holder line as this code writes it.
The holder line is written unbuffered, and a write that fails (a full disk) is cut back off: nothing is left to
flush when the run ends, so a full disk under --log_dir cannot fail a run at its exit.
"""

import errno
import fcntl
import os
import re
import socket
import stat
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from io import FileIO
from pathlib import Path

from training.distributed import Distributed, from_rank_0
from training.errors import UserError

LOCK_FILE = "run.lock"
# What the lock writes into run.lock: the only contents (besides none) that it ever overwrites.
HOLDER_LINE = re.compile(rb"pid \d+ on host [^\n]*, since [^\n]*\n")
MAX_HOLDER_BYTES = 4096  # more than any holder line
NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)  # a filesystem without flock(2)
FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk or quota: the directory can be written once there is room


@contextmanager
def lock_run_directories(directories: dict[str, str | None], dist_env: Distributed,
                         lock: bool = True) -> Iterator[None]:
    """Check that each directory, {flag: path} (None or "": not set), can be written (made if missing), and hold
    its lock for the block (unless not `lock`: --no-run_lock); a directory named by two flags is checked and locked
    once. A collective: every rank must enter it. If a directory cannot be written, or another run holds it, or its
    lock cannot be taken, every rank raises the same UserError."""
    with ExitStack() as held:
        refusal = None
        if dist_env.is_master:
            distinct: dict[Path, str] = {}  # directory -> the first flag naming it
            for flag, path in directories.items():
                if path:  # (None or "": not set, as config.resolve_plan reads --snapshot_dir)
                    # (realpath: the same directory by two names is one; a symlink loop raises in check_writable)
                    distinct.setdefault(Path(os.path.realpath(path)), flag)
            try:
                for directory, flag in distinct.items():
                    check_writable(directory, flag)
                    if lock:
                        held.enter_context(lock_directory(directory, flag))  # closing the file releases the lock
            except UserError as e:
                refusal = str(e)
            if not lock and refusal is None:
                print(f"WARNING: --no-run_lock: nothing stops a second run from writing into "
                      f"{' and '.join(map(str, distinct))} alongside this one.", file=sys.stderr)
        refusal = from_rank_0(refusal)
        if refusal:
            raise UserError(refusal)
        yield


def check_writable(directory: Path, flag: str) -> None:
    """Make `directory` if missing and create and remove a file in it; UserError naming it if that fails. A full
    disk passes with a warning: the run's writes fail softly there (see run_logger.py and snapshot.py), and space
    may be freed while it trains."""
    try:
        with suppress(FileNotFoundError):
            os.stat(directory)  # what stands in the way by its own errno (a loop, a name too long), not mkdir's EEXIST
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / f".write_probe.{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(directory / f".write_probe.{os.getpid()}")
    except OSError as e:
        if e.errno in FULL:
            print(f"WARNING: {flag} {directory}: the disk is full ({os.strerror(e.errno)}). Training starts; writes "
                  "there fail until there is room again.", file=sys.stderr)
            return
        raise UserError(f"{flag} {directory} cannot be written ({unwritable_reason(directory, e)}), so the run would "
                        "train and lose every snapshot (or metrics.jsonl line) it writes there; it stops before "
                        f"training. Pass a {flag} that this user can write, on a filesystem mounted read-write (or "
                        "move the file in the way, or make the directory writable), then rerun.") from None


def unwritable_reason(directory: Path, error: OSError) -> str:
    """What stands in the way, in words: the first ancestor that is not a directory, or the error."""
    for path in (directory, *directory.parents):  # (os.path's checks answer False where pathlib's would raise)
        if os.path.exists(path) and not os.path.isdir(path):
            return f"{path} is a file, not a directory" if os.path.isfile(path) else f"{path} is not a directory"
    return f"{type(error).__name__}: {error.strerror or error}"


def lock_directory(directory: Path, flag: str) -> FileIO:
    """Take the lock on `directory` (an existing one: check_writable makes it) and write who holds it into its
    run.lock. Returns the open lock file, which holds the lock until it is closed. Raises UserError naming the file,
    before touching anything else in the directory, if another process holds the lock, the lock cannot be taken, or
    run.lock is not a file this code may write."""
    path = directory / LOCK_FILE
    with suppress(FileNotFoundError):
        check_lock_file(os.lstat(path), path, flag)  # before opening: opening a FIFO or a device can hang or act
    try:
        # O_NOFOLLOW: a symlink put there since is refused, not followed; O_NONBLOCK: nor can a FIFO hang the open.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise UserError(unusable_lock(path, flag, e)) from None
    lock_file = FileIO(fd, "r+")  # unbuffered: closing it has nothing left to write
    try:
        check_lock_file(os.fstat(fd), path, flag)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, MAX_HOLDER_BYTES, 0).decode(errors="replace").strip()
            raise UserError(
                f"{flag} {directory} is in use by another run "
                f"({holder or 'a process that has not written its name yet'}; its lock: {path}). Two runs writing into "
                "one directory delete each other's snapshot files and mix their metrics.jsonl lines, so this run "
                "stops before touching it. Wait for that run to end or stop it (a requeued SLURM job can start while "
                f"the old job's processes are still ending), or give this run another {flag}. The lock goes when the "
                "process holding it exits, however it ends: after a crash there is nothing to delete.") from None
        except OSError as e:
            raise UserError(no_flock(path, flag, e) if e.errno in NO_FLOCK else unusable_lock(path, flag, e)) from None
        contents = os.pread(fd, MAX_HOLDER_BYTES, 0)
        if contents and not HOLDER_LINE.fullmatch(contents):
            shown = repr(contents[:60]) + ("..." if len(contents) > 60 else "")
            raise UserError(f"{path} holds something this code did not write ({shown}): the lock of "
                            f"{flag} {directory} writes its holder's name into that file, and never overwrites what it "
                            f"did not write. Move the file out of the directory, or pass another {flag}; then rerun.")
        write_holder(fd)
    except BaseException:
        lock_file.close()
        raise
    return lock_file


def check_lock_file(info: os.stat_result, path: Path, flag: str) -> None:
    """UserError unless run.lock (its lstat or fstat) is a regular file with no other name: the lock writes into it,
    and a write into a hard-linked file would change the file it shares its bytes with."""
    if stat.S_ISLNK(info.st_mode):
        raise UserError(unusable_lock(path, flag, OSError(errno.ELOOP, os.strerror(errno.ELOOP))))
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"{path} is not a regular file (a directory, FIFO, socket or device), so {flag} "
                        f"{path.parent} cannot be locked: the lock is a small file this code creates there. Remove "
                        f"or rename {path}, or pass another {flag}; then rerun.")
    if info.st_nlink > 1:
        raise UserError(f"{path} has {info.st_nlink} names (it is hard-linked to another file), and the lock of "
                        f"{flag} {path.parent} writes into it, which would change that other file too. Remove {path} "
                        "(the other name keeps its contents), then rerun.")


def write_holder(fd: int) -> None:
    """Replace run.lock's contents with the holder line. Without the name (a full disk) the lock still holds, and
    a refusal just cannot name us: a failed or short write is cut back off to an empty file, which the next run may
    take, never half a line, which it would refuse."""
    line = (f"pid {os.getpid()} on host {socket.gethostname()}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n").encode()
    with suppress(OSError):
        os.ftruncate(fd, 0)
        if os.pwrite(fd, line, 0) == len(line):
            return
    with suppress(OSError):
        os.ftruncate(fd, 0)


def unusable_lock(path: Path, flag: str, error: OSError) -> str:
    if error.errno == errno.ELOOP:
        what = "is a symbolic link, which the lock never follows (it would write into the file the link points to)"
        fix = f"Remove the link {path} (the file it points to is left as it is)"
    else:
        what = f"could not be opened or locked ({type(error).__name__}: {error.strerror or error})"
        fix = f"Make {path.parent} writable, or remove {path} if it is in the way"
    return (f"{path} {what}, so {flag} {path.parent} cannot be locked, and an unlocked run could share the directory "
            f"with a second run that deletes its snapshot files. {fix}, or pass another {flag}; then rerun.")


def no_flock(path: Path, flag: str, error: OSError) -> str:
    return (f"{path} cannot be locked: the filesystem of {flag} {path.parent} has no flock(2) "
            f"({type(error).__name__}: {error.strerror or error}). Put {flag} on a filesystem with locks (on Lustre, "
            "mount it with the `flock` option; NFS has them unless mounted `nolock`), or, if you make sure yourself "
            "that no second run writes into that directory, pass --no-run_lock to run without the lock.")

"""One run per output directory (flock on <dir>/run.lock: the kernel drops it however the holder dies), probed by a
real write and checked to stay in place. Why: docs/reliability.md ("One run per directory")."""

import errno
import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

from training.distributed import Distributed, agreed
from training.errors import UserError

LOCK_FILE = "run.lock"


class RunLock:
    """The directories this process holds locked: {path: (flag, run.lock's descriptor)}."""

    def __init__(self):
        self.held: dict[Path, tuple[str, int]] = {}

    def check_in_place(self, directory: str | Path) -> None:
        """UserError if `directory`, locked, is no longer at its path, naming where it is now."""
        flag, fd = self.held.get(Path(os.path.realpath(directory)), (None, None))
        with suppress(OSError):
            if fd is None or os.path.samestat(os.stat(Path(directory) / LOCK_FILE), os.fstat(fd)):
                return
        now = os.readlink(f"/proc/self/fd/{fd}").removesuffix(f"/{LOCK_FILE}")  # (Linux: the file's path now)
        fix = f"rerun the same command with {flag} {now}" if os.path.isdir(now) else f"put {directory} back"
        raise UserError(f"{flag} {directory} is no longer the directory this run locked: it was moved (now: {now}) "
                        f"or removed while the run trained. The run stops, writing nothing at {directory}. To go on, "
                        f"{fix}.")


@contextmanager
def lock_run_directories(directories: dict[str, str | None], dist_env: Distributed,
                         lock: bool = True) -> Iterator[RunLock]:
    """Check that each directory, {flag: path} (None or "": not set), can be written (made if missing), and hold its
    lock for the block (unless not `lock`). Collective: on a refusal every rank raises it."""
    run_lock = RunLock()
    distinct: dict[Path, str] = {}  # directory -> the first flag naming it
    for flag, path in directories.items():
        if path:
            distinct.setdefault(Path(os.path.realpath(path)), flag)
    with ExitStack() as held:
        def take_them() -> None:
            for directory, flag in distinct.items():
                check_writable(directory, flag)
                if lock:
                    run_lock.held[directory] = flag, held.enter_context(locked(directory, flag))
            if not lock:
                print(f"WARNING: --no-run_lock: nothing stops a second run from writing into "
                      f"{' and '.join(map(str, distinct))} alongside this one.", file=sys.stderr)
        agreed(take_them, dist_env)
        yield run_lock


def check_writable(directory: Path, flag: str) -> None:
    """Make `directory` if missing and create and remove a file in it (permission bits say nothing to root, nor of
    a read-only mount); UserError naming it if that fails. A full disk warns: space may be freed while it trains."""
    probe = directory / f".write_probe.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            print(f"WARNING: {flag} {directory}: the disk is full ({os.strerror(e.errno)}). Training starts; writes "
                  "there fail until there is room again.", file=sys.stderr)
            return
        if isinstance(e, FileExistsError):  # mkdir's word for any name in the way: ask stat what that name is
            try:
                os.stat(directory)
            except OSError as what_is_there:  # (a symbolic link loop: ELOOP)
                e = what_is_there
        in_the_way = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
        reason = (f"{in_the_way} is {'a file, ' if in_the_way.is_file() else ''}not a directory" if in_the_way
                  else f"{type(e).__name__}: {e.strerror or e}")
        raise UserError(f"{flag} {directory} cannot be written ({reason}), so the run would train and lose every "
                        "snapshot (or metrics.jsonl line) it writes there; it stops before training. Pass a "
                        f"{flag} that this user can write, on a filesystem mounted read-write (or move the file in "
                        "the way, or make the directory writable), then rerun.") from None


@contextmanager
def locked(directory: Path, flag: str) -> Iterator[int]:
    """Hold the flock of directory/run.lock, this process's name in it; UserError naming the holder or the fix."""
    path, fd = directory / LOCK_FILE, None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if isinstance(e, BlockingIOError):
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process starting up"
            os.close(fd)
            raise UserError(f"{flag} {directory} is in use by another run ({holder}; its lock: {path}). Two runs in "
                            "one directory delete each other's snapshots and mix their metrics.jsonl lines, so this "
                            "run stops before touching it. Wait for that run to end or stop it (a requeued SLURM job "
                            f"can start while the old job's processes are still ending), or give this run another "
                            f"{flag}. The lock goes when its process exits, however it ends.") from None
        if fd is not None:
            os.close(fd)
        fix = ("Put it on a filesystem with locks (Lustre: mount with `flock`; NFS has them unless mounted `nolock`), "
               "or, if you make sure that no second run writes there, pass --no-run_lock"
               if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP) else
               f"Make it writable, or pass another {flag}")
        raise UserError(f"{path} cannot be locked ({type(e).__name__}: {e.strerror or e}). {fix}.") from None
    try:
        with suppress(OSError):  # (a full disk: the lock holds all the same, a refusal just cannot name us)
            os.ftruncate(fd, 0)
            since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since {since}\n".encode(), 0)
        yield fd
    finally:
        os.close(fd)

"""One run per output directory. Two runs writing into one --log_dir or --snapshot_dir (a command started twice, or a
requeued SLURM job starting while the old job's processes still run) would delete each other's temporary snapshot
files, fail their writes and interleave metrics.jsonl lines.

So a run holds an exclusive flock(2) on <dir>/run.lock in each directory it writes into, from before it reads or
writes anything there until it ends, and a second run exits 2 at once naming the holder (host, pid, since when),
which the holder writes into the file. The kernel drops the lock when the holding process exits, however it dies,
so a crash or SIGKILL leaves no stale lock to delete. On NFS the lock is taken on the server, so runs on different
nodes see each other's (a crashed node's lock lasts until the server gives up on it: the NFSv4 lease, 90 s by
default on Linux). Under torchrun, global rank 0 holds the locks for the whole job and tells the other ranks whether
it got them, so that on a refusal every rank exits 2 together.
"""

import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import IO

from distributed import Distributed, from_rank_0
from errors import UserError

LOCK_FILE = "run.lock"


@contextmanager
def lock_run_directories(directories: dict[str, str | None], dist_env: Distributed) -> Iterator[None]:
    """Hold the lock on each directory, {flag: path} (None: not set), for the block; a directory named by two flags
    is locked once. A collective: every rank must enter it. If another run holds one of them, every rank raises the
    same UserError."""
    with ExitStack() as held:
        refusal = None
        if dist_env.is_master:
            distinct: dict[Path, str] = {}  # directory -> the first flag naming it
            for flag, path in directories.items():
                if path is not None:
                    distinct.setdefault(Path(path).resolve(), flag)
            try:
                for directory, flag in distinct.items():
                    lock_file = lock_directory(directory, flag)
                    if lock_file is not None:
                        held.enter_context(lock_file)  # closing the file releases the lock
            except UserError as e:
                refusal = str(e)
        refusal = from_rank_0(refusal)
        if refusal:
            raise UserError(refusal)
        yield


def lock_directory(directory: Path, flag: str) -> IO[str] | None:
    """Take the lock on `directory` (made if missing) and write who holds it into the lock file. Returns the open
    lock file, which holds the lock until it is closed; None, after a warning, where the filesystem has no locks.
    Raises UserError, before touching anything else in the directory, if another process holds the lock."""
    path = directory / LOCK_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock_file = open(path, "a+")  # creates it, and never truncates: the holder's name must stay readable
    except OSError as e:
        warn_unlocked(path, flag, e)
        return None
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.seek(0)
        holder = lock_file.read().strip() or "a process that has not written its name yet"
        lock_file.close()
        raise UserError(
            f"{flag} {directory} is in use by another run ({holder}; its lock: {path}). Two runs writing into one "
            "directory delete each other's snapshot files and mix their metrics.jsonl lines, so this run stops "
            "before touching it. Wait for that run to end or stop it (a requeued SLURM job can start while the old "
            f"job's processes are still ending), or give this run another {flag}. The lock goes when the process "
            "holding it exits, however it ends: after a crash there is nothing to delete.") from None
    except OSError as e:  # ENOLCK, ENOSYS, EOPNOTSUPP: no locks on this filesystem
        lock_file.close()
        warn_unlocked(path, flag, e)
        return None
    with suppress(OSError):  # without the name (a full disk) the lock still holds; a refusal just cannot name us
        lock_file.truncate(0)
        lock_file.write(f"pid {os.getpid()} on host {socket.gethostname()}, since "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
        lock_file.flush()
    return lock_file


def warn_unlocked(path: Path, flag: str, error: OSError) -> None:
    print(f"WARNING: could not lock {path} ({type(error).__name__}: {error}), so nothing stops a second run from "
          f"writing into {flag} {path.parent} alongside this one. Training goes on. (On Lustre, locks that span "
          "nodes need the `flock` mount option.)", file=sys.stderr)

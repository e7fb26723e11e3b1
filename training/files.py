"""Writing files so that a crash never leaves a half-written one where a whole one is expected."""

import os
from collections.abc import Callable
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable: without this a power cut can undo it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable) -> None:
    """Write a file so that a crash leaves either the old file (or none) or the complete new one at `path`.

    write(f) fills a temp file beside it (opened "wb"); then fsync, rename over `path`, fsync of the directory. On
    any failure (disk full, Ctrl-C) the temp file is removed, so no half-written gigabytes stay behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: concurrent writers never collide
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)

"""Files written so that a crash never leaves a half-written one where a whole one is expected, and a failed write
(a full disk) is an OSError naming the path it was for; and the version check of our JSON files."""

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


def version_problem(record: object, version: int, kind: str) -> str | None:
    """None where `record` (one of our JSON files, parsed) is of format `version`; else, for the refusal naming the
    file, e.g. "has version 2, and this code reads manifests of version 1 only"."""
    if isinstance(record, dict) and record.get("version") == version:
        return None
    found = f"version {record['version']!r}" if isinstance(record, dict) and "version" in record else "no version"
    return f"has {found}, and this code reads {kind} of version {version} only"


def raise_for(path: Path, temporary: Path, error: BaseException) -> None:
    """Raise `error`, as an OSError naming `path` where it names no file (a failed write or fsync: ENOSPC) or names
    `temporary`, no name the user gave (errors.run_entry_point then names the flag the path came from)."""
    if isinstance(error, OSError) and error.errno is not None and (
            error.filename is None or Path(os.fsdecode(error.filename)).is_relative_to(temporary)):
        raise OSError(error.errno, error.strerror or os.strerror(error.errno), str(path)) from error
    raise error


def reason(error: BaseException) -> str:
    """What went wrong, for a message that names the path itself: an OSError without its file name again."""
    if isinstance(error, OSError) and error.strerror:
        return f"{type(error).__name__}: [Errno {error.errno}] {error.strerror}"
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def atomic_write(path: str | Path, write: Callable) -> None:
    """Leave at `path` the old file (or none) or the complete new one, which write(f) writes into a temp file beside
    it (opened "wb"). On any failure (disk full, Ctrl-C) the temp file is removed: no half-written gigabytes stay."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: concurrent writers never collide
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        raise_for(path, tmp, e)

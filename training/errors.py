"""UserError, for mistakes a user can fix, reported (as is an OSError on a path the user gave) in one paragraph, exit
status 2; any other exception is a bug and keeps its traceback. And every entry point's first check: torch's version."""

import ast
import errno
import os
import re
import sys
from collections.abc import Callable, Sequence

import torch

MIN_TORCH = (2, 11)  # FSDP2's fully_shard, torch.OutOfMemoryError, MemTracker, init_process_group(device_id=...)


class UserError(Exception):
    """A problem the user can fix. The message is one paragraph that names the file or flag and the fix."""


# OSErrors that say something about a path the user gave, or the disk under it, and nothing about our code.
PATH_PROBLEMS = {
    errno.ENAMETOOLONG: "a name in it is longer than the file system allows (on most, 255 bytes a name and 4,096 a "
                        "path). Pass a shorter path",
    errno.ELOOP: "its symbolic links point at each other in a loop (or nest more than 40 deep). Fix or remove the "
                 "link, or pass the real path",
    errno.ENOTDIR: "a part of it that should be a directory is a file. Pass a path whose parents are all "
                   "directories, or move that file",
    errno.EIO: "the device reported an I/O error: the disk or network file system under it is failing (the kernel's "
               "log, dmesg, says more). Use a copy on a healthy disk, or check the device, then rerun",
    errno.EACCES: "permission denied. Give this user access to it (chmod, chown), or pass a path this user can use",
    errno.EPERM: "the operation is not permitted (an immutable file, or a mount that refuses it). Pass another path",
    errno.EROFS: "its file system is mounted read-only. Pass a path on a file system mounted read-write",
    errno.ENOSPC: "the disk is full. Free space there, or pass a path on another disk",
    errno.EDQUOT: "the disk quota is used up. Free space there, or pass a path on another disk",
    errno.ESTALE: "a stale network file handle: the file changed on the NFS server under this node. Rerun; if it "
                  "stays, remount the file system",
}


SYMLINK_LOOP = re.compile(r"Symlink loop from ('.*'|\".*\")")  # Path.resolve()'s RuntimeError: the path's repr


def path_error(error: OSError | RuntimeError, argv: Sequence[str]) -> UserError | None:
    """A UserError for an OSError of PATH_PROBLEMS naming the argv argument its path lies under; else None."""
    if isinstance(error, RuntimeError):  # pathlib's resolve() before Python 3.13 says ELOOP so
        loop = SYMLINK_LOOP.fullmatch(str(error))
        if loop is None:
            return None
        error = OSError(errno.ELOOP, os.strerror(errno.ELOOP), ast.literal_eval(loop.group(1)))
    if error.errno not in PATH_PROBLEMS or not error.filename:
        return None
    path = os.fsdecode(error.filename)
    flag, value = command_line_path(path, argv)
    named = " ".join(part for part in (flag, value) if part)
    subject = path if not value else named if os.path.abspath(value) == os.path.abspath(path) else f"{named}: {path}"
    return UserError(f"{subject} could not be used: {PATH_PROBLEMS[error.errno]}.")


def command_line_path(path: str, argv: Sequence[str]) -> tuple[str | None, str | None]:
    """(flag or None, value) of the argv argument naming `path` or its nearest directory (by name), or (None, None)."""
    found = []
    for i, arg in enumerate(argv):
        flag, value = arg.split("=", 1) if arg.startswith("--") and "=" in arg else (None, arg)
        if flag is None and i and argv[i - 1].startswith("--") and "=" not in argv[i - 1]:
            flag = argv[i - 1]
        directory = os.path.abspath(value) if value and not value.startswith("--") else None
        if directory and os.path.commonpath([os.path.abspath(path), directory]) == directory:
            found.append((len(directory), flag, value))
    return max(found, default=(0, None, None), key=lambda match: match[0])[1:]


def check_torch_version(version: str) -> None:
    """UserError unless torch `version` (e.g. "2.12.0+cu128", "2.11.0a0+git1234") is MIN_TORCH or newer."""
    if tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups()) < MIN_TORCH:
        needed = ".".join(map(str, MIN_TORCH))
        raise UserError(f"PyTorch {version} is too old: this code needs torch >= {needed} (tested with 2.13). "
                        f"Load a newer PyTorch (cluster module, container image), or install one: `pip install "
                        f"'torch>={needed}'`, or `bash quickstart.sh`, which installs the pinned versions into .venv.")


def run_entry_point(main: Callable[[], None]) -> None:
    """Call main(); a UserError, or path_error's, becomes `error: <message>` on stderr and exit status 2. Under torchrun
    the checks that raise one run on every rank (or agree first), so no rank waits for a peer that has gone."""
    try:
        check_torch_version(torch.__version__)
        main()
    except (UserError, OSError, RuntimeError) as e:
        user_error = e if isinstance(e, UserError) else path_error(e, sys.argv[1:])
        if user_error is None:
            raise
        # One write, newline included: print() writes the two apart, and where stderr is unbuffered
        # (PYTHONUNBUFFERED, as under many launchers) two ranks' messages could run into one line.
        sys.stderr.write(f"error: {user_error}\n")
        sys.exit(2)


# Also on import, the first of our modules each entry point loads: before those that import newer torch APIs at their
# top (parallel: fully_shard), where an older torch would fail with an ImportError before run_entry_point could say why.
run_entry_point(lambda: None)

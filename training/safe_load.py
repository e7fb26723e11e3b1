"""Reading a pickle-format torch file (ours, a Hugging Face pytorch_model.bin) without running code, by
torch.load(weights_only=True) (a directory snapshot's files: safe_load_shards.py). Refusals: ValueErrors naming why."""

import os
import re
import stat
from pathlib import Path

import torch

from training.files import reason

SNAPSHOT_FILE = ("a snapshot", "Pass a snapshot written by train_gpt2.py: it holds only tensors, numbers and strings.")


def read_torch_file(path: Path, kind: tuple[str, str] = SNAPSHOT_FILE, map_location: str = "cpu"):
    """torch.load(weights_only=True, mmap=True); kind: (what the file should be, the fix a refusal ends with). A
    ValueError naming the file if it is missing, refused or does not load; an OSError reading it is raised as it is."""
    what, fix = kind
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block the read, or never end
            raise ValueError(f"{path} could not be read as {what}: it is not a regular file (a FIFO, a socket or a "
                             f"device). {fix}")
        with open(path, "rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"  # torch.save's container (torch's message otherwise: about mmap)
    except FileNotFoundError as e:
        raise ValueError(f"{path} could not be read as {what}: it is missing.") from e
    except OSError as e:  # (a failing disk's EIO from read() names no file: errors.path_error names this one)
        e.filename = e.filename or str(path)
        raise
    if not is_zip:
        raise ValueError(f"{path} could not be read as {what}: it is truncated, corrupt or not a torch file.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except Exception as e:
        if (refused := unsafe_pickle(e)) is not None:
            raise ValueError(f"{path} was refused: its pickle holds {refused}, which is not plain data, and "
                             f"unpickling it could run code, so it will not be loaded. {fix}") from e
        raise ValueError(f"{path} could not be read as {what} ({reason(e)}); it is truncated, corrupt or not a "
                         "torch file.") from e


def unsafe_pickle(e: BaseException) -> str | None:
    """What torch.load(weights_only=True) refused ("the global posix.system"), if that is why it raised (its advice
    to load the file anyway is never repeated)."""
    if not str(e).startswith("Weights only load failed"):
        return None
    named = re.search(r"GLOBAL (\S+)", str(e))
    return f"the global {named.group(1)}" if named else "something torch's weights-only unpickler does not allow"

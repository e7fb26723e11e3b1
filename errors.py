"""The one error type for mistakes a user can fix (a bad flag, a missing file), and how entry points report it:
one paragraph and exit status 2, without a traceback. Any other exception is a bug and keeps its traceback.
Also the one check every entry point makes first: that the installed PyTorch is one this code supports."""

import re
import sys
from collections.abc import Callable

import torch

MIN_TORCH = (2, 11)  # FSDP2's fully_shard, torch.OutOfMemoryError, MemTracker, init_process_group(device_id=...)


class UserError(Exception):
    """A problem the user can fix. The message is one paragraph that names the file or flag and the fix."""


def check_torch_version(version: str) -> None:
    """UserError unless torch `version` (e.g. "2.12.0+cu128", "2.11.0a0+git1234") is MIN_TORCH or newer."""
    major, minor = (int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups())
    if (major, minor) < MIN_TORCH:
        needed = ".".join(map(str, MIN_TORCH))
        raise UserError(f"PyTorch {version} is too old: this code needs torch >= {needed} (tested with 2.13). "
                        f"Load a newer PyTorch (cluster module, container image), or install one: `pip install "
                        f"'torch>={needed}'`, or `bash quickstart.sh`, which installs the pinned versions into .venv.")


def run_entry_point(main: Callable[[], None]) -> None:
    """Call main(); a UserError becomes `error: <message>` on stderr and exit status 2, with no traceback.

    Under torchrun each rank that meets the error prints it; the checks that raise one run on every rank (or agree
    through a collective first), so no rank is left waiting for a peer that has gone.
    """
    try:
        check_torch_version(torch.__version__)
        main()
    except UserError as e:
        # One write, newline included: print() writes the two apart, and where stderr is unbuffered
        # (PYTHONUNBUFFERED, as under many launchers) two ranks' messages could run into one line.
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)


# Also on import: this is the first of our modules each entry point loads (config -> dataloader -> errors), before
# the ones that import newer torch APIs at their top (parallel: fully_shard), where an older torch would fail with
# an ImportError before run_entry_point could say why.
run_entry_point(lambda: None)

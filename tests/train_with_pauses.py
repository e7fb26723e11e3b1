"""train_gpt2.py that pauses at chosen calls, for tests that act on a real run (a signal, a truncated shard) at a
known point of it instead of a guessed moment.

    PAUSES='[["forward", 3], ["torch_save", 1]]' python tests/train_with_pauses.py ARGS...

Before the n-th call of a function named in HOOKS, the process creates paused_<name>_<n>_rank<RANK> in its working
directory (the log directory, under helpers_train.start_train), waits until the test deletes it (at most 5 minutes),
then makes the call. Signals that arrive meanwhile are handled as anywhere else.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project root, as conftest.py does

import train_gpt2  # noqa: E402
from dataloader import DistributedDataLoader  # noqa: E402
from model import GPT  # noqa: E402
from rundir import snapshot  # noqa: E402

HOOKS = {"initial_model": train_gpt2, "validation_loss": train_gpt2, "read_ahead": DistributedDataLoader,
         "forward": GPT, "torch_save": snapshot}
PAUSES = {(name, n) for name, n in json.loads(os.environ["PAUSES"])}


def pausing(name: str, real):
    calls = 0

    def call(*args, **kwargs):
        nonlocal calls
        calls += 1
        if (name, calls) in PAUSES:
            marker = Path(f"paused_{name}_{calls}_rank{os.environ.get('RANK', 0)}")
            marker.touch()
            deadline = time.monotonic() + 300
            while marker.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        return real(*args, **kwargs)

    return call


for hooked_name, owner in HOOKS.items():
    setattr(owner, hooked_name, pausing(hooked_name, getattr(owner, hooked_name)))

if __name__ == "__main__":
    train_gpt2.command_line(sys.argv[1:])

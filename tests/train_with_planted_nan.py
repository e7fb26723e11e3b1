"""train_gpt2.py with a NaN planted in the loss of chosen batches, for tests that need a real process (torchrun, the
exit status) to diverge at a chosen step rather than wherever a huge learning rate happens to tip it over.

    PLANTED_NAN_BATCHES='[[t0, ..., t7], ...]' [SIGKILL_AT_BATCHES='[[...], ...]'] \
        python tests/train_with_planted_nan.py ARGS...

A micro-batch whose any row starts with one of those 8-token keys gets the loss NaN, wherever and whenever the run
reads it (as in test_guards.plant), on whichever rank reads it: under torchrun the ranks' average is then NaN too.
One that starts with a key of SIGKILL_AT_BATCHES kills the process that reads it, as a crash would.
"""

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project root, as conftest.py does

import train_gpt2  # noqa: E402
from model import GPT  # noqa: E402
from training.errors import run_entry_point  # noqa: E402

KEY_TOKENS = 8
BAD_BATCHES = {tuple(key) for key in json.loads(os.environ["PLANTED_NAN_BATCHES"])}
KILLING_BATCHES = {tuple(key) for key in json.loads(os.environ.get("SIGKILL_AT_BATCHES", "[]"))}
real_forward = GPT.forward


def forward(self, idx, targets=None, **kwargs):
    keys = {tuple(row[:KEY_TOKENS].tolist()) for row in idx}
    if keys & KILLING_BATCHES:
        os.kill(os.getpid(), signal.SIGKILL)
    logits, loss = real_forward(self, idx, targets, **kwargs)
    if loss is not None and keys & BAD_BATCHES:
        loss = loss * float("nan")
    return logits, loss


GPT.forward = forward

if __name__ == "__main__":
    run_entry_point(lambda: train_gpt2.main(sys.argv[1:]))

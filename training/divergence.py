"""When training must not go on as it is. An update that would wreck the weights is skipped (DivergenceGuard: NaN or
inf always, loss and gradient-norm spikes with --skip_zscore); a run that keeps skipping has diverged, and stops or
rolls back to its newest healthy snapshot (train_gpt2.DivergenceResponse, --on_divergence); a SIGTERM, a Ctrl-C or
data that cannot be read asks for a snapshot and a clean stop (StopRequest).

training.train_step asks the guard about every update; train_gpt2.run hands a divergence to the response and polls
the stop request before every step. The guard's state, the rollback count included, goes into snapshots. (Nothing
here knows the snapshots: one training step, which imports this, imports no snapshot store.)
"""

import math
import signal
import statistics
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from training.distributed import from_all_ranks, max_across_ranks


def nonfinite_reason(loss: float, grad_norm: float, fp16: bool) -> str | None:
    """Why an update must not be applied whatever the flags: a NaN or inf loss or gradient norm would put NaN into
    the weights and AdamW's moments, from which no later step recovers. (In fp16 an inf norm with a finite loss is
    the GradScaler's overflow, which it answers by halving the loss scale.)"""
    if not math.isfinite(loss):
        return "non-finite loss"
    if not math.isfinite(grad_norm):
        return "fp16 overflow" if fp16 else "non-finite grad norm"
    return None


class DivergenceGuard:
    """Decides, from a step's global loss and gradient norm, whether its update is applied, and counts the updates
    skipped in a row (DivergenceResponse acts on that count: --on_divergence).

    Always: a non-finite loss or norm is skipped. With zscore > 0 (--skip_zscore), also a spike: a loss or norm more
    than zscore standard deviations above its mean over the last SPIKE_WINDOW applied steps, once SPIKE_WARMUP
    steps have been seen (llm.c skips outliers the same way). Every rank sees the same loss (averaged across ranks)
    and norm (of the all-reduced gradients), so every rank decides the same without a collective of its own. The
    state goes into snapshots, so a resumed run decides as the uninterrupted one would have.
    """

    SPIKE_WINDOW = 100  # steps: long enough for a stable spread, short enough to follow the falling loss
    SPIKE_WARMUP = 20  # steps before the first spike check: the early statistics are noise

    def __init__(self, zscore: float = 0.0):
        self.zscore = zscore
        self.losses: deque[float] = deque(maxlen=self.SPIKE_WINDOW)
        self.grad_norms: deque[float] = deque(maxlen=self.SPIKE_WINDOW)
        self.skips_in_a_row = 0
        self.rollbacks = 0  # of the whole run, kept in snapshots so that a restart does not reset --max_rollbacks

    def review(self, loss: float, grad_norm: float, fp16: bool) -> str | None:
        """The reason to skip this step's update (None: apply it); records the step either way."""
        reason = nonfinite_reason(loss, grad_norm, fp16) or self._spike(loss, grad_norm)
        if reason is None:
            self.losses.append(loss)
            self.grad_norms.append(grad_norm)
        self.skips_in_a_row = self.skips_in_a_row + 1 if reason else 0
        return reason

    def _spike(self, loss: float, grad_norm: float) -> str | None:
        if not self.zscore or len(self.losses) < self.SPIKE_WARMUP:
            return None
        for name, value, recent in (("loss", loss, self.losses), ("grad norm", grad_norm, self.grad_norms)):
            spread = statistics.pstdev(recent)
            z = (value - statistics.fmean(recent)) / spread if spread else 0.0
            if z > self.zscore:
                return f"{name} spike z={z:.1f}"
        return None

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms),
                "skips_in_a_row": self.skips_in_a_row, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        self.losses = deque(state["losses"], maxlen=self.SPIKE_WINDOW)
        self.grad_norms = deque(state["grad_norms"], maxlen=self.SPIKE_WINDOW)
        self.skips_in_a_row = state["skips_in_a_row"]
        self.rollbacks = state["rollbacks"]


class StopRequest:
    """Why every rank stops between two steps, with a snapshot: SIGTERM (a preemption, torchrun stopping workers), a
    first Ctrl-C (SIGINT), or a rank that cannot read the next step's data or the validation's (a shard changed,
    deleted or cut short under the run: dataloader.ShardWatch).

    train_gpt2.main makes `request` the SIGTERM and SIGINT handler (handling_signals); it only records the signal,
    but a second SIGINT raises KeyboardInterrupt: the user asked twice, so the run aborts at once (a snapshot being
    written is removed, files.atomic_write). Ranks agree on a request (a collective) before every step and every few
    batches of an evaluation, so they all stop at the same point and write the snapshot within a step of it.

    Under torchrun the workers do not get the terminal's Ctrl-C (torchrun starts each in a session of its own):
    torchrun gets it and sends each worker one SIGINT, so one Ctrl-C is one graceful stop on every rank. A second
    Ctrl-C makes torchrun send SIGTERM, which changes nothing; it SIGKILLs workers still running 30 s after the last
    (its --shutdown_timeout).
    """

    DATA_FAILURE = 1000  # above any signal number: a failed read ends the run with its error, whatever else asked

    def __init__(self):
        self.signal: signal.Signals | None = None  # the first signal this rank got
        self.failure: str | None = None  # this rank's error reading the data
        self.reason: str | None = None  # once agreed(): why the ranks stop ("SIGTERM", "SIGINT", "data")

    @property
    def requested(self) -> bool:
        return self.signal is not None or self.failure is not None

    def request(self, signum: int, frame=None) -> None:
        if signum == signal.SIGINT and self.signal == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = self.signal or signal.Signals(signum)

    def data_failed(self, error: Exception) -> None:
        self.failure = str(error)

    @contextmanager
    def handling_signals(self) -> Iterator[None]:
        """`request` handles SIGTERM and SIGINT in the block; the handlers from before are back after it."""
        previous = {each: signal.signal(each, self.request) for each in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for each, handler in previous.items():
                signal.signal(each, handler)

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop; then `reason` says why, the same on every rank, and for a failed read
        `failure` is the first failing rank's error on every rank. A collective: every rank must call it."""
        mine = self.DATA_FAILURE if self.failure else (self.signal or 0)
        agreed = max_across_ranks(mine, device)
        if agreed == self.DATA_FAILURE:
            self.reason = "data"
            self.failure = next(failure for failure in from_all_ranks(self.failure) if failure)
        elif agreed:
            self.reason = signal.Signals(agreed).name
        return bool(agreed)

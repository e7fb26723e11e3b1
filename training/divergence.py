"""When training must not go on as it is (docs/reliability.md): an update that would wreck the weights is skipped
(DivergenceGuard); a run asked to stop (a signal, unreadable data) stops between two steps (StopRequest)."""

import math
import signal
import statistics
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from training.distributed import from_all_ranks, max_across_ranks


class DivergenceGuard:
    """Whether a step's update is applied, from its loss and grad norm (the same on every rank: no collective), and
    the skips in a row (--on_divergence). A non-finite loss or norm is always skipped (NaN weights never recover);
    with --skip_zscore also a spike."""

    SPIKE_WINDOW = 100  # steps: long enough for a stable spread, short enough to follow the falling loss
    SPIKE_WARMUP = 20  # steps before the first spike check: the early statistics are noise

    def __init__(self, zscore: float = 0.0):
        self.zscore = zscore
        self.losses: deque[float] = deque(maxlen=self.SPIKE_WINDOW)
        self.grad_norms: deque[float] = deque(maxlen=self.SPIKE_WINDOW)
        self.skips_in_a_row = 0
        self.rollbacks = 0  # of the whole run, kept in snapshots so that a restart does not reset --max_rollbacks

    def review(self, loss: float, grad_norm: float, fp16: bool) -> str | None:
        """The reason to skip this step's update (None: apply it); records the step either way. (In fp16 an inf norm
        with a finite loss is the GradScaler's overflow: it halves the loss scale.)"""
        if not math.isfinite(loss):
            reason = "non-finite loss"
        elif not math.isfinite(grad_norm):
            reason = "fp16 overflow" if fp16 else "non-finite grad norm"
        else:
            reason = self._spike(loss, grad_norm)
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
    """Why every rank stops between two steps, with a snapshot: SIGTERM, a first Ctrl-C, or a rank that cannot read
    its data (a second SIGINT aborts at once). The ranks agree (a collective) before each step and during evals."""

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
        previous = {each: signal.signal(each, self.request) for each in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for each, handler in previous.items():
                signal.signal(each, handler)

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop; then `reason` (and for a failed read `failure`, the first failing
        rank's error) is the same on every rank. A collective: every rank must call it."""
        mine = self.DATA_FAILURE if self.failure else (self.signal or 0)
        agreed = max_across_ranks(mine, device)
        if agreed == self.DATA_FAILURE:
            self.reason = "data"
            self.failure = next(failure for failure in from_all_ranks(self.failure) if failure)
        elif agreed:
            self.reason = signal.Signals(agreed).name
        return bool(agreed)

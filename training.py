"""One optimizer step, and the guard that refuses bad updates: shared by train_gpt2.py and bench.py."""

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from dataloader import DistributedDataLoader
from distributed import average_across_ranks, to_device
from optim import Optimizers
from parallel import set_gradient_sync
from precision import autocast


@dataclass
class StepResult:
    loss: float  # mean over the whole batch, averaged across ranks
    grad_norm: float  # before clipping, over the whole model (the same on every rank)
    skip_reason: str | None  # why the update was not applied ("non-finite loss", ...), None if it was
    data_seconds: float  # time spent waiting for the data loader

    @property
    def skipped(self) -> bool:
        return self.skip_reason is not None


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
    skipped in a row (train_gpt2.py acts on that count: --on_divergence).

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
        self.rollbacks = state.get("rollbacks", 0)  # (snapshots from before the count was kept)


def train_step(model: torch.nn.Module, optimizer: Optimizers, scaler: torch.amp.GradScaler,
               loader: DistributedDataLoader, grad_accum_steps: int, lr: float, grad_clip: float,
               device: torch.device, dtype: torch.dtype, guard: DivergenceGuard | None = None) -> StepResult:
    """One optimizer update on total_batch_size tokens, accumulated over grad_accum_steps micro-steps; not applied
    if the loss or gradient norm is non-finite, or if `guard` says it is a spike."""
    model.train()
    optimizer.set_lr(lr)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    data_seconds = 0.0
    for micro_step in range(grad_accum_steps):
        t0 = time.perf_counter()
        x, y = to_device(*loader.next_batch(), device)
        data_seconds += time.perf_counter() - t0
        # Gradients are reduced across ranks only after the last micro-step: the earlier backward passes just add
        # into .grad locally.
        set_gradient_sync(model, micro_step == grad_accum_steps - 1)
        with autocast(device, dtype):
            _, loss = model(x, y)
        # Each micro-loss is a mean over its B·T tokens; dividing by the number of micro-steps makes the summed
        # gradients the gradient of the mean over the whole batch, not their sum.
        loss = loss / grad_accum_steps
        loss_sum += loss.detach()
        scaler.scale(loss).backward()
    for each in optimizer:  # the GradScaler works on real optimizers: AdamW, and Muon with --optimizer muon
        scaler.unscale_(each)  # clip the true gradients, not the fp16-scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if isinstance(grad_norm, DTensor):  # fsdp: the norm over every rank's shards
        grad_norm = grad_norm.full_tensor()
    # The norm rides along with the loss's average: it is already the same on every rank, and this way the
    # decision below is taken on the very same numbers everywhere, at no extra collective.
    loss, grad_norm = average_across_ranks(torch.stack([loss_sum, grad_norm.float()])).tolist()
    fp16 = scaler.is_enabled()
    reason = guard.review(loss, grad_norm, fp16) if guard else nonfinite_reason(loss, grad_norm, fp16)
    if reason is None:  # all optimizers step or none (AdamW, and Muon with --optimizer muon)
        for each in optimizer:
            scaler.step(each)
    # In fp16 the scaler saw the inf gradients in unscale_ and halves its scale, as if its own step had skipped.
    scaler.update()
    return StepResult(loss, grad_norm, reason, data_seconds)

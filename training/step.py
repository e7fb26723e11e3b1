"""One optimizer step, train_gpt2.py's and bench.py's; whether its update is applied is the divergence guard's call."""

import time
from dataclasses import dataclass

import torch

from dataloader import DistributedDataLoader
from training.distributed import average_across_ranks, is_dtensor, to_device
from training.divergence import DivergenceGuard
from training.optim import Optimizers
from training.parallel import set_gradient_sync
from training.precision import autocast


@dataclass
class StepResult:
    loss: float  # mean over the whole batch, averaged across ranks
    grad_norm: float  # before clipping, over the whole model (the same on every rank)
    skip_reason: str | None  # why the update was not applied ("non-finite loss", ...), None if it was
    data_seconds: float  # time spent waiting for the data loader

    @property
    def skipped(self) -> bool:
        return self.skip_reason is not None


def train_step(model: torch.nn.Module, optimizer: Optimizers, scaler: torch.amp.GradScaler,
               loader: DistributedDataLoader, grad_accum_steps: int, lr: float, grad_clip: float,
               device: torch.device, dtype: torch.dtype, guard: DivergenceGuard | None = None,
               muon_momentum: float | None = None, row_length: int | None = None) -> StepResult:
    """One update, accumulated over grad_accum_steps micro-steps; not applied if the loss or gradient norm is
    non-finite, or if `guard` says so. muon_momentum: this step's, if scheduled; row_length: --short_rows."""
    model.train()
    optimizer.set_lr(lr)
    if muon_momentum is not None:
        optimizer.set_muon_momentum(muon_momentum)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    data_seconds = 0.0
    for micro_step in range(grad_accum_steps):
        t0 = time.perf_counter()
        x, y = to_device(*loader.next_batch(), device)
        if row_length is not None:
            x, y = x.reshape(-1, row_length), y.reshape(-1, row_length)
        data_seconds += time.perf_counter() - t0
        # Gradients are reduced across ranks only in the last micro-step's backward: the earlier ones add locally.
        set_gradient_sync(model, micro_step == grad_accum_steps - 1)
        with autocast(device, dtype):
            _, loss = model(x, y)
        loss = loss / grad_accum_steps  # the summed gradients: of the mean over the whole batch
        loss_sum += loss.detach()
        scaler.scale(loss).backward()
    for each in optimizer:  # the GradScaler works on real optimizers: AdamW, and Muon with --optimizer muon
        scaler.unscale_(each)  # clip the true gradients, not the fp16-scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if is_dtensor(grad_norm):  # fsdp: the norm over every rank's shards
        grad_norm = grad_norm.full_tensor()
    # The norm (the same on every rank) rides along: the decision is taken on the same numbers everywhere.
    loss, grad_norm = average_across_ranks(torch.stack([loss_sum, grad_norm.float()])).tolist()
    reason = (guard or DivergenceGuard()).review(loss, grad_norm, fp16=scaler.is_enabled())
    if reason is None:  # all optimizers step or none (AdamW, and Muon with --optimizer muon)
        for each in optimizer:
            scaler.step(each)
    # In fp16 the scaler saw the inf gradients in unscale_ and halves its scale, as if its own step had skipped.
    scaler.update()
    return StepResult(loss, grad_norm, reason, data_seconds)

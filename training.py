"""One optimizer step: shared by train_gpt2.py and bench.py."""

import time
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
    grad_norm: float  # before clipping
    skipped: bool  # fp16 only: the GradScaler found inf/NaN gradients and skipped the update
    data_seconds: float  # time spent waiting for the data loader


def train_step(model: torch.nn.Module, optimizer: Optimizers, scaler: torch.amp.GradScaler,
               loader: DistributedDataLoader, grad_accum_steps: int, lr: float, grad_clip: float,
               device: torch.device, dtype: torch.dtype) -> StepResult:
    """One optimizer update on total_batch_size tokens, accumulated over grad_accum_steps micro-steps."""
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
    scale_before = scaler.get_scale()
    # All optimizers step or none: the GradScaler would decide for each from its own gradients alone, and one whose
    # gradients were finite would step on the zeros that clipping by an inf norm leaves.
    if not (scaler.is_enabled() and not torch.isfinite(grad_norm)):
        for each in optimizer:
            scaler.step(each)
    scaler.update()
    skipped = scaler.is_enabled() and scaler.get_scale() < scale_before
    return StepResult(average_across_ranks(loss_sum).item(), grad_norm.item(), skipped, data_seconds)

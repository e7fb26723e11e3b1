"""The validation loss: the same numbers whether a training run logs them or a script evaluates a snapshot."""

import torch

from dataloader import DistributedDataLoader
from distributed import average_across_ranks, to_device
from precision import autocast

# A stop check is a collective and a device sync: often enough that a long evaluation notices SIGTERM within
# seconds (torchrun and SLURM give 30 s before SIGKILL), rarely enough to cost nothing.
VAL_STOP_CHECK_EVERY = 16


@torch.no_grad()
def validation_loss(model: torch.nn.Module, loader: DistributedDataLoader, steps: int, device: torch.device,
                    dtype: torch.dtype, should_stop=lambda: False) -> float | None:
    """Mean loss over `steps` micro-batches from the start of the val shards; None if should_stop() said so."""
    model.eval()
    loader.reset()
    loss_sum = torch.zeros((), device=device)
    for i in range(steps):
        if i % VAL_STOP_CHECK_EVERY == 0 and i > 0 and should_stop():
            return None
        x, y = to_device(*loader.next_batch(), device)
        with autocast(device, dtype):
            _, loss = model(x, y)
        loss_sum += loss.detach()
    return average_across_ranks(loss_sum / steps).item()

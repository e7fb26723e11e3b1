"""The validation loss, and bits per byte: the same numbers whether a training run logs them or a script evaluates a
snapshot."""

import functools
import math
import sys
from dataclasses import dataclass

import torch

from dataloader import DistributedDataLoader
from distributed import average_across_ranks, to_device
from precision import autocast
from tokenizer import gpt2_encoding

# A stop check is a collective and a device sync: often enough that a long evaluation notices SIGTERM within
# seconds (torchrun and SLURM give 30 s before SIGKILL), rarely enough to cost nothing.
VAL_STOP_CHECK_EVERY = 16


@dataclass(frozen=True)
class Validation:
    loss: float  # mean cross-entropy per target token, in nats
    bpb: float | None  # bits per UTF-8 byte of the target text: the same nats per byte instead of per token, in
    #                    bits; unlike the loss it does not depend on the tokenizer, so models with other vocabularies
    #                    compare. None where the GPT-2 tokenizer cannot be loaded (offline, no tiktoken cache)


@functools.cache
def token_byte_lengths() -> torch.Tensor | None:
    """(vocab,) the number of UTF-8 bytes each GPT-2 token id stands for. <|endoftext|> counts 0: it marks where a
    document ends and is no part of the text (its loss, predicting that end, still counts). None, with a warning
    once, where tiktoken cannot load the tokenizer: bits per byte are a metric, not a reason to stop a run."""
    try:
        enc = gpt2_encoding()
    except Exception as e:  # tiktoken downloads the GPT-2 files on first use: anything from DNS to HTTP errors
        print(f"WARNING: val_bpb is left out: the GPT-2 tokenizer could not be loaded ({type(e).__name__}). On a node "
              "without network, set TIKTOKEN_CACHE_DIR to a copy of tiktoken's cache of it.", file=sys.stderr)
        return None
    lengths = torch.tensor([len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)])
    lengths[enc.eot_token] = 0
    return lengths


@torch.no_grad()
def validation_loss(model: torch.nn.Module, loader: DistributedDataLoader, steps: int, device: torch.device,
                    dtype: torch.dtype, should_stop=lambda: False) -> Validation | None:
    """Loss and bits per byte over `steps` micro-batches from the start of the val shards; None if should_stop()
    said so."""
    model.eval()
    loader.reset()
    byte_lengths = token_byte_lengths()
    byte_lengths = byte_lengths.to(device) if byte_lengths is not None else None
    loss_sum = torch.zeros((), device=device)
    bytes_sum = torch.zeros((), dtype=torch.long, device=device)
    for i in range(steps):
        if i % VAL_STOP_CHECK_EVERY == 0 and i > 0 and should_stop():
            return None
        x, y = to_device(*loader.next_batch(), device)
        with autocast(device, dtype):
            _, loss = model(x, y)
        loss_sum += loss.detach()
        if byte_lengths is not None:
            bytes_sum += byte_lengths[y].sum()
    # Every micro-batch on every rank has the same number of tokens, so the means over ranks make the totals' ratio.
    # (Both collectives always run, so that every rank joins them.)
    loss = average_across_ranks(loss_sum / steps).item()
    bytes_per_token = average_across_ranks(bytes_sum.float() / (steps * y.numel())).item()
    return Validation(loss, loss / math.log(2) / bytes_per_token if byte_lengths is not None else None)

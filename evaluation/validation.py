"""The validation loss, and bits per byte: the same numbers whether a training run logs them or a script evaluates a
snapshot."""

import functools
import math
import sys
from dataclasses import dataclass

import torch

from dataloader import DistributedDataLoader, ShardReadError
from training.distributed import any_rank, average_across_ranks, from_all_ranks, to_device
from training.precision import autocast
from training.tokenizer import TokenizerSpec, gpt2_spec, tokenizer_from_spec

# A stop check is a collective and a device sync: often enough that a long evaluation notices SIGTERM within
# seconds (torchrun and SLURM give 30 s before SIGKILL), rarely enough to cost nothing.
VAL_STOP_CHECK_EVERY = 16


@dataclass(frozen=True)
class Validation:
    loss: float  # mean cross-entropy per target token, in nats
    bpb: float | None  # bits per UTF-8 byte of the targets' text, which compares across tokenizers. None where the
    #                    tokenizer cannot be loaded (offline), or the targets have no bytes (only <|endoftext|>)


@functools.cache
def token_byte_lengths(tokenizer: TokenizerSpec | None = None) -> torch.Tensor | None:
    """(vocab,) the UTF-8 bytes each token id of `tokenizer` (None: GPT-2's) stands for, <|endoftext|> 0 (no text);
    None, with a warning, where the tokenizer cannot be loaded (offline): a metric is no reason to stop a run."""
    spec = tokenizer or gpt2_spec()
    try:
        loaded = tokenizer_from_spec(spec)
    except Exception as e:  # tiktoken downloads an encoding's files on first use: anything from DNS to HTTP errors
        print(f"WARNING: val_bpb is left out: the tokenizer {spec.describe()} could not be loaded "
              f"({type(e).__name__}). On a node without network, set TIKTOKEN_CACHE_DIR to a copy of tiktoken's cache "
              "of it.", file=sys.stderr)
        return None
    return torch.tensor(loaded.token_byte_lengths())


@torch.no_grad()
def validation_loss(model: torch.nn.Module, loader: DistributedDataLoader, steps: int, device: torch.device,
                    dtype: torch.dtype, should_stop=lambda: False) -> Validation | None:
    """Loss and bits per byte over `steps` micro-batches from the start of the val shards; None if should_stop().
    A rank's ShardReadError is raised on all ranks at the next stop check or the end (joining collectives meanwhile)."""
    model.eval()
    failure: ShardReadError | None = None

    def attempt(read):  # read()'s result, or None once a read on this rank has failed
        nonlocal failure
        if failure is None:
            try:
                return read()
            except ShardReadError as e:
                failure = e
        return None

    attempt(loader.reset)
    byte_lengths = token_byte_lengths(loader.tokenizer)
    byte_lengths = byte_lengths.to(device) if byte_lengths is not None else None
    loss_sum = torch.zeros((), device=device)
    bytes_sum = torch.zeros((), dtype=torch.long, device=device)
    for i in range(steps):
        if i % VAL_STOP_CHECK_EVERY == 0 and i > 0:
            raise_on_every_rank(failure, device)
            if should_stop():
                return None
        batch = attempt(loader.next_batch)
        if batch is None:  # this rank's read failed: it still runs the forward, on zeros, since under FSDP the
            # forward is a collective (its all-gathers) that the other ranks would wait in until the next check
            batch = (torch.zeros(loader.B, loader.T, dtype=torch.long),) * 2
        x, y = to_device(*batch, device)
        with autocast(device, dtype):
            _, loss = model(x, y)
        loss_sum += loss.detach()
        if byte_lengths is not None:
            bytes_sum += byte_lengths[y].sum()
    attempt(loader.check_unchanged)  # no val shard changed while it was read
    raise_on_every_rank(failure, device)
    # Every rank's micro-batches have the same number of tokens: the means over ranks make the totals' ratio.
    # (Both collectives always run, so that every rank joins them.)
    loss = average_across_ranks(loss_sum / steps).item()
    bytes_per_token = average_across_ranks(bytes_sum.float() / (steps * y.numel())).item()
    if byte_lengths is None:
        return Validation(loss, None)
    if bytes_per_token == 0:  # (the same on every rank: the mean over ranks)
        warn_once("WARNING: val_bpb is left out: the validation's targets hold no text, only <|endoftext|> (its "
                  "documents are empty), so there are no bytes to count bits per. Its loss still counts.")
        return Validation(loss, None)
    return Validation(loss, loss / math.log(2) / bytes_per_token)


def validation_record(results: dict[str, Validation]) -> dict[str, float]:
    """metrics.jsonl's keys of a validation of each source, by name: val_loss and val_bpb, their means over the sources
    (unweighted: the same average before and after an --anneal_mix), and of several, val/<name>/loss and /bpb."""
    losses, bpbs = [val.loss for val in results.values()], [val.bpb for val in results.values()]
    record = {"val_loss": sum(losses) / len(losses)} | ({"val_bpb": sum(bpbs) / len(bpbs)} if None not in bpbs else {})
    for name, val in results.items() if len(results) > 1 else ():
        record |= {f"val/{name}/loss": val.loss} | ({f"val/{name}/bpb": val.bpb} if val.bpb is not None else {})
    return record


@functools.cache  # once a process: a run validates hundreds of times
def warn_once(message: str) -> None:
    print(message, file=sys.stderr)


def raise_on_every_rank(failure: ShardReadError | None, device: torch.device) -> None:
    """Raise the first failing rank's ShardReadError on every rank, if any rank has one (a collective: every rank
    must call it)."""
    if any_rank(failure is not None, device):
        raise ShardReadError(next(message for message in from_all_ranks(failure and str(failure)) if message))

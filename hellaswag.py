"""HellaSwag evaluation, completion style (as in llm.c's dev/data/hellaswag.py and build-nanogpt).

Each example is a context and 4 candidate endings. The model reads the context followed by " " + ending and
the ending with the lowest mean cross-entropy over its own tokens is its answer (acc_norm; acc uses the total
instead of the mean, which favours short endings). The validation set (10,042 examples) is downloaded on first
use to data/hellaswag_cache/, or read from --hellaswag_path.

Expected: GPT-2 124M scores acc_norm 0.2955 (acc 0.2859), gpt2-xl acc_norm 0.4893. EleutherAI's harness
renders the task as multiple choice and reports higher numbers (31.14% for 124M), so don't compare across styles.
Used by training (--hellaswag_every), evaluate.py --hellaswag, and standalone: `python -m tools.hellaswag`.
"""

import hashlib
import json
import math
import urllib.request
from collections.abc import Callable
from pathlib import Path

import tiktoken
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from distributed import any_rank
from errors import UserError
from files import atomic_write
from precision import autocast
from tokenizer import gpt2_encoding

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
SHA256 = "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"
CACHE_DIR = Path(__file__).resolve().parent / "data" / "hellaswag_cache"
FILE_NAME = "hellaswag_val.jsonl"


def download(path: Path) -> None:
    """Fetch the validation set to `path`, atomically: a crash, or another node writing the same shared file, never
    leaves a partial file. Raises UserError, one paragraph, if there is no network."""
    print(f"downloading {URL} to {path}")
    try:
        with urllib.request.urlopen(URL, timeout=60) as response:
            data = response.read()
    except OSError as e:
        raise UserError(f"could not download HellaSwag from {URL} ({e}); this node seems to have no network. "
                        "Download hellaswag_val.jsonl on a machine that has, copy it here and pass it with "
                        "--hellaswag_path, or turn HellaSwag off with --hellaswag_every 0.") from e
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise UserError(f"the file downloaded from {URL} is not the HellaSwag validation set (sha256 mismatch); "
                        "download it by hand and pass it with --hellaswag_path, or turn HellaSwag off with "
                        "--hellaswag_every 0.")
    atomic_write(path, lambda f: f.write(data))


def load_examples(path: str | None = None, limit: int | None = None) -> list[dict]:
    """The raw jsonl rows of the validation set (the first `limit` if given); path None downloads it once."""
    file = CACHE_DIR / FILE_NAME if path is None else Path(path)
    if path is None and not file.exists():
        download(file)
    if not file.is_file():
        raise UserError(f"HellaSwag file {file} does not exist. Point --hellaswag_path at the validation set "
                        f"(hellaswag_val.jsonl, from {URL}), leave the flag out to download it to {CACHE_DIR}, or "
                        "turn HellaSwag off with --hellaswag_every 0.")
    examples = []
    with open(file, "rb") as f:
        for number, line in enumerate(f, start=1):
            if limit is not None and len(examples) == limit:
                break
            line = line.strip()
            if not line:
                continue
            try:
                example = json.loads(line)
            except json.JSONDecodeError as e:
                problem = f"not JSON ({e.msg} at column {e.colno})"
            except UnicodeDecodeError:
                problem = "not UTF-8 text"
            else:
                problem = what_is_wrong(example)
            if problem:
                raise UserError(f"{file}, line {number}: {problem}. A HellaSwag example is a JSON object with a ctx, "
                                "4 endings and a label 0-3, one a line. Point --hellaswag_path at the validation set "
                                f"(hellaswag_val.jsonl, from {URL}), or turn HellaSwag off with --hellaswag_every 0.")
            examples.append(example)
    return examples


def what_is_wrong(example) -> str | None:
    """Why a parsed line is no HellaSwag example that render_example and the scoring can use; None if it is one."""
    if not isinstance(example, dict):
        return "not a JSON object"
    if not isinstance(example.get("ctx"), str):
        return "no ctx (the context, a string)"
    endings = example.get("endings")
    if not isinstance(endings, list) or not all(isinstance(ending, str) for ending in endings):
        return "no endings (a list of 4 strings)"
    if len(endings) != 4:
        return f"{len(endings)} endings, not 4"
    if "label" not in example:
        return "no label (HellaSwag's test split has none: use its validation set)"
    if example["label"] not in range(4):
        return f"label {example['label']!r}, not one of 0-3"
    return None


def render_example(example: dict, enc: tiktoken.Encoding, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (4, T): context + " " + ending, one row per ending, right-padded with 0; mask (4, T): True on the
    ending's tokens. A row longer than block_size loses tokens from the left, so its ending is always kept."""
    ctx = enc.encode_ordinary(example["ctx"])
    endings = [enc.encode_ordinary(" " + ending) for ending in example["endings"]]
    rows = [(ctx + ending)[-block_size:] for ending in endings]
    T = max(len(row) for row in rows)
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (row, ending) in enumerate(zip(rows, endings)):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, max(len(row) - len(ending), 0): len(row)] = True
    return tokens, mask


def ending_losses(model: torch.nn.Module, tokens: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Total and mean cross-entropy of each row's ending tokens, each (4,)."""
    logits = model(tokens)[0][:, :-1]  # position t predicts token t+1
    targets, mask = tokens[:, 1:], mask[:, 1:]
    # Only the ending tokens go through the vocabulary-wide softmax: they are a few of each row's T tokens.
    losses = torch.zeros(targets.shape, device=targets.device)
    losses[mask] = F.cross_entropy(logits[mask].float(), targets[mask], reduction="none")
    total = losses.sum(dim=1)
    return total, total / mask.sum(dim=1)


# A stop check is a collective: every this many examples, so that SIGTERM during a full evaluation (10,042 examples,
# minutes on one GPU) is noticed within seconds, at the cost of a few hundred tiny all_reduces.
STOP_CHECK_EVERY = 16


def accuracies(model: torch.nn.Module, examples: list[dict], device: str, dtype: torch.dtype = torch.float32,
               rank: int = 0, world_size: int = 1, progress: bool = False,
               should_stop: Callable[[], bool] | None = None) -> dict[str, float] | None:
    """acc and acc_norm over all examples; see evaluate."""
    enc = gpt2_encoding()
    hits = torch.zeros(2, dtype=torch.long, device=device)  # [acc_norm, acc]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(device, dtype):
            # Every rank goes round the same number of times (a rank whose share is one shorter skips its last
            # turn), so the stop checks, a collective, happen at the same points on all of them.
            for turn in tqdm(range(math.ceil(len(examples) / world_size)), desc="hellaswag", disable=not progress):
                if should_stop is not None and turn % STOP_CHECK_EVERY == 0 and turn > 0 and should_stop():
                    return None
                index = turn * world_size + rank
                if index >= len(examples):
                    continue
                example = examples[index]
                tokens, mask = render_example(example, enc, model.config.block_size)
                total, mean = ending_losses(model, tokens.to(device), mask.to(device))
                hits += torch.stack([mean.argmin() == example["label"], total.argmin() == example["label"]])
    finally:
        model.train(was_training)
    counts = torch.cat([hits, torch.tensor([len(examples[rank::world_size])], device=device)])
    if world_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    correct_norm, correct, n = counts.tolist()
    return {"acc_norm": correct_norm / n, "acc": correct / n}


def evaluate(model: torch.nn.Module, examples: list[dict], device: str, dtype: torch.dtype = torch.float32,
             rank: int = 0, world_size: int = 1, should_stop: Callable[[], bool] | None = None) -> float | None:
    """acc_norm over ALL examples. Rank r scores examples r, r+W, ... and the counts are summed across ranks, so
    every rank returns the same number. `model` is a plain GPT (not compiled or DDP-wrapped); its train/eval mode
    is restored afterwards. dtype is the autocast dtype (torch.float32: none).

    should_stop, if given, is called every STOP_CHECK_EVERY examples on every rank (in training it is a collective
    that agrees on a SIGTERM); when it returns True the evaluation ends at once and returns None."""
    result = accuracies(model, examples, device, dtype, rank, world_size, should_stop=should_stop)
    return None if result is None else result["acc_norm"]


def load_examples_distributed(path: str | None, limit: int | None, local_rank: int,
                              device: torch.device) -> list[dict]:
    """load_examples for a training run: with no path, local rank 0 of each node downloads the file if it is not
    cached yet (the other ranks would fetch the same bytes), then all ranks agree on whether that worked (a
    collective, so that no rank is left waiting for one that failed) before they read it. A failed download is a
    UserError on every rank, with the failing rank's reason, so whichever rank's output a user reads says why."""
    reason = None
    if path is None and local_rank == 0 and not (CACHE_DIR / FILE_NAME).exists():
        try:
            download(CACHE_DIR / FILE_NAME)
        except UserError as e:
            reason = str(e)
    if any_rank(reason is not None, device):
        if not dist.is_initialized():
            raise UserError(reason)
        reasons = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, reason)  # only on failure: the reason is text, not a tensor
        rank, reason = next((r, text) for r, text in enumerate(reasons) if text is not None)
        raise UserError(f"rank {rank} (local rank 0 of its node): {reason}")
    return load_examples(path, limit)

"""HellaSwag evaluation, completion style (as in llm.c's dev/data/hellaswag.py and build-nanogpt).

Each example is a context and 4 candidate endings. The model reads the context followed by " " + ending and
the ending with the lowest mean cross-entropy over its own tokens is its answer (acc_norm; acc uses the total
instead of the mean, which favours short endings). The validation set (10,042 examples) is downloaded on first
use to data/hellaswag_cache/, or read from --hellaswag_path.

Expected: GPT-2 124M scores acc_norm 0.2955 (acc 0.2859), gpt2-xl acc_norm 0.4893. EleutherAI's harness
renders the task as multiple choice and reports higher numbers (31.14% for 124M), so don't compare across styles.

    python data/hellaswag.py --model gpt2                  # Hugging Face GPT-2 (a hub name or a local directory)
    python data/hellaswag.py --ckpt logs/snapshot_0019072.pt   # a snapshot of this codebase
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `import model` when run as a script

import argparse
import hashlib
import json
import os
import urllib.request

import tiktoken
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from model import GPT
from sample import default_device

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
SHA256 = "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"
CACHE_DIR = Path(__file__).resolve().parent / "hellaswag_cache"


def download(path: Path) -> None:
    """Fetch the validation set to `path`, atomically: concurrent ranks or a crash never leave a partial file."""
    print(f"downloading {URL} to {path}")
    try:
        with urllib.request.urlopen(URL) as response:
            data = response.read()
    except OSError as e:
        raise RuntimeError(f"could not download HellaSwag from {URL} ({e}). Without network access, download "
                           "hellaswag_val.jsonl elsewhere and pass it with --hellaswag_path.") from e
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise RuntimeError(f"the file downloaded from {URL} is not the HellaSwag validation set (sha256 mismatch); "
                           "download it by hand and pass it with --hellaswag_path.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process, so ranks don't write into each other
    tmp.write_bytes(data)
    os.replace(tmp, path)


def load_examples(path: str | None = None, limit: int | None = None) -> list[dict]:
    """The raw jsonl rows of the validation set (the first `limit` if given); path None downloads it once."""
    if path is None:
        file = CACHE_DIR / "hellaswag_val.jsonl"
        if not file.exists():
            download(file)
    else:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"HellaSwag file {file} does not exist. Point --hellaswag_path at the validation "
                                    f"set (hellaswag_val.jsonl, from {URL}), or leave the flag out to download it "
                                    f"to {CACHE_DIR}.")
    examples = []
    with open(file, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(examples) == limit:
                break
            if line.strip():
                examples.append(json.loads(line))
    return examples


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


def accuracies(model: torch.nn.Module, examples: list[dict], device: str, autocast_dtype: torch.dtype | None = None,
               rank: int = 0, world_size: int = 1, progress: bool = False) -> dict[str, float]:
    """acc and acc_norm over all examples; see evaluate."""
    enc = tiktoken.get_encoding("gpt2")
    device_type = torch.device(device).type
    mine = examples[rank::world_size]
    hits = torch.zeros(2, dtype=torch.long, device=device)  # [acc_norm, acc]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            for example in tqdm(mine, desc="hellaswag", disable=not progress):
                tokens, mask = render_example(example, enc, model.config.block_size)
                total, mean = ending_losses(model, tokens.to(device), mask.to(device))
                hits += torch.stack([mean.argmin() == example["label"], total.argmin() == example["label"]])
    finally:
        model.train(was_training)
    counts = torch.cat([hits, torch.tensor([len(mine)], device=device)])
    if world_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    correct_norm, correct, n = counts.tolist()
    return {"acc_norm": correct_norm / n, "acc": correct / n}


def evaluate(model: torch.nn.Module, examples: list[dict], device: str, autocast_dtype: torch.dtype | None = None,
             rank: int = 0, world_size: int = 1) -> float:
    """acc_norm over ALL examples. Rank r scores examples r, r+W, ... and the counts are summed across ranks, so
    every rank returns the same number. `model` is a plain GPT (not compiled or DDP-wrapped); its train/eval mode
    is restored afterwards."""
    return accuracies(model, examples, device, autocast_dtype, rank, world_size)["acc_norm"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="Hugging Face GPT-2: a hub name (gpt2, gpt2-medium, ...) or a local directory")
    source.add_argument("--ckpt", help="a checkpoint written by train_gpt2.py")
    parser.add_argument("--hellaswag_path",
                        help="a local hellaswag_val.jsonl (default: download it to data/hellaswag_cache/)")
    parser.add_argument("--limit", type=int, help="evaluate only the first N examples")
    parser.add_argument("--device", default="auto", help="cuda, mps, cpu, or auto (the best one present)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="autocast dtype; the reference numbers above are float32")
    args = parser.parse_args(argv)

    device = default_device() if args.device == "auto" else args.device
    try:
        examples = load_examples(args.hellaswag_path, args.limit)  # before the model, so a bad path fails fast
    except FileNotFoundError as e:
        parser.error(str(e))
    try:
        model = GPT.from_pretrained(args.model) if args.model else GPT.from_checkpoint(args.ckpt)
    except (FileNotFoundError, ValueError) as e:  # a bad --ckpt: the message names the file and the fix
        parser.error(str(e))
    model.to(device)
    torch.set_float32_matmul_precision("high")  # TF32 on GPUs that have it, as llm.c and build-nanogpt do
    autocast_dtype = None if args.dtype == "float32" else getattr(torch, args.dtype)
    result = accuracies(model, examples, device, autocast_dtype, progress=True)
    print(f"acc_norm {result['acc_norm']:.4f}  acc {result['acc']:.4f}  ({len(examples)} examples)")


if __name__ == "__main__":
    main()

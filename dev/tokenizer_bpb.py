"""GPT-2's tokenizer against a BPE trained on enwiki, on the same small model (docs/data.md, "Your own tokenizer"):
the val bits per byte of each. Loss per token does not compare across tokenizers (a token is more or less text);
bits per byte do.

    TIKTOKEN_CACHE_DIR=../shared/data/gpt2_tokenizer/tiktoken_cache nice -n 5 python -m dev.tokenizer_bpb

It runs the commands a user would type: (1) data.train_tokenizer at 32k on enwiki's train text into
tokenizers/enwiki32k, (2) data.prepare of enwiki's train and val with GPT-2's tokenizer into data/enwiki and with
that BPE into data/enwiki32k (each step skipped where its output is already there, complete), (3) train_gpt2.py's
4 x 256 GPT-2 (plain AdamW and cosine at --max_lr 1e-3, the best of docs/architectures.md's sweep at this shape;
fp32, seed 1337) on each, for the same optimizer steps of the same tokens per step (31 minutes for both at the
defaults on 2 cores under a load of 7-8), then (4) prints the table.
Both runs read the train stream from its start, unshuffled, so the text they see is the same up to where the shorter
one stops: a BPE of fewer bytes per token sees fewer bytes in the same tokens, and the table says how many.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from data.tokenize_shards import PROGRESS, read_progress
from dataloader import Shard, find_shards, read_data_tokenizer, read_shard_layout
from dev.tokenizer_compare import SHARED_ENWIKI
from evaluation.validation import token_byte_lengths
from training.metrics_log import read_metrics

BPE_DIR = Path("tokenizers/enwiki32k")
RUNS = {"gpt2": Path("data/enwiki"), str(BPE_DIR): Path("data/enwiki32k")}  # --tokenizer: its shards
LOG_ROOT = Path("logs/tokenizer_bpb")
SEQ_LEN = 256


def command(*args: str) -> float:
    """Run `python ARGS` as a user would, printing it; its wall time in seconds."""
    print("$ python " + " ".join(args), flush=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True)
    return time.perf_counter() - t0


def prepared(data_dir: Path) -> bool:
    return (data_dir / PROGRESS).exists() and read_progress(data_dir / PROGRESS)["complete"]


def bytes_of_first_tokens(data_dir: Path, num_tokens: int) -> int:
    """UTF-8 bytes of the text of the first num_tokens train tokens (<|endoftext|> counts 0)."""
    path = find_shards(data_dir, "train")[0]
    n, dtype = read_shard_layout(path)
    shard = Shard(path, n, dtype)
    tokens = shard.read(0, min(n, num_tokens)).astype(np.int64)
    shard.close()
    return int(token_byte_lengths(read_data_tokenizer(data_dir))[tokens].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--enwiki", type=Path, default=SHARED_ENWIKI, help="directory of enwiki(_val).jsonl.gz")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps of each run")
    parser.add_argument("--batch_tokens", type=int, default=4096, help="tokens per optimizer step")
    parser.add_argument("--val_every", type=int, default=25)
    parser.add_argument("--val_tokens", type=int, default=32768, help="from the start of the val text")
    args = parser.parse_args()
    train, val = args.enwiki / "enwiki.jsonl.gz", args.enwiki / "enwiki_val.jsonl.gz"

    if not (BPE_DIR / "tokenizer.json").exists():
        command("-m", "data.train_tokenizer", "--input", str(train), "--vocab_size", "32768", "--output", str(BPE_DIR))
    for tokenizer, data_dir in RUNS.items():
        if not prepared(data_dir):
            command("-m", "data.prepare", "--input", str(train), "--val_input", str(val), "--tokenizer", tokenizer,
                    "--output_dir", str(data_dir))

    rows = []
    for tokenizer, data_dir in RUNS.items():
        log_dir = LOG_ROOT / data_dir.name
        seconds = command(
            "train_gpt2.py", "--model", "small", "--arch", "gpt2", "--optimizer", "adamw", "--max_lr", "1e-3",
            "--dtype", "fp32", "--seed", "1337", "--data_dir", str(data_dir), "--no-shuffle", "--seq_len", str(SEQ_LEN),
            "--micro_batch_size", str(args.batch_tokens // SEQ_LEN), "--total_batch_size", str(args.batch_tokens),
            "--max_steps", str(args.steps), "--warmup_steps", str(max(1, args.steps // 10)),
            "--val_every", str(args.val_every), "--val_tokens", str(args.val_tokens), "--eval_every", "0",
            "--sample_every", "0", "--snapshot_every", "0", "--resume", "never", "--log_dir", str(log_dir))
        metrics = read_metrics(log_dir / "metrics.jsonl")[0]
        last = args.steps - 1
        tokens = args.steps * args.batch_tokens
        vocab = read_data_tokenizer(data_dir).vocab_size
        rows.append((tokenizer, vocab, tokens, bytes_of_first_tokens(data_dir, tokens + 1), metrics["val_loss"][last],
                     metrics["val_bpb"][last], seconds))

    print(f"\n4 x 256 GPT-2, {args.steps} steps of {args.batch_tokens:,} tokens, seed 1337, val: the first "
          f"{args.val_tokens:,} tokens of enwiki_val\n")
    print("| tokenizer | vocab | tokens | bytes seen | bytes per token | final val loss (nats/token) | final val bpb "
          "| time |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for tokenizer, vocab, tokens, seen, loss, bpb, seconds in rows:
        print(f"| {tokenizer} | {vocab:,} | {tokens:,} | {seen:,} | {seen / tokens:.3f} | {loss:.4f} | {bpb:.4f} "
              f"| {seconds / 60:.1f} min |")


if __name__ == "__main__":
    main()

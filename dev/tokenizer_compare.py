"""Tokenizers on enwiki (docs/data.md, "Your own tokenizer"): bytes per token on the val text, the time to train
each, and how fast each tokenizes, GPT-2's (tiktoken) and bytes against byte-level BPEs trained on the train text.

    nice python -m dev.tokenizer_compare                        # ../shared/data/enwiki; 8k, 32k and 64k; ~4 minutes
    nice python -m dev.tokenizer_compare --vocab_sizes 8192 --output_dir tokenizers   # and keep what it trains

Each BPE is data/train_tokenizer.py's (data/bpe.py) on every document of enwiki.jsonl.gz; the val text is
enwiki_val.jsonl.gz, which none of them saw. Throughput is one process encoding the val documents one at a time, as
data/prepare.py does (Tokenizer.encode, Python's loop included), the best of --repeats passes: the machine's other
work only slows a pass down.
"""

import argparse
import time
from pathlib import Path

from data.bpe import train_bpe
from data.tokenize_shards import jsonl_texts
from data.tokenizer_flag import load_tokenizer
from training.tokenizer import HFTokenizer, Tokenizer

SHARED_ENWIKI = Path(__file__).resolve().parents[2] / "shared" / "data" / "enwiki"


def tokens_per_second(tokenizer: Tokenizer, documents: list[str], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = sum(len(tokenizer.encode(document)) for document in documents)
        best = min(best, time.perf_counter() - t0)
    return tokens / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--enwiki", type=Path, default=SHARED_ENWIKI, help="directory of enwiki(_val).jsonl.gz")
    parser.add_argument("--vocab_sizes", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--repeats", type=int, default=3, help="passes over the val text per throughput figure")
    parser.add_argument("--output_dir", type=Path, help="write each trained tokenizer to DIR/enwiki<N>/tokenizer.json")
    args = parser.parse_args()
    train = list(jsonl_texts(args.enwiki / "enwiki.jsonl.gz"))
    val = list(jsonl_texts(args.enwiki / "enwiki_val.jsonl.gz"))
    train_bytes, val_bytes = (sum(len(d.encode("utf-8")) for d in documents) for documents in (train, val))
    print(f"train: {len(train):,} documents, {train_bytes / 1e6:.1f} MB; val: {len(val):,} documents, "
          f"{val_bytes / 1e6:.2f} MB\n")

    rows = []  # (name, vocabulary, seconds to train or None, tokenizer)
    for name in ("gpt2", "bytes"):
        tokenizer = load_tokenizer(name)
        rows.append((f"{name} ({tokenizer.spec.kind})", tokenizer.vocab_size, None, tokenizer))
    for vocab_size in args.vocab_sizes:
        t0 = time.perf_counter()
        trained = train_bpe(train, vocab_size)
        seconds = time.perf_counter() - t0
        name = f"enwiki{vocab_size // 1024}k"
        definition = trained.to_str(pretty=True)
        if args.output_dir:
            (args.output_dir / name).mkdir(parents=True, exist_ok=True)
            trained.save(str(args.output_dir / name / "tokenizer.json"), pretty=True)
        tokenizer = HFTokenizer(definition, name)
        rows.append((f"{name} (BPE)", tokenizer.vocab_size, seconds, tokenizer))

    gpt2_speed = tokens_per_second(rows[0][3], val, args.repeats)
    print("| tokenizer | vocabulary | bytes per token (val) | tokens for the val text | time to train | "
          "tokens/s (1 process) | vs GPT-2's |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, vocab_size, seconds, tokenizer in rows:
        tokens = sum(len(tokenizer.encode(document)) for document in val)
        speed = gpt2_speed if tokenizer is rows[0][3] else tokens_per_second(tokenizer, val, args.repeats)
        trained_in = f"{seconds:.0f} s" if seconds is not None else "-"
        print(f"| {name} | {vocab_size:,} | {val_bytes / tokens:.3f} | {tokens:,} | {trained_in} "
              f"| {speed / 1e6:.2f} M | {speed / gpt2_speed:.2f}× |")


if __name__ == "__main__":
    main()

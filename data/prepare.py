"""Tokenize local text files, or Tiny Shakespeare, with GPT-2's tokenizer (or --tokenizer's) into val/train shards.

    python -m data.prepare --source shakespeare                          # downloads input.txt into data/shakespeare/
    python -m data.prepare --source shakespeare --input path/input.txt   # offline, from a local copy
    python -m data.prepare --input a.txt b.txt --output_dir data/mytext
    python -m data.prepare --input ../shared/data/enwiki/enwiki.jsonl.gz \
        --val_input ../shared/data/enwiki/enwiki_val.jsonl.gz --output_dir data/enwiki
    python -m data.prepare --source shakespeare --tokenizer bytes --output_dir data/shakespeare_bytes  # a byte a token

Documents: each text file is one document, each line {"text": ...} of a JSON-lines file (.jsonl, or gzipped
.jsonl.gz) is one, and so is each row's `text` of a .parquet file. Every document is preceded by the EOT token as
llm.c writes documents (see data/tokenize_shards.py), so EOT separates consecutive documents; with --val_fraction > 0,
a text file's val part and its train part are each preceded by one.
Tiny Shakespeare (--source shakespeare) is one text without EOT, tokenized exactly as nanoGPT's
data/shakespeare/prepare.py does it. The val split:
  --val_fraction F > 0 (default 0.1): the last F of each text file's characters is val, the rest train, as nanoGPT
      splits Tiny Shakespeare (train 301,966 / val 36,059 tokens); of a JSON-lines or parquet file, its last F of
      documents.
  --val_input FILES: these files are val, the --input files train, whole.
  --val_fraction 0: the first --shard_size tokens are val, the rest train (llm.c's convention, for corpora of
      many shards).
Shards go to --output_dir (default data/shakespeare with --source shakespeare, required otherwise) as
<dir name>_val_000000.bin, <dir name>_train_000000.bin, ..., of at most --shard_size tokens each (default 100M);
written as a stream by data/tokenize_shards.write_shards, as data/fineweb.py's are: --num_proc processes tokenize (the
same bytes for any number), and a killed run, run again with the same command, resumes where its progress.json says.
--tokenizer: gpt2 (default), bytes, a directory holding a tokenizer.json (data/train_tokenizer.py writes one), or a
tiktoken encoding; manifest.json beside the shards records it (a directory holds one tokenizer's shards).
"""

import argparse
import urllib.request
from collections.abc import Iterator
from itertools import chain, islice
from pathlib import Path

from data.tokenize_shards import (
    Split,
    check_input_files,
    check_output_dir,
    count_documents,
    file_texts,
    is_jsonl,
    shard_paths,
    shard_size,
    split_val,
    text_file,
    write_shards,
)
from data.tokenizer_flag import load_tokenizer
from dataloader import read_shard_header
from training.errors import UserError, run_entry_point
from training.files import atomic_write

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
DATA_DIR = Path(__file__).resolve().parent


def download_shakespeare(path: Path) -> None:
    """Fetch Tiny Shakespeare to `path`, atomically: a failed download never leaves a partial file to be reused."""
    print(f"downloading {SHAKESPEARE_URL} to {path}")
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=60) as response:
            data = response.read()
    except OSError as e:  # URLError, timeouts and connection errors are all OSErrors
        raise UserError(f"could not download Tiny Shakespeare from {SHAKESPEARE_URL} ({e}). If this machine is "
                        "offline, copy input.txt here from elsewhere and pass it with --input "
                        "path/to/input.txt.") from e
    atomic_write(path, lambda f: f.write(data))


def corpus_source(args: argparse.Namespace) -> str:
    """What the shards are made of, as progress.json records it (check_corpus): Tiny Shakespeare wherever it is read
    from, or the input files; and how they are split."""
    words = ["--source", args.source] if args.source else ["--input", *(str(path.resolve()) for path in args.input)]
    if args.val_input:
        words += ["--val_input", *(str(path.resolve()) for path in args.val_input)]
    else:
        words += ["--val_fraction", f"{args.val_fraction:g}"]
    return " ".join(["data.prepare", *words])


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=["shakespeare"],
                        help="Tiny Shakespeare, downloaded (and cached in --output_dir) unless --input is given")
    parser.add_argument("--input", type=Path, nargs="+",
                        help="text files (UTF-8), a document each; .jsonl/.jsonl.gz files, a document a line; "
                             ".parquet files, a document a row (its `text` column)")
    parser.add_argument("--val_input", type=Path, nargs="+",
                        help="files (as --input) that are the val split, whole; --input is then all train")
    parser.add_argument("--output_dir", type=Path, help="default: data/shakespeare with --source shakespeare")
    parser.add_argument("--shard_size", type=shard_size, default=100_000_000, help="tokens per shard (default 100M)")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="gpt2 (default) | bytes | a directory or file holding a tokenizer.json | a tiktoken "
                             "encoding's name (see data/tokenizer_flag.py)")
    parser.add_argument("--val_fraction", type=float,
                        help="fraction of each file's characters (JSON lines, parquet: documents), from its end, "
                             "that is val (default 0.1); 0: the first shard is val")
    parser.add_argument("--num_proc", type=int, default=1, help="tokenizer processes (default 1); the shards are the "
                                                                 "same for any number")
    args = parser.parse_args(argv)
    if args.val_input and (args.val_fraction is not None or args.source):
        parser.error("--val_input names the val files, so it goes without --val_fraction and --source")
    if args.val_fraction is None:
        args.val_fraction = 0.0 if args.val_input else 0.1
    if args.source is None and (args.input is None or args.output_dir is None):
        parser.error("pass --source shakespeare, or your own text files with --input and a directory for the shards "
                     "with --output_dir")
    if args.num_proc < 1:
        parser.error(f"--num_proc {args.num_proc}: must be at least 1")
    if not 0 <= args.val_fraction < 1:
        parser.error(f"--val_fraction {args.val_fraction}: must be at least 0 and below 1")
    if args.source == "shakespeare" and args.input and len(args.input) > 1:
        parser.error("--source shakespeare reads one file, a copy of input.txt; for several files of your own leave "
                     "out --source (each file is then a document, preceded by <|endoftext|>)")
    return parser, args


def splits(args: argparse.Namespace, inputs: list[Path], output_dir: Path) -> list[Split]:
    """Val's and train's documents, or one stream whose first shard is val."""
    def texts(paths: list[Path]) -> Iterator[str]:
        return chain.from_iterable(map(file_texts, paths))

    if args.val_input:
        return [Split("val", shard_paths(output_dir, "val"), lambda: texts(args.val_input),
                      sum(map(count_documents, args.val_input))),
                Split("train", shard_paths(output_dir, "train"), lambda: texts(inputs))]
    if args.val_fraction == 0:
        return [Split("val+train", shard_paths(output_dir), lambda: texts(inputs))]
    counts = [count_documents(path) for path in inputs]  # a cheap pass: where each file's val part starts
    cuts = [int(count * (1 - args.val_fraction)) for count in counts]

    def part(val: bool) -> Iterator[str]:
        """Each file's last val_fraction (val=True) or the rest: a text file's characters, else its documents."""
        for path, cut in zip(inputs, cuts):
            if path.suffix == ".parquet" or is_jsonl(path):
                yield from islice(file_texts(path), cut, None) if val else islice(file_texts(path), cut)
            else:
                yield from split_val([text_file(path)], True, args.val_fraction)[0 if val else 1]

    return [Split("val", shard_paths(output_dir, "val"), lambda: part(True),
                  sum(count - cut for count, cut in zip(counts, cuts))),
            Split("train", shard_paths(output_dir, "train"), lambda: part(False))]


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    output_dir = args.output_dir or DATA_DIR / "shakespeare"
    if args.input:  # first: what names no file needs no tokenizer (GPT-2's may be downloaded)
        check_input_files(parser, args.input + (args.val_input or []))
    tokenizer = load_tokenizer(args.tokenizer)
    check_output_dir(parser, output_dir)  # (makes it: after every check that can refuse before it)
    inputs = args.input or [output_dir / "input.txt"]
    if not args.input and not inputs[0].exists():
        download_shakespeare(inputs[0])
    write_shards(output_dir, corpus_source(args), splits(args, inputs, output_dir), tokenizer, args.shard_size,
                 args.num_proc, eot=args.source != "shakespeare")
    if args.val_fraction == 0 and not args.val_input and not shard_paths(output_dir)(1).exists():
        val = shard_paths(output_dir)(0)
        tokens = read_shard_header(val) if val.exists() else 0
        raise UserError(f"all {tokens:,} tokens fit in the val shard, leaving no train shard. Use --val_fraction "
                        "(e.g. 0.1) or a smaller --shard_size.")


if __name__ == "__main__":
    run_entry_point(main)

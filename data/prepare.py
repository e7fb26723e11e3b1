"""Tokenize local text files, or Tiny Shakespeare, with GPT-2's tokenizer (or --tokenizer's) into val/train shards.

    python -m data.prepare --source shakespeare                          # downloads input.txt into data/shakespeare/
    python -m data.prepare --source shakespeare --input path/input.txt   # offline, from a local copy
    python -m data.prepare --input a.txt b.txt --output_dir data/mytext
    python -m data.prepare --input ../shared/data/enwiki/enwiki.jsonl.gz \
        --val_input ../shared/data/enwiki/enwiki_val.jsonl.gz --output_dir data/enwiki
    python -m data.prepare --source shakespeare --tokenizer bytes --output_dir data/shakespeare_bytes  # a byte a token

Documents: each text file is one document, and each line {"text": ...} of a JSON-lines file (.jsonl, or gzipped
.jsonl.gz) is one. Every document is preceded by the EOT token as llm.c writes documents (see
data/tokenize_shards.py), so EOT separates consecutive documents; with --val_fraction > 0, a text file's val part
and its train part are each preceded by one.
Tiny Shakespeare (--source shakespeare) is one text without EOT, tokenized exactly as nanoGPT's
data/shakespeare/prepare.py does it. The val split:
  --val_fraction F > 0 (default 0.1): the last F of each text file's characters is val, the rest train, as nanoGPT
      splits Tiny Shakespeare (train 301,966 / val 36,059 tokens); of a JSON-lines file, its last F of documents.
  --val_input FILES: these files are val, the --input files train, whole.
  --val_fraction 0: the first --shard_size tokens are val, the rest train (llm.c's convention, for corpora of
      many shards).
Shards go to --output_dir (default data/shakespeare with --source shakespeare, required otherwise) as
<dir name>_val_000000.bin, <dir name>_train_000000.bin, ..., of at most --shard_size tokens each (default 100M);
progress.json beside them names the corpus, and a directory holding another corpus's shards is refused before
anything is written (data/tokenize_shards.check_corpus, as data/fineweb.py does). The same command again rewrites them.
--tokenizer: gpt2 (default), bytes, a directory holding a tokenizer.json (data/train_tokenizer.py writes one), or a
tiktoken encoding; manifest.json beside the shards records it (a directory holds one tokenizer's shards).
The files are read into memory whole; for larger corpora use data/fineweb.py --input, which streams.
"""

import argparse
import time
import urllib.request
from pathlib import Path

from data.tokenize_shards import (
    ShardWriter,
    check_corpus,
    check_input_files,
    check_output_dir,
    is_jsonl,
    read_documents,
    shard_paths,
    shard_size,
    split_val,
    summary,
    tokenize_documents,
    write_progress,
)
from dataloader import record_shards
from training.errors import UserError, run_entry_point
from training.files import atomic_write
from training.tokenizer import load_tokenizer

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
                        help="text files (UTF-8), a document each, or .jsonl/.jsonl.gz files, a document a line")
    parser.add_argument("--val_input", type=Path, nargs="+",
                        help="files (as --input) that are the val split, whole; --input is then all train")
    parser.add_argument("--output_dir", type=Path, help="default: data/shakespeare with --source shakespeare")
    parser.add_argument("--shard_size", type=shard_size, default=100_000_000, help="tokens per shard (default 100M)")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="gpt2 (default) | bytes | a directory or file holding a tokenizer.json | a tiktoken "
                             "encoding's name (see tokenizer.load_tokenizer)")
    parser.add_argument("--val_fraction", type=float,
                        help="fraction of each file's characters (JSON lines: documents), from its end, that is val "
                             "(default 0.1); 0: the first shard is val")
    args = parser.parse_args(argv)
    if args.val_input and (args.val_fraction is not None or args.source):
        parser.error("--val_input names the val files, so it goes without --val_fraction and --source")
    if args.val_fraction is None:
        args.val_fraction = 0.0 if args.val_input else 0.1
    if args.source is None and (args.input is None or args.output_dir is None):
        parser.error("pass --source shakespeare, or your own text files with --input and a directory for the shards "
                     "with --output_dir")
    if not 0 <= args.val_fraction < 1:
        parser.error(f"--val_fraction {args.val_fraction}: must be at least 0 and below 1")
    if args.source == "shakespeare" and args.input and len(args.input) > 1:
        parser.error("--source shakespeare reads one file, a copy of input.txt; for several files of your own leave "
                     "out --source (each file is then a document, preceded by <|endoftext|>)")
    return parser, args


def document_streams(args: argparse.Namespace, inputs: list[Path], files: list[list[str]],
                     output_dir: Path) -> dict[str, tuple]:
    """{name: (shard_paths, documents)}: val's and train's, or one stream whose first shard is val."""
    if args.val_input:
        val = [d for path in args.val_input for d in read_documents(path)]
        return {"val": (shard_paths(output_dir, "val"), val),
                "train": (shard_paths(output_dir, "train"), [d for documents in files for d in documents])}
    if args.val_fraction > 0:
        splits = [split_val(documents, not is_jsonl(path), args.val_fraction) for path, documents in zip(inputs, files)]
        return {"val": (shard_paths(output_dir, "val"), [d for val, _ in splits for d in val]),
                "train": (shard_paths(output_dir, "train"), [d for _, train in splits for d in train])}
    return {"val+train": (shard_paths(output_dir), [d for documents in files for d in documents])}


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
    source = corpus_source(args)
    check_corpus(output_dir, source, args.shard_size)  # another corpus's shards there: a UserError, nothing written
    record_shards(output_dir, tokenizer.spec)  # another tokenizer's shards there: a UserError, nothing written

    t0 = time.time()
    files = [read_documents(path) for path in inputs]
    streams = document_streams(args, inputs, files, output_dir)
    progress = {"source": source, "shard_size": args.shard_size, "shards": 0, "documents": 0, "offset": 0,
                "complete": False}
    write_progress(output_dir, progress)  # before the first shard: no shard here without the record of its corpus
    tokens = shards = 0
    for desc, (paths, documents) in streams.items():
        writer = ShardWriter(paths, args.shard_size, desc, tokenizer=tokenizer.spec)
        for document_tokens in tokenize_documents(documents, tokenizer, eot=args.source != "shakespeare"):
            writer.add(document_tokens)
        writer.close()
        print(f"{desc}: {writer.tokens_added:,} tokens in {writer.shards} shard(s)")
        tokens, shards = tokens + writer.tokens_added, shards + writer.shards
    if args.val_fraction == 0 and not args.val_input and shards < 2:
        raise UserError(f"all {tokens:,} tokens fit in the val shard, leaving no train shard. Use --val_fraction "
                        "(e.g. 0.1) or a smaller --shard_size.")
    documents = sum(map(len, files)) + (len(streams["val"][1]) if args.val_input else 0)
    write_progress(output_dir, progress | {"shards": shards, "documents": documents, "complete": True})
    print(summary(documents, tokens, shards, time.time() - t0, output_dir))


if __name__ == "__main__":
    run_entry_point(main)

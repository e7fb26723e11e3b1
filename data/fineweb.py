"""Download FineWeb-Edu (or FineWeb), tokenize it with GPT-2's tokenizer (or --tokenizer's, as data/prepare.py takes
it) in a process pool, and write token shards.

    python -m data.fineweb                                  # FineWeb-Edu sample-10BT -> data/fineweb_edu10B/
    python -m data.fineweb --version classic --size 100B    # FineWeb sample-100BT -> data/fineweb100B/
    python -m data.fineweb --max_shards 2                   # a quick partial download: the val and one train shard
    python -m data.fineweb --input a.parquet b.jsonl --output_dir data/fineweb_mine   # local files, `text` column

The documents are streamed from the Hugging Face hub (only the shards are kept on disk) and cut into shards of
--shard_size tokens (default 100M, 200 MB; sample-10BT gives about 100): the first is val, the rest train, named
<dir name>_val_000000.bin, <dir name>_train_000000.bin, .... Every document is preceded by the EOT token, as in
llm.c's dev/data/fineweb.py, so the shards hold llm.c's token stream (see data/tokenize_shards.py). Shards are
byte-identical whatever --num_proc is.

Restarting: after each shard, <output_dir>/progress.json records where in the document stream the next shard
starts, and re-running the same command carries on from there (data/tokenize_shards.write_shards, data/prepare.py's
writer too): an interrupted run (crash, Ctrl-C, kill) loses at most the shard it was writing. A run without
--max_shards continues one with it; re-running a finished command does nothing.
"""

import argparse
import os
from collections.abc import Iterator
from itertools import chain
from pathlib import Path

from data.tokenize_shards import (
    Split,
    check_input_files,
    check_output_dir,
    file_texts,
    is_jsonl,
    jsonl_texts,
    shard_paths,
    shard_size,
    write_shards,
)
from data.tokenizer_flag import load_tokenizer
from training.errors import UserError, run_entry_point

DATASETS = {"edu": ("HuggingFaceFW/fineweb-edu", "fineweb_edu"), "classic": ("HuggingFaceFW/fineweb", "fineweb")}
DATA_DIR = Path(__file__).resolve().parent


def hub_texts(repo: str, config: str) -> Iterator[str]:
    from datasets import load_dataset  # imported here: slow to import, and not needed for --input
    try:
        # Streaming reads the dataset's parquet files in a fixed order, which resuming relies on.
        for row in load_dataset(repo, name=config, split="train", streaming=True).select_columns(["text"]):
            yield row["text"]
    except Exception as e:  # datasets raises many kinds: no network, offline mode, HTTP errors, no such dataset
        reason = (str(e).strip().splitlines() or [""])[0]
        raise UserError(f"could not stream {repo} {config} from the Hugging Face hub ({type(e).__name__}: {reason}). "
                        "On a node without network, download its parquet files where there is one and pass them "
                        "with --input; run the same command again to resume after a network error.") from e


def local_texts(paths: list[Path]) -> Iterator[str]:
    """The `text` of each row of parquet or JSON-lines files (.json included), in order."""
    return chain.from_iterable(jsonl_texts(path) if path.suffix == ".json" else file_texts(path) for path in paths)


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", choices=["edu", "classic"], default="edu", help="FineWeb-Edu or FineWeb")
    parser.add_argument("--size", choices=["10B", "100B"], default="10B", help="the sample-10BT or sample-100BT subset")
    parser.add_argument("--input", type=Path, nargs="+",
                        help="local .parquet or .jsonl(.gz) files with a `text` column, read instead of the hub")
    parser.add_argument("--output_dir", type=Path,
                        help="default: data/fineweb_edu10B, data/fineweb100B, ... after --version and --size; "
                             "data/fineweb_local with --input")
    parser.add_argument("--shard_size", type=shard_size, default=100_000_000, help="tokens per shard (default 100M)")
    parser.add_argument("--num_proc", type=int, default=os.cpu_count(), help="tokenizer processes (default: all cores)")
    parser.add_argument("--max_shards", type=int, help="stop after this many shards, val included")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="gpt2 (default) | bytes | a directory or file holding a tokenizer.json | a tiktoken "
                             "encoding's name (see data/tokenizer_flag.py)")
    args = parser.parse_args(argv)
    for flag in ("shard_size", "num_proc", "max_shards"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)}: must be at least 1")
    return parser, args


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    if args.input:
        check_input_files(parser, args.input)
        for path in args.input:
            if path.suffix not in (".parquet", ".json") and not is_jsonl(path):
                parser.error(f"--input {path}: unknown file type; pass .parquet or .jsonl/.jsonl.gz (JSON lines) "
                             "files.")
        source = [str(path.resolve()) for path in args.input]
        output_dir = args.output_dir or DATA_DIR / "fineweb_local"
    else:
        repo, name = DATASETS[args.version]
        config = f"sample-{args.size}T"
        source = f"{repo} {config}"
        output_dir = args.output_dir or DATA_DIR / f"{name}{args.size}"
    tokenizer = load_tokenizer(args.tokenizer)
    check_output_dir(parser, output_dir)
    texts = (lambda: local_texts(args.input)) if args.input else (lambda: hub_texts(repo, config))
    write_shards(output_dir, source, [Split("val+train", shard_paths(output_dir), texts)], tokenizer, args.shard_size,
                 args.num_proc, max_shards=args.max_shards)


if __name__ == "__main__":
    run_entry_point(main)

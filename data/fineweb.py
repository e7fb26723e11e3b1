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
starts. The stream's order is fixed, so re-running the same command reads past the documents already in shards
without tokenizing them and carries on from there: an interrupted run (crash, Ctrl-C) loses at most the shard it
was writing, and never leaves part of one under a shard's name. A run without --max_shards continues one with it;
re-running a finished command does nothing. A directory holding another corpus's shards (its progress.json names
another source or --shard_size, or none accounts for them) is refused before anything is written (check_corpus).
"""

import argparse
import os
import time
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from data.tokenize_shards import (
    PROGRESS,
    ShardWriter,
    check_corpus,
    check_input_files,
    check_output_dir,
    is_jsonl,
    jsonl_texts,
    shard_paths,
    shard_size,
    summary,
    tokenize_documents,
    write_progress,
)
from dataloader import read_shard_header, record_shards
from training.errors import UserError, run_entry_point
from training.tokenizer import load_tokenizer

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


def file_texts(paths: list[Path]) -> Iterator[str]:
    """The `text` of each row of parquet or JSON-lines files, in order."""
    for path in paths:
        if path.suffix == ".parquet":
            yield from parquet_texts(path)
        else:
            yield from jsonl_texts(path)


def parquet_texts(path: Path) -> Iterator[str]:
    try:
        parquet = pq.ParquetFile(path)
        if "text" not in parquet.schema_arrow.names:
            raise UserError(f"{path} has no `text` column (it has {parquet.schema_arrow.names}); --input files need "
                            "one, holding each document's text.")
        for batch in parquet.iter_batches(columns=["text"]):
            yield from batch.column("text").to_pylist()
    except (pa.ArrowException, OSError) as e:  # not parquet, truncated, corrupt
        raise UserError(f"{path} could not be read as a parquet file ({type(e).__name__}: {e}); it is truncated, "
                        "corrupt or not parquet. Copy or download it again.") from e


def load_progress(output_dir: Path, source: str | list[str], shard_size: int,
                  shard_path: Callable[[int], Path]) -> dict:
    """The position saved by an earlier run of the same command, checked against the shards it lists as finished; a
    UserError if output_dir holds shards of another corpus (check_corpus)."""
    progress = check_corpus(output_dir, source, shard_size)
    if progress is None:
        return {"shards": 0, "documents": 0, "offset": 0, "complete": False}
    path = output_dir / PROGRESS
    for i in range(progress["shards"]):
        try:
            read_shard_header(shard_path(i))
        except (OSError, UserError) as e:
            raise UserError(f"{e} {path} lists this shard as finished. Delete {path} and the shards of "
                            f"{output_dir} to write them all again.") from e
    return progress


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
                             "encoding's name (see tokenizer.load_tokenizer)")
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

    progress_path = output_dir / PROGRESS
    paths = shard_paths(output_dir)
    progress = load_progress(output_dir, source, args.shard_size, paths)
    record_shards(output_dir, tokenizer.spec)  # another tokenizer's shards there: a UserError, nothing written
    if progress["complete"] or (args.max_shards and progress["shards"] >= args.max_shards):
        print(f"{output_dir} already has its {progress['shards']} shard(s) (see {progress_path}); nothing to do.")
        return
    if progress["shards"]:
        print(f"resuming after {progress['shards']} finished shard(s): skipping the first {progress['documents']:,} "
              "documents")

    def save_progress(writer: ShardWriter, complete: bool = False) -> None:
        write_progress(output_dir, {"source": source, "shard_size": args.shard_size, "shards": writer.shards,
                                    "documents": writer.documents, "offset": writer.offset, "complete": complete})

    t0 = time.time()
    texts = file_texts(args.input) if args.input else hub_texts(repo, config)
    total = (args.max_shards - progress["shards"]) * args.shard_size if args.max_shards else None
    writer = ShardWriter(paths, args.shard_size, output_dir.name, total=total, shards=progress["shards"],
                         documents=progress["documents"], offset=progress["offset"], max_shards=args.max_shards,
                         on_shard=save_progress, tokenizer=tokenizer.spec)
    save_progress(writer)  # before the first shard: no shard here without the record of its corpus
    for tokens in tokenize_documents(islice(texts, progress["documents"], None), tokenizer, args.num_proc):
        writer.add(tokens)
        if writer.shards == args.max_shards:
            writer.close(last_shard=False)
            break
    else:  # the stream ended: its tail is the last shard
        writer.close()
        save_progress(writer, complete=True)
    print(summary(writer.documents - progress["documents"], writer.tokens_added, writer.shards - progress["shards"],
                  time.time() - t0, output_dir))


if __name__ == "__main__":
    run_entry_point(main)

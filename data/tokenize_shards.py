"""GPT-2 tokenization and the shard writer shared by data/prepare.py and data/fineweb.py.

Document boundaries follow llm.c's dev/data/fineweb.py: every document is preceded by one EOT token (<|endoftext|>,
id 50256), the first of a stream included, so the model learns that a new, unrelated text starts after an EOT and
our shards of the same documents hold the same token stream as llm.c's. The one exception is a single text split
the way nanoGPT splits Tiny Shakespeare (data/prepare.py --source shakespeare): tokenize(text, eot=False), no EOT.
"""

import argparse
import functools
import gzip
import json
import multiprocessing
import signal
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dataloader import write_shard
from errors import UserError
from parsing import PARSE_ERRORS, parse_problem
from tokenizer import gpt2_encoding


def tokenize(text: str, eot: bool = True) -> np.ndarray:
    """The EOT token (unless eot=False) followed by the document's tokens; special-token text like
    "<|endoftext|>" inside a document is plain text."""
    enc = gpt2_encoding()
    return np.array([enc.eot_token] * eot + enc.encode_ordinary(text), dtype=np.int32)  # ShardWriter checks uint16


def tokenize_documents(texts: Iterable[str], num_proc: int = 1, eot: bool = True) -> Iterator[np.ndarray]:
    """tokenize() of each text, in input order whatever num_proc is (ordered imap), so shards don't depend on it."""
    tokenize_one = functools.partial(tokenize, eot=eot)  # a partial of a module function pickles into the workers
    gpt2_encoding()  # a tokenizer that cannot be loaded fails here, once, not in every worker
    if num_proc == 1:
        yield from map(tokenize_one, texts)
        return
    # Workers ignore Ctrl-C: the main process gets it, and leaving this block (break, Ctrl-C) terminates them.
    with multiprocessing.Pool(num_proc, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)) as pool:
        yield from pool.imap(tokenize_one, texts, chunksize=16)


def shard_paths(output_dir: Path, split: str | None = None) -> Callable[[int], Path]:
    """Shard i's path, named <output_dir name>_<split>_NNNNNN.bin. With no split, the stream's first shard is val
    and the rest train (llm.c's convention): val_000000, train_000000, train_000001, ..."""
    name = output_dir.name
    if split is not None:
        return lambda i: output_dir / f"{name}_{split}_{i:06d}.bin"
    return lambda i: output_dir / (f"{name}_val_000000.bin" if i == 0 else f"{name}_train_{i - 1:06d}.bin")


class ShardWriter:
    """Appends documents' tokens to a stream and writes each `shard_size` tokens of it as shard number 0, 1, ...

    (shards, documents, offset) is the stream position where the next shard starts: the next document added is
    document number `documents`, and its first `offset` tokens are already in shards. A restarted run passes the
    position it saved and feeds the documents from number `documents` on. `on_shard(writer)` runs after each
    shard is written (fineweb.py records the position there). Once `max_shards` shards are written, add() stops
    and the writer stays at that shard boundary.
    """

    def __init__(self, shard_path: Callable[[int], Path], shard_size: int, desc: str, total: int | None = None,
                 shards: int = 0, documents: int = 0, offset: int = 0, max_shards: int | None = None,
                 on_shard: Callable[["ShardWriter"], None] | None = None):
        self.shard_path, self.max_shards, self.on_shard = shard_path, max_shards, on_shard
        self.shards, self.documents, self.offset = shards, documents, offset
        self.buffer = np.empty(shard_size, dtype=np.uint16)
        self.fill = 0  # tokens in the buffer, not yet written
        self.tokens_added = 0  # by this run
        self.bar = tqdm(desc=desc, total=total, unit="tok", unit_scale=True, dynamic_ncols=True)

    def add(self, tokens: np.ndarray) -> None:
        """Append one document, as tokenize() returns it."""
        if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
            raise ValueError(
                f"document {self.documents} (0-based, in input order; it would go into {self.shard_path(self.shards)}) "
                f"has token ids {tokens.min()}..{tokens.max()}, but shards store uint16 (0..65535). Use a tokenizer "
                "with at most 65,536 tokens (GPT-2's has 50,257).")
        tokens = tokens[self.offset:]
        while tokens.size:
            n = min(tokens.size, self.buffer.size - self.fill)
            self.buffer[self.fill : self.fill + n] = tokens[:n]
            self.fill, self.offset, self.tokens_added = self.fill + n, self.offset + n, self.tokens_added + n
            tokens = tokens[n:]
            self.bar.update(n)
            if self.fill == self.buffer.size:
                self._write(self.buffer)
                if self.shards == self.max_shards:
                    return
        self.documents, self.offset = self.documents + 1, 0

    def close(self, last_shard: bool = True) -> None:
        """Write the tokens left over as a last, shorter shard (unless last_shard=False: the stream goes on)."""
        if last_shard and self.fill:
            self._write(self.buffer[: self.fill])
        self.bar.close()

    def _write(self, tokens: np.ndarray) -> None:
        write_shard(self.shard_path(self.shards), tokens)  # atomic: an interrupted run leaves no half shard
        self.shards, self.fill = self.shards + 1, 0
        if self.on_shard is not None:
            self.on_shard(self)


def is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz"))


def jsonl_texts(path: Path) -> Iterator[str]:
    """The "text" of each line of a JSON-lines file (gzip-compressed if its name ends in .gz), in order. Blank lines
    are skipped (a trailing one is common); any other line must be a JSON object with a string "text"."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line.strip())  # (stripped: an error's column is the line's own)
                except PARSE_ERRORS as e:
                    problem = f"is {parse_problem(e)}"
                else:
                    if not isinstance(row, dict) or "text" not in row:
                        problem = f'has no "text" field (it starts {line[:60].decode(errors="replace")!r})'
                    elif not isinstance(row["text"], str):
                        problem = f'has a "text" that is {type(row["text"]).__name__}, not a string'
                    else:
                        yield row["text"]
                        continue
                raise UserError(f'{path}, line {line_number} {problem}. Each line of a JSON-lines file must be one '
                                'JSON object whose "text" field holds a document, e.g. {"text": "Anarchism is ..."}; '
                                'fix or delete that line and run the same command again.')
    except (OSError, EOFError, zlib.error) as e:  # gzip's errors for a file that is not gzip, or is cut short
        raise UserError(f"{path} could not be read ({type(e).__name__}: {e}): a truncated or corrupt file, or, for "
                        "a name ending in .gz, not gzip-compressed. Copy or download it again.") from e


def check_input_files(parser: argparse.ArgumentParser, paths: list[Path]) -> None:
    for path in paths:
        if not path.is_file():
            parser.error(f"--input {path}: no such file (relative paths start at {Path.cwd()}). Check the path.")


def check_output_dir(parser: argparse.ArgumentParser, output_dir: Path) -> None:
    """Create --output_dir, or exit naming it if it cannot be a directory of shards."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name (or above it), no permission
        parser.error(f"--output_dir {output_dir}: not a directory, and none can be created there ({e.strerror}). "
                     "Pass a directory, or a path where one can be created.")


def summary(documents: int, tokens: int, shards: int, seconds: float, output_dir: Path) -> str:
    return (f"wrote {shards} shard(s) to {output_dir}: documents {documents:,}, tokens {tokens:,}, {seconds:.1f} s, "
            f"{tokens / max(seconds, 1e-9):,.0f} tokens/s")

"""Tokenization (GPT-2's, or --tokenizer's: tokenizer.py) and the shard writer shared by data/prepare.py and
data/fineweb.py.

Document boundaries follow llm.c's dev/data/fineweb.py: every document is preceded by one EOT token (<|endoftext|>,
GPT-2's id 50256, or the tokenizer's), the first of a stream included, so the model learns that a new, unrelated
text starts after an EOT and our shards of the same documents hold the same token stream as llm.c's. The one exception
is a single text split the way nanoGPT splits Tiny Shakespeare (data/prepare.py --source shakespeare):
tokenize(text, tokenizer, eot=False), no EOT.
"""

import argparse
import functools
import gzip
import json
import multiprocessing
import re
import signal
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dataloader import record_shards, shard_names, write_shard
from training.errors import UserError
from training.files import atomic_write, version_problem
from training.parsing import PARSE_ERRORS, parse_problem
from training.tokenizer import Tokenizer, TokenizerSpec, gpt2_spec, tokenizer_from_spec

worker_tokenizer: Tokenizer | None = None  # a pool worker's, built once from its spec (start_worker)


def tokenize(text: str, tokenizer: Tokenizer, eot: bool = True) -> np.ndarray:
    """The EOT token (unless eot=False) followed by the document's tokens; special-token text like
    "<|endoftext|>" inside a document is plain text."""
    return np.array([tokenizer.eot] * eot + tokenizer.encode(text), dtype=np.int64)  # ShardWriter checks the range


def tokenize_documents(texts: Iterable[str], tokenizer: Tokenizer, num_proc: int = 1,
                       eot: bool = True) -> Iterator[np.ndarray]:
    """tokenize() of each text, in input order whatever num_proc is (ordered imap), so shards don't depend on it."""
    if num_proc == 1:
        yield from (tokenize(text, tokenizer, eot) for text in texts)
        return
    # Workers ignore Ctrl-C: the main process gets it, and leaving this block (break, Ctrl-C) terminates them. Each
    # builds the tokenizer once from its spec, rather than receiving it with every chunk of documents.
    with multiprocessing.Pool(num_proc, initializer=start_worker, initargs=(tokenizer.spec,)) as pool:
        yield from pool.imap(functools.partial(tokenize_in_worker, eot=eot), texts, chunksize=16)


def start_worker(spec: TokenizerSpec) -> None:
    global worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker_tokenizer = tokenizer_from_spec(spec)


def tokenize_in_worker(text: str, eot: bool) -> np.ndarray:
    return tokenize(text, worker_tokenizer, eot)


def shard_size(text: str) -> int:
    """--shard_size's argparse type: a whole number of tokens a shard header can count (its int32), so that a huge
    one is an error naming the flag, not numpy's traceback allocating the buffer."""
    try:
        size = int(text)
    except ValueError:
        size = 0
    if not 1 <= size <= 2**31 - 1:
        raise argparse.ArgumentTypeError(f"{text}: a shard holds 1 to 2,147,483,647 tokens (its header counts them in "
                                         "an int32); the default, 100M, suits most corpora")
    return size


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
    and the writer stays at that shard boundary. The shards are `tokenizer`'s: their directory's manifest lists
    them under it, and their tokens are 32-bit where its vocabulary needs (dataloader.write_shard).
    """

    def __init__(self, shard_path: Callable[[int], Path], shard_size: int, desc: str, total: int | None = None,
                 shards: int = 0, documents: int = 0, offset: int = 0, max_shards: int | None = None,
                 on_shard: Callable[["ShardWriter"], None] | None = None, tokenizer: TokenizerSpec | None = None):
        self.shard_path, self.max_shards, self.on_shard = shard_path, max_shards, on_shard
        self.shards, self.documents, self.offset = shards, documents, offset
        self.tokenizer = tokenizer or gpt2_spec()
        self.buffer = np.empty(shard_size, dtype=np.uint16 if self.tokenizer.vocab_size <= 2**16 else np.uint32)
        self.fill = 0  # tokens in the buffer, not yet written
        self.tokens_added = 0  # by this run
        self.bar = tqdm(desc=desc, total=total, unit="tok", unit_scale=True, dynamic_ncols=True)

    def add(self, tokens: np.ndarray) -> None:
        """Append one document, as tokenize() returns it."""
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.tokenizer.vocab_size):
            raise ValueError(
                f"document {self.documents} (0-based, in input order; it would go into {self.shard_path(self.shards)}) "
                f"has token ids {tokens.min()}..{tokens.max()}, outside the vocabulary of its tokenizer, "
                f"{self.tokenizer.describe()}.")
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
        path = self.shard_path(self.shards)
        record_shards(path.parent, self.tokenizer, [path.name])  # listed first: see record_shards
        write_shard(path, tokens, self.tokenizer.vocab_size)  # atomic: an interrupted run leaves no half shard
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
                        yield without_lone_surrogates(row["text"])
                        continue
                raise UserError(f'{path}, line {line_number} {problem}. Each line of a JSON-lines file must be one '
                                'JSON object whose "text" field holds a document, e.g. {"text": "Anarchism is ..."}; '
                                'fix or delete that line and run the same command again.')
    except (OSError, EOFError, zlib.error) as e:  # gzip's errors for a file that is not gzip, or is cut short
        raise UserError(f"{path} could not be read ({type(e).__name__}: {e}): a truncated or corrupt file, or, for "
                        "a name ending in .gz, not gzip-compressed. Copy or download it again.") from e


def without_lone_surrogates(text: str) -> str:
    """text with each lone surrogate as U+FFFD, the replacement character. JSON's escapes can spell one ("\\ud800"),
    which is no character and has no UTF-8: tiktoken replaces it so as it encodes, and the tokenizers' and the bytes'
    encoders would fail on it mid-corpus. Replaced here, as JSON lines are read, every tokenizer sees the same text,
    and GPT-2's shards are what tiktoken made of it before."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # (a valid pair is one character already: json.loads joins "\\ud83d\\ude42")
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")  # tiktoken's own replacement
    return text


def read_documents(path: Path) -> list[str]:
    """A text file as one document, or a JSON-lines file's documents (data/prepare.py, data/train_tokenizer.py)."""
    if is_jsonl(path):
        return list(jsonl_texts(path))
    try:
        return [path.read_text(encoding="utf-8")]
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is {parse_problem(e)}: a text file is read as UTF-8. Convert it (e.g. with "
                        "`iconv -t utf-8`) and pass the converted copy.") from e


def split_val(documents: list[str], text_file: bool, val_fraction: float) -> tuple[list[str], list[str]]:
    """(val, train): a text file's last val_fraction of characters, or a JSON-lines file's last of documents."""
    if text_file:
        text = documents[0]
        cut = int(len(text) * (1 - val_fraction))
        return [text[cut:]], [text[:cut]]
    cut = int(len(documents) * (1 - val_fraction))
    return documents[cut:], documents[:cut]


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


PROGRESS = "progress.json"  # beside the shards: the corpus they are (source, --shard_size) and how far it got
PROGRESS_VERSION = 1  # of its format: PROGRESS_KEYS and "version"
PROGRESS_KEYS = {"source", "shard_size", "shards", "documents", "offset", "complete"}  # what write_progress writes


def check_corpus(output_dir: Path, source: str | list[str], shard_size: int) -> dict | None:
    """The progress an earlier run of the same corpus (source and shard size) recorded in output_dir, or None if it
    holds no shards. Before data/prepare.py or data/fineweb.py writes anything: a UserError naming what is in the way
    if output_dir holds another corpus's shards (its progress.json says so) or shards that no progress.json accounts
    for (another tool's, or named otherwise than ours), as the data loader reads every shard of a directory and would
    train on them with ours."""
    path = output_dir / PROGRESS
    progress = read_progress(path) if path.exists() else None
    if progress and (progress["source"], progress["shard_size"]) != (source, shard_size):
        raise UserError(f"{output_dir} already holds shards of {progress['source']} with --shard_size "
                        f"{progress['shard_size']} (see {path}), not of {source} with --shard_size {shard_size}. "
                        f"Pass another --output_dir, or delete {output_dir} to start over.")
    ours = re.compile(rf"{re.escape(output_dir.name)}_(train|val)_\d{{6}}\.bin")
    others = [name for name in shard_names(output_dir) if not (progress and ours.fullmatch(name))]
    if others:
        listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise UserError(f"{output_dir} already holds shards that no {PROGRESS} there accounts for ({listed}): another "
                        "corpus's, or written by other means. The data loader reads every shard of a directory, so "
                        f"it would train on them with these. Pass another --output_dir, or move them out of "
                        f"{output_dir}.")
    return progress


def read_progress(path: Path) -> dict:
    try:
        progress = json.loads(path.read_bytes())
        problem = None if isinstance(progress, dict) and PROGRESS_KEYS <= progress.keys() else \
            f"is not what this script writes (an object with {', '.join(sorted(PROGRESS_KEYS))})"
    except PARSE_ERRORS as e:
        problem = f"is {parse_problem(e)}"
    problem = problem or version_problem(progress, PROGRESS_VERSION, "progress files")
    if problem:
        raise UserError(f"{path} {problem}. Delete it, and the shards of {path.parent}, to write them all again.")
    return progress


def write_progress(output_dir: Path, progress: dict) -> None:
    """Record progress (PROGRESS_KEYS) in output_dir, atomically, like the shards."""
    text = json.dumps({"version": PROGRESS_VERSION} | progress, indent=1)
    atomic_write(output_dir / PROGRESS, lambda f: f.write(text.encode()))


def summary(documents: int, tokens: int, shards: int, seconds: float, output_dir: Path) -> str:
    return (f"wrote {shards} shard(s) to {output_dir}: documents {documents:,}, tokens {tokens:,}, {seconds:.1f} s, "
            f"{tokens / max(seconds, 1e-9):,.0f} tokens/s")

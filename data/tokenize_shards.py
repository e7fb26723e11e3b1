"""The one shard writer behind data/prepare.py and data/fineweb.py: documents (local text, JSON lines, parquet, or the
hub's stream) are read, tokenized (GPT-2's tokenizer, or --tokenizer's: tokenizer.py) and written as shards as a
stream, in memory that does not grow with the corpus, and a run killed at any point resumes where its progress.json
says (write_shards).

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
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from dataloader import MANIFEST, MANIFEST_VERSION, read_manifest, read_shard_header, shard_names, write_shard
from training.errors import UserError
from training.files import atomic_write, version_problem
from training.parsing import PARSE_ERRORS, parse_problem
from training.tokenizer import Tokenizer, TokenizerSpec, gpt2_spec, tokenizer_from_spec

BATCH_CHARS = 2**22  # text sent to the pool at a time; two batches in flight bound what is held, whatever the corpus
worker_tokenizer: Tokenizer | None = None  # a pool worker's, built once from its spec (start_worker)


def record_shards(data_dir: Path, tokenizer: TokenizerSpec, names: Sequence[str] = ()) -> None:
    """Before shards of `tokenizer` named `names` are written into data_dir, list them in its manifest (a crash leaves
    a name without a file, never the reverse); a UserError if it holds another tokenizer's shards, or no manifest."""
    manifest, existing = read_manifest(data_dir), shard_names(data_dir)
    if manifest is None and existing:
        raise UserError(f"{data_dir} holds shards ({existing[0]}, ...) but no {MANIFEST} naming their "
                        "tokenizer (llm.c's, another tool's), so new shards could not be told apart from them. Pass "
                        "another --output_dir (or delete this one to start over).")
    if manifest and manifest[0].sha256 != tokenizer.sha256:
        raise UserError(f"{data_dir} holds shards written with the tokenizer {manifest[0].describe()} (see "
                        f"{data_dir / MANIFEST}), not with {tokenizer.describe()}: one directory holds one tokenizer's "
                        "shards. Pass another --output_dir (or delete this one to start over).")
    if manifest is None or not set(names) <= set(manifest[1]):
        shards = sorted(set(manifest[1] if manifest else []) | set(names))
        text = json.dumps({"version": MANIFEST_VERSION, "tokenizer": tokenizer.to_dict(), "shards": shards}, indent=1)
        atomic_write(data_dir / MANIFEST, lambda f: f.write(text.encode()))


def tokenize(text: str, tokenizer: Tokenizer, eot: bool = True) -> np.ndarray:
    """The EOT token (unless eot=False) followed by the document's tokens; special-token text like
    "<|endoftext|>" inside a document is plain text."""
    return np.array([tokenizer.eot] * eot + tokenizer.encode(text), dtype=np.int64)  # ShardWriter checks the range


def tokenize_documents(texts: Iterable[str], tokenizer: Tokenizer, num_proc: int = 1,
                       eot: bool = True) -> Iterator[np.ndarray]:
    """tokenize() of each text, in input order whatever num_proc is, so shards don't depend on it."""
    if num_proc == 1:
        yield from (tokenize(text, tokenizer, eot) for text in texts)
        return
    # Workers ignore Ctrl-C: the main process gets it, and leaving this block (break, Ctrl-C) terminates them. Each
    # builds the tokenizer once from its spec, rather than receiving it with every chunk of documents. Batches, not
    # Pool.imap: imap's feeder thread would read the whole input ahead of the workers, into memory.
    with multiprocessing.Pool(num_proc, initializer=start_worker, initargs=(tokenizer.spec,)) as pool:
        in_flight = deque()
        for batch in text_batches(texts):
            in_flight.append(pool.map_async(functools.partial(tokenize_in_worker, eot=eot), batch, chunksize=16))
            if len(in_flight) == 2:  # the workers tokenize the newer while the older's tokens are written
                yield from in_flight.popleft().get()
        for batch in in_flight:
            yield from batch.get()


def text_batches(texts: Iterable[str]) -> Iterator[list[str]]:
    """texts in lists of about BATCH_CHARS characters."""
    batch, chars = [], 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


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
    """Appends documents' tokens to a split's stream and writes each `shard_size` tokens of it as the split's shard
    number 0, 1, ...

    (shards, documents, offset) is the stream position where the next shard starts: it is the split's shard number
    `shards`, the next document added is document number `documents` (counted over all splits), and its first `offset`
    tokens are already in shards. A restarted run passes the position it saved and feeds the documents from number
    `documents` on. `on_shard(writer)` runs after each full shard is written (write_shards records the position
    there). Once `max_shards` shards are written, add() stops and the writer stays at that shard boundary. The shards
    are `tokenizer`'s: their directory's manifest lists them under it, and their tokens are 32-bit where its vocabulary
    needs (dataloader.write_shard).
    """

    def __init__(self, shard_path: Callable[[int], Path], shard_size: int, desc: str, total: int | None = None,
                 shards: int = 0, documents: int = 0, offset: int = 0, max_shards: int | None = None,
                 on_shard: Callable[["ShardWriter"], None] | None = None, tokenizer: TokenizerSpec | None = None):
        self.shard_path, self.max_shards, self.on_shard = shard_path, max_shards, on_shard
        self.shards, self.documents, self.offset = shards, documents, offset
        self.tokenizer = tokenizer or gpt2_spec()
        self.buffer = np.empty(shard_size, dtype=np.uint16 if self.tokenizer.vocab_size <= 2**16 else np.uint32)
        self.fill = 0  # tokens in the buffer, not yet written
        self.tokens_added = self.shards_added = 0  # by this run
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
                if self.on_shard is not None:
                    self.on_shard(self)
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
        self.shards, self.shards_added, self.fill = self.shards + 1, self.shards_added + 1, 0


@dataclass
class Split:
    """The documents of a split (`texts()` gives them from the first, each time it is called) and its shards' names:
    val's, train's, or one stream whose first shard is val (shard_paths). `documents` counts them; write_shards needs
    it for every split but the last, to tell which split a saved position is in."""
    name: str
    shard_path: Callable[[int], Path]
    texts: Callable[[], Iterator[str]]
    documents: int | None = None


def write_shards(output_dir: Path, source: str | list[str], splits: list[Split], tokenizer: Tokenizer,
                 shard_size: int, num_proc: int = 1, eot: bool = True, max_shards: int | None = None) -> None:
    """Tokenize the splits' documents, in order, into shards in output_dir, resuming where its progress.json says.

    After each full shard, progress.json records the position where the next one starts (ShardWriter) and, after a
    split's last, shorter shard, the next split's start. The documents' order is fixed, so running the same command
    again reads past the documents already in shards without tokenizing them and carries on from there: a killed run
    loses at most the shard it was writing, and never leaves part of one under a shard's name. A run without
    --max_shards continues one with it; a finished one does nothing. A directory holding another corpus's shards is
    refused before anything is written (check_corpus)."""
    progress = check_corpus(output_dir, source, shard_size) or {"shards": 0, "documents": 0, "offset": 0,
                                                                "complete": False}
    index, start = split_at(splits, progress["documents"])
    check_finished_shards(output_dir, splits[index].shard_path, progress["shards"])
    record_shards(output_dir, tokenizer.spec)  # another tokenizer's shards there: a UserError, nothing written
    if progress["complete"] or (max_shards is not None and progress["shards"] >= max_shards):
        print(f"{output_dir} already has its {len(shard_names(output_dir))} shard(s) (see {output_dir / PROGRESS}); "
              "nothing to do.")
        return
    if progress["documents"]:
        print(f"resuming at {splits[index].shard_path(progress['shards']).name}: skipping the first "
              f"{progress['documents']:,} documents")

    def save(shards: int, documents: int, offset: int, complete: bool = False) -> None:
        write_progress(output_dir, {"source": source, "shard_size": shard_size, "shards": shards,
                                    "documents": documents, "offset": offset, "complete": complete})

    save(progress["shards"], progress["documents"], progress["offset"])  # before the first shard: its corpus named
    t0, documents, tokens, shards = time.time(), progress["documents"], 0, 0
    position = {key: progress[key] for key in ("shards", "documents", "offset")}
    for split in splits[index:]:
        total = (max_shards - position["shards"]) * shard_size if max_shards else None
        writer = ShardWriter(split.shard_path, shard_size, split.name, total=total, max_shards=max_shards,
                             on_shard=lambda w: save(w.shards, w.documents, w.offset), tokenizer=tokenizer.spec,
                             **position)
        texts = islice(split.texts(), writer.documents - start, None)
        with writer.bar:  # closed on an error too, which then starts a line of its own
            for document_tokens in tokenize_documents(texts, tokenizer, num_proc, eot):
                writer.add(document_tokens)
                if writer.shards == max_shards:
                    break
            writer.close(last_shard=writer.shards != max_shards)
        print(f"{split.name}: {writer.tokens_added:,} tokens in {writer.shards_added} shard(s)")
        tokens, shards = tokens + writer.tokens_added, shards + writer.shards_added
        if writer.shards == max_shards:
            break
        last = split is splits[-1]
        save(writer.shards if last else 0, writer.documents, 0, complete=last)  # (a split's start: its shard 0)
        position, start = {"shards": 0, "documents": writer.documents, "offset": 0}, writer.documents
    print(summary(writer.documents - documents, tokens, shards, time.time() - t0, output_dir))


def split_at(splits: list[Split], document: int) -> tuple[int, int]:
    """(the index of the split that document number `document` is in, the number of its first document)."""
    start = 0
    for index, split in enumerate(splits[:-1]):
        if document < start + split.documents:
            return index, start
        start += split.documents
    return len(splits) - 1, start


def check_finished_shards(output_dir: Path, shard_path: Callable[[int], Path], shards: int) -> None:
    """The shards progress.json lists as finished are there, whole; a UserError naming the first that is not."""
    for i in range(shards):
        try:
            read_shard_header(shard_path(i))
        except (OSError, UserError) as e:
            raise UserError(f"{e} {output_dir / PROGRESS} lists this shard as finished. Delete {output_dir / PROGRESS} "
                            f"and the shards of {output_dir} to write them all again.") from e


def is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz"))


def file_texts(path: Path) -> Iterator[str]:
    """A file's documents, in order: a parquet file's `text` column, a JSON-lines file's "text" fields (its name
    ends in .jsonl or .jsonl.gz), or a text file whole."""
    if path.suffix == ".parquet":
        yield from parquet_texts(path)
    elif is_jsonl(path):
        yield from jsonl_texts(path)
    else:
        yield text_file(path)


def count_documents(path: Path) -> int:
    """How many documents file_texts(path) gives, without parsing them (a cheap pass: the val split's cut)."""
    if path.suffix == ".parquet":
        return parquet_file(path).metadata.num_rows
    return sum(1 for _ in jsonl_lines(path)) if is_jsonl(path) else 1


def jsonl_texts(path: Path) -> Iterator[str]:
    """The "text" of each line of a JSON-lines file (gzip-compressed if its name ends in .gz), in order. Blank lines
    are skipped (a trailing one is common); any other line must be a JSON object with a string "text"."""
    for line_number, line in jsonl_lines(path):
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
        raise UserError(f'{path}, line {line_number} {problem}. Each line of a JSON-lines file must be one JSON '
                        'object whose "text" field holds a document, e.g. {"text": "Anarchism is ..."}; fix or delete '
                        'that line and run the same command again.')


def jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of each line of a JSON-lines file that is not blank."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            yield from ((number, line) for number, line in enumerate(f, 1) if line.strip())
    except (OSError, EOFError, zlib.error) as e:  # gzip's errors for a file that is not gzip, or is cut short
        raise UserError(f"{path} could not be read ({type(e).__name__}: {e}): a truncated or corrupt file, or, for "
                        "a name ending in .gz, not gzip-compressed. Copy or download it again.") from e


def parquet_texts(path: Path) -> Iterator[str]:
    try:
        for batch in parquet_file(path).iter_batches(columns=["text"]):
            yield from batch.column("text").to_pylist()
    except (pa.ArrowException, OSError) as e:  # truncated, corrupt
        raise parquet_error(path, e) from e


def parquet_file(path: Path) -> pq.ParquetFile:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:  # not parquet
        raise parquet_error(path, e) from e
    if "text" not in parquet.schema_arrow.names:
        raise UserError(f"{path} has no `text` column (it has {parquet.schema_arrow.names}); --input files need "
                        "one, holding each document's text.")
    return parquet


def parquet_error(path: Path, error: Exception) -> UserError:
    return UserError(f"{path} could not be read as a parquet file ({type(error).__name__}: {error}); it is truncated, "
                     "corrupt or not parquet. Copy or download it again.")


def text_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is {parse_problem(e)}: a text file is read as UTF-8. Convert it (e.g. with "
                        "`iconv -t utf-8`) and pass the converted copy.") from e


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
    """A text file as one document, or a JSON-lines file's documents (data/train_tokenizer.py)."""
    return list(jsonl_texts(path)) if is_jsonl(path) else [text_file(path)]


def split_val(documents: list[str], whole_text: bool, val_fraction: float) -> tuple[list[str], list[str]]:
    """(val, train): a text file's last val_fraction of characters, or a JSON-lines file's last of documents."""
    if whole_text:
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

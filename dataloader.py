"""Sharded token files and the loader that gives each rank its own slice of them.

Shard format (llm.c's, so data is interchangeable with it): a header of 256 little-endian int32
[MAGIC, VERSION, num_tokens, 0, ...] followed by num_tokens little-endian uint16 token ids. Shards live in
one directory as <anything>_train_<NNNNNN>.bin and <anything>_val_<NNNNNN>.bin.

The stream is cut into chunks of B·T tokens (plus the one next token as the last target). Every micro-step
consumes world_size consecutive chunks, rank r taking the r-th; every optimizer step consumes
chunks_per_step = world_size·grad_accum_steps of them. A shard is used up to a whole number of optimizer
steps, then all ranks move to the next shard together. So the chunks a step trains on depend only on B, T and
the total batch, never on how they are split across ranks, and the loader's position is the same on every
rank: a 2-rank snapshot resumes on 1 rank at exactly the next tokens.

Document-aligned batches (align_bos=True): every row starts at a document's first token, the token after an EOT (or
a shard's first token, unless that is an EOT), or continues a document longer than a row. Each shard's documents are
packed into rows of T+1 tokens (x and its shifted y) by pack_rows, before and independently of the ranks: best fit
from a window of the next PACK_WINDOW documents, the largest that fits the row's space left; when none fits, the
shortest is cropped to fill the row and its rest dropped. A document longer than a row is first cut into rows of its
own, each continuing it, and a shorter tail that ends a row started by another document. No token is padding; the
share cropped is pack_rows' second result (dev/align_bos_waste.py measures it on enwiki). A chunk is then B
consecutive packed rows instead of B·T consecutive tokens, and everything above (chunk order, ranks, steps, state)
is unchanged.

Shards are read with plain reads, each checked to return every byte asked for, never through a memory map: a shard
truncated under a running job (a copy or a download over it in place) is then a ShardReadError naming it, where a
memory map would kill the process with SIGBUS and no snapshot. The train loader reads each optimizer step's batches
ahead (read_ahead), between steps, so that a failed read stops every rank together with a snapshot
(train_gpt2.run) instead of one rank failing inside a step while the others wait for it in a collective.
"""

import bisect
import hashlib
import os
import re
from collections.abc import Iterator
from contextlib import closing
from io import FileIO
from pathlib import Path

import numpy as np
import torch

from errors import UserError
from files import atomic_write

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
EOT = 50256  # GPT-2's <|endoftext|>, written before every document (data/tokenize_shards.py)
PACK_WINDOW = 1000  # documents pack_rows chooses from: a wider window wastes less and packs slower
SCAN_TOKENS = 2**20  # tokens read at a time when the loader checks a whole shard (2 MiB)


def write_shard(path: str | Path, tokens: np.ndarray) -> None:
    """Write tokens as a shard, atomically: a crash leaves either no file or a complete one under `path`."""
    tokens = np.asarray(tokens)
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: token ids must be integers, got dtype {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: token ids must fit in uint16 (0..65535), got range {tokens.min()}..{tokens.max()}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, tokens.size)

    def write(f) -> None:
        f.write(header.tobytes())
        f.write(tokens.astype(TOKEN_DTYPE).tobytes())

    atomic_write(path, write)


def read_shard_header(path: str | Path) -> int:
    """Check a shard's header against its size; returns the number of tokens. Raises UserError naming the file."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise UserError(f"{path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte shard header; "
                         "it is truncated or not a token shard. Delete it and re-run the data preparation script.")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise UserError(f"{path}: bad magic number {header[0]} (expected {MAGIC}); this is not a token shard of the "
                         "llm.c format. Re-create it with data/prepare.py or data/fineweb.py.")
    if header[1] != VERSION:
        raise UserError(f"{path}: unsupported shard version {header[1]} (expected {VERSION}). "
                         "Re-create it with data/prepare.py or data/fineweb.py.")
    num_tokens = int(header[2])
    expected = HEADER_BYTES + num_tokens * TOKEN_DTYPE.itemsize
    if size != expected:
        raise UserError(f"{path}: header says {num_tokens} tokens ({expected} bytes) but the file has {size} bytes; "
                         "it was cut off mid-write or corrupted. Delete it and re-run the data preparation script.")
    return num_tokens


def find_shards(data_dir: str | Path, split: str) -> list[Path]:
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise UserError(f"data directory {data_dir} does not exist; prepare data first, e.g. "
                                "`python -m data.prepare --source shakespeare`, or point --data_dir at your shards.")
    pattern = re.compile(rf".*_{split}_\d+\.bin")
    shards = sorted(p for p in data_dir.iterdir() if pattern.fullmatch(p.name))
    if not shards:
        raise UserError(f"no {split} shards (files named <name>_{split}_<NNNNNN>.bin) in {data_dir}; "
                                "prepare data first, e.g. `python -m data.prepare --source shakespeare`.")
    for path in shards:
        if not path.is_file():
            raise UserError(f"{path} is a directory (or another non-file) named like a {split} shard. Shards are "
                            f"files; move it out of {data_dir} or rename it.")
    return shards


class ShardReadError(UserError):
    """A shard that could not be read while the run used it (truncated or rewritten in place, an I/O error)."""


class Shard:
    """An open shard whose tokens are read with plain reads: read() returns every token asked for or raises
    ShardReadError naming the file. The file stays open, so a new shard renamed over it (as data/prepare.py and
    data/fineweb.py write them) does not change what this one reads."""

    def __init__(self, path: Path, num_tokens: int):
        self.path, self.num_tokens = path, num_tokens
        self.file = FileIO(path, "r")

    def read(self, start: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens start..start+count-1 (uint16), in `out` (count tokens) if given."""
        tokens = np.empty(count, dtype=TOKEN_DTYPE) if out is None else out
        buffer = memoryview(tokens).cast("B")
        done = 0
        try:
            self.file.seek(HEADER_BYTES + start * TOKEN_DTYPE.itemsize)
            while done < len(buffer) and (n := self.file.readinto(buffer[done:])):
                done += n
        except OSError as e:
            raise ShardReadError(f"{self.path}: reading tokens {start:,} to {start + count - 1:,} failed "
                                 f"({type(e).__name__}: {e.strerror or e}).") from e
        if done < len(buffer):
            size = os.fstat(self.file.fileno()).st_size
            expected = HEADER_BYTES + self.num_tokens * TOKEN_DTYPE.itemsize
            raise ShardReadError(f"{self.path}: the shard is now {size:,} bytes, shorter than the {expected:,} "
                                 f"({self.num_tokens:,} tokens) it had when the run started, so tokens {start:,} to "
                                 f"{start + count - 1:,} could not be read: it was truncated or rewritten in place "
                                 "while the run read it.")
        return tokens

    def blocks(self) -> Iterator[tuple[int, np.ndarray]]:
        """The whole shard as (start, tokens) in pieces of SCAN_TOKENS, read into one buffer: each piece is valid
        until the next is read (a buffer the size of a CPU cache, reused, reads about as fast as a memory map)."""
        buffer = np.empty(min(SCAN_TOKENS, self.num_tokens), dtype=TOKEN_DTYPE)
        for start in range(0, self.num_tokens, SCAN_TOKENS):
            count = min(SCAN_TOKENS, self.num_tokens - start)
            yield start, self.read(start, count, out=buffer[:count])

    def close(self) -> None:
        self.file.close()


def check_token_ids(shard: Shard, vocab_size: int) -> None:
    """UserError naming the shard and the position if an id is outside the model's vocabulary, where it would fail
    mid-step (an IndexError, or a device-side assert on CUDA). One pass over the shard: see the README for its cost."""
    largest, position, token = 0, None, None
    for start, tokens in shard.blocks():
        largest = max(largest, int(tokens.max()))
        if position is None and largest >= vocab_size:
            offset = int(np.argmax(tokens >= vocab_size))
            position, token = start + offset, int(tokens[offset])
    if position is not None:
        raise UserError(f"{shard.path}: token id {token} at position {position:,} is not in the model's vocabulary of "
                        f"{vocab_size:,} ids (the largest id in the shard is {largest:,}); the shard was made with "
                        "another tokenizer, or is corrupt. Re-create it with data/prepare.py or data/fineweb.py "
                        "(GPT-2's tokenizer), or move it out of the data directory.")


def document_starts(tokens: np.ndarray) -> np.ndarray:
    """Where the shard's documents start: after each EOT, and at 0 unless the shard opens with an EOT."""
    starts = np.flatnonzero(tokens[:-1] == EOT) + 1
    return starts if tokens[0] == EOT else np.concatenate([[0], starts])


def pack_rows(tokens: np.ndarray, row_len: int, split_long: bool = True) -> tuple[list[np.ndarray], int]:
    """Best-fit packing of the shard's documents into rows of row_len tokens (see the module doc).

    A document longer than a row is cut into row_len pieces and a shorter tail (split_long; without it, cropped
    like any document that does not fit): its first piece is a row starting at its first token, each later piece a
    row of its own continuing it, and the tail fills the end of a row that starts with another document, never a
    row's start. Returns (rows, cropped): rows[i] is row i's (start, length) pieces of `tokens` in order, an int64
    array (pieces, 2), and cropped the number of the shard's tokens in no row. Deterministic: it depends only on
    the tokens, row_len and split_long.
    """
    starts = document_starts(tokens)
    lengths = np.diff(np.append(starts, tokens.size))
    # (length, start) sorted, ties to the later start: documents (may start a row) and tails (may not)
    documents: list[tuple[int, int]] = []
    tails: list[tuple[int, int]] = []
    next_document, rows, row, space = 0, [], [], row_len
    while True:
        # (tails cannot start a row: a window of only tails reads on)
        while (len(documents) + len(tails) < PACK_WINDOW or not documents) and next_document < starts.size:
            start, length = int(starts[next_document]), int(lengths[next_document])
            next_document += 1
            if split_long and length > row_len:
                rows += [[(piece, row_len)] for piece in range(start, start + length - row_len + 1, row_len)]
                start, length = start + length // row_len * row_len, length % row_len
                if length:
                    bisect.insort(tails, (length, start))
            else:
                bisect.insort(documents, (length, start))
        candidates = [documents] if space == row_len else [documents, tails]
        candidates = [units for units in candidates if units]
        if not candidates:
            break
        fits = [(units[i], units, i) for units in candidates
                if (i := bisect.bisect_right(units, (space, tokens.size)) - 1) >= 0]
        if fits:
            _, units, i = max(fits)
        else:  # nothing fits: crop the shortest
            _, units, i = min((units[0], units, 0) for units in candidates)
        length, start = units.pop(i)
        taken = min(length, space)
        row.append((start, taken))
        space -= taken
        if space == 0:
            rows.append(row)
            row, space = [], row_len
    return [np.array(row, dtype=np.int64) for row in rows], tokens.size - len(rows) * row_len


class DistributedDataLoader:
    def __init__(self, data_dir: str | Path, split: str, B: int, T: int, rank: int = 0, world_size: int = 1,
                 grad_accum_steps: int = 1, shuffle: bool = False, seed: int = 0, vocab_size: int | None = None,
                 align_bos: bool = False):
        """vocab_size: the model's; every token id is checked to be below it (None: not checked). align_bos: rows
        start at documents' first tokens (see the module doc)."""
        self.B, self.T, self.rank, self.world_size, self.align_bos = B, T, rank, world_size, align_bos
        self.chunks_per_step = world_size * grad_accum_steps
        self.shuffle, self.seed = shuffle, seed
        self.data_dir, self.shards = str(data_dir), find_shards(data_dir, split)
        # Check every header now, so a bad shard fails the run in its first second rather than hours in.
        self.shard_tokens = [read_shard_header(p) for p in self.shards]
        step_tokens = self.chunks_per_step * B * T + 1
        for path, n in zip(self.shards, self.shard_tokens):
            if n < step_tokens:
                raise UserError(f"{path}: shard has {n} tokens, fewer than one optimizer step needs ({step_tokens} = "
                                 f"{self.chunks_per_step} chunks of B·T = {B}·{T}, +1). Use a smaller "
                                 "--total_batch_size / --micro_batch_size / --seq_len, or larger shards.")
        # One look at every shard's tokens: an id the model has no embedding for fails the run now too, and the
        # shards' sizes, first and last tokens, in order, tell which data this is, whatever directory holds it.
        fingerprint = hashlib.sha256()
        for path, n in zip(self.shards, self.shard_tokens):
            with closing(Shard(path, n)) as shard:
                if vocab_size is not None:
                    check_token_ids(shard, vocab_size)
                ends = shard.read(0, min(n, 256)).tobytes() + shard.read(max(0, n - 256), min(n, 256)).tobytes()
            fingerprint.update(np.array(n, dtype="<i8").tobytes() + ends)
        self.data_fingerprint = fingerprint.hexdigest()[:16]
        self.shard: Shard | None = None
        self.reset()

    def reset(self, epoch: int = 0) -> None:
        """Back to the start of the stream (validation calls this before every evaluation)."""
        self.epoch = epoch
        self.shard_position = 0  # index into this epoch's shard order
        self.chunk_position = 0  # index into the current shard's chunk order, the same on every rank
        self._forget_read_ahead()
        self._open_shard()

    def _open_shard(self) -> None:
        if self.shuffle:
            shard_order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.shards))
            shard_index = int(shard_order[self.shard_position])
        else:
            shard_index = self.shard_position
        num_tokens = self.shard_tokens[shard_index]
        if self.shard is not None:
            self.shard.close()
        self.shard = Shard(self.shards[shard_index], num_tokens)
        if self.align_bos:  # the whole shard in memory: packing reads every token anyway
            self.tokens = self.shard.read(0, num_tokens)
            self.rows, _ = pack_rows(self.tokens, self.T + 1)  # rebuilt on every opening: resuming needs no more
            num_chunks = len(self.rows) // self.B
            if num_chunks < self.chunks_per_step:
                raise UserError(f"{self.shards[shard_index]}: its documents pack into {len(self.rows)} rows of "
                                f"--seq_len + 1 = {self.T + 1} tokens under --align_bos, fewer than one optimizer step "
                                f"needs ({self.chunks_per_step} chunks of {self.B} rows). Its documents (separated by "
                                "<|endoftext|>) are too few or too long; use a smaller --total_batch_size / "
                                "--seq_len, larger shards, or leave out --align_bos.")
        else:
            num_chunks = (num_tokens - 1) // (self.B * self.T)
        self.usable_chunks = num_chunks - num_chunks % self.chunks_per_step
        if self.shuffle:  # a fresh chunk order per (seed, epoch, shard), cheap to recompute on resume
            self.chunk_order = np.random.default_rng([self.seed, self.epoch, shard_index]).permutation(num_chunks)
        else:
            self.chunk_order = np.arange(num_chunks)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (x, y) for one micro-step, each (B, T) int64 on the CPU; y is x shifted by one token. Raises
        ShardReadError if the shard cannot be read."""
        if self._ahead:
            batch = self._ahead.pop(0)
            if not self._ahead:
                self._ahead_from = None
            return batch
        return self._read_batch()

    def read_ahead(self) -> None:
        """Read this rank's micro-batches of the next optimizer step now; next_batch hands them out. A shard that
        cannot be read raises ShardReadError here, between steps. Until they are handed out, state_dict is the
        position before them: a snapshot taken now resumes at that step (after a ShardReadError too, when the
        position is all the loader is good for until load_state_dict)."""
        if self._ahead_from is None:
            self._ahead_from = (self.epoch, self.shard_position, self.chunk_position)
        while len(self._ahead) < self.chunks_per_step // self.world_size:
            self._ahead.append(self._read_batch())

    def _forget_read_ahead(self) -> None:
        self._ahead: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ahead_from: tuple[int, int, int] | None = None  # (epoch, shard_position, chunk_position)

    def _read_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.B, self.T
        chunk = int(self.chunk_order[self.chunk_position + self.rank])
        if self.align_bos:  # B consecutive packed rows of T+1 tokens, each its own x and y
            pieces = np.concatenate(self.rows[chunk * B : (chunk + 1) * B])
            buf = np.concatenate([self.tokens[start : start + n] for start, n in pieces]).astype(np.int64)
            rows = torch.from_numpy(buf).view(B, T + 1)
            x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        else:  # B consecutive T-token runs: B·T tokens in one slice, then reshaped
            buf = torch.from_numpy(self.shard.read(chunk * B * T, B * T + 1).astype(np.int64))  # uint16 until here
            x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.chunk_position += self.world_size
        if self.chunk_position >= self.usable_chunks:
            self.chunk_position = 0
            self.shard_position += 1
            if self.shard_position == len(self.shards):
                self.shard_position = 0
                self.epoch += 1
            self._open_shard()
        return x, y

    def state_dict(self) -> dict[str, int | str]:
        # B·T and chunks_per_step give the position its meaning; rank and world size do not (see module doc).
        epoch, shard_position, chunk_position = self._ahead_from or (self.epoch, self.shard_position,
                                                                     self.chunk_position)
        return {"epoch": epoch, "shard_position": shard_position, "chunk_position": chunk_position,
                "chunk_tokens": self.B * self.T, "chunks_per_step": self.chunks_per_step,
                "num_shards": len(self.shards), "shuffle": int(self.shuffle), "seed": self.seed, "seq_len": self.T,
                "align_bos": int(self.align_bos),
                "data_dir": self.data_dir, "data_fingerprint": self.data_fingerprint}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        mine = self.state_dict()
        # (a snapshot from before the fingerprint and seq_len were kept passes those two checks)
        if state.get("data_fingerprint", self.data_fingerprint) != self.data_fingerprint:
            raise UserError(
                f"cannot resume the data loader: the snapshot's run read other shards (--data_dir {state['data_dir']}, "
                f"{state['num_shards']} shards) than this run's --data_dir {self.data_dir} holds ({len(self.shards)} "
                "shards, with other sizes or tokens), so its position would fall somewhere in other data. Pass "
                "the --data_dir of the snapshot's run (a copy of its shards elsewhere resumes as well), or start a "
                "new run on this data from the snapshot's weights with --init_from SNAPSHOT.")
        for key in ("chunk_tokens", "chunks_per_step", "num_shards", "shuffle", "seed", "align_bos"):
            if state.get(key, 0) != mine[key]:  # (snapshots from before --align_bos had none: 0)
                raise UserError(
                    f"cannot resume the data loader: the snapshot was taken with {key}={state.get(key, 0)}, this run "
                    f"has {key}={mine[key]}. Resuming would re-read or skip data. Keep --micro_batch_size·--seq_len, "
                    "--total_batch_size, the data directory, --shuffle, --seed and --align_bos as they were (the "
                    "number of ranks may change), or start a fresh run with --resume never.")
        if state.get("seq_len", self.T) != self.T:
            raise UserError(
                f"cannot resume the data loader: the snapshot's run cut its chunks of {self.B * self.T} tokens into "
                f"sequences of --seq_len {state['seq_len']}, and this run into sequences of --seq_len {self.T}: the "
                "same tokens, but from here on the model would train and be validated at another context length, and "
                f"the loss curves would jump. Pass --seq_len {state['seq_len']} --micro_batch_size "
                f"{self.B * self.T // state['seq_len']}, or start a new run from the snapshot's weights with "
                "--init_from SNAPSHOT.")
        if state["chunk_position"] % self.chunks_per_step:
            raise UserError(f"cannot resume the data loader: its state (chunk_position {state['chunk_position']}) "
                             "was taken in the middle of an optimizer step; snapshots are only valid between steps.")
        self.epoch, self.shard_position = state["epoch"], state["shard_position"]
        self._forget_read_ahead()
        self._open_shard()
        self.chunk_position = state["chunk_position"]

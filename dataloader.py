"""Sharded token files (llm.c's format), and the loader that gives each rank its own chunks of them, the same chunks
for any number of ranks. docs/data.md says how: the shard format, the chunk stream, --align_bos, the checks at start-up
and the shards that change under a run (ShardWatch)."""

import hashlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import closing
from io import FileIO
from pathlib import Path

import numpy as np
import torch

from training.errors import UserError
from training.files import atomic_write, version_problem
from training.packing import pack_rows
from training.parsing import PARSE_ERRORS, parse_problem
from training.tokenizer import TokenizerSpec, gpt2_spec

MAGIC, VERSION = 20240520, 1
MAGIC_32, VERSION_32 = 20240801, 7  # llm.c's header for uint32 tokens (its Llama 3 shards): vocabularies over 2**16
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
TOKEN_DTYPES = {(MAGIC, VERSION): TOKEN_DTYPE, (MAGIC_32, VERSION_32): np.dtype("<u4")}
EOT = 50256  # GPT-2's <|endoftext|>, before every document (data/tokenize_shards.py); other data: its manifest's eot
MANIFEST = "manifest.json"  # beside the shards: the tokenizer that wrote them and their names (read_data_tokenizer)
MANIFEST_VERSION = 1  # of its format: {"version", "tokenizer", "shards"}
SCAN_TOKENS = 2**20  # tokens read at a time when the loader checks a whole shard (2 MiB)


def write_shard(path: str | Path, tokens: np.ndarray, vocab_size: int = 2**16) -> None:
    """Write tokens as a shard, atomically (no file or a complete one), uint16 unless vocab_size needs uint32."""
    tokens = np.asarray(tokens)
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: token ids must be integers, got dtype {tokens.dtype}")
    magic, version = (MAGIC, VERSION) if vocab_size <= 2**16 else (MAGIC_32, VERSION_32)
    dtype = TOKEN_DTYPES[magic, version]
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise ValueError(f"{path}: token ids must fit in {dtype.name} (0..{np.iinfo(dtype).max}), got range "
                         f"{tokens.min()}..{tokens.max()}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, version, tokens.size)
    # (ascontiguousarray: no copy where the ids are already of dtype)
    atomic_write(path, lambda f: f.writelines([header.tobytes(), np.ascontiguousarray(tokens, dtype=dtype)]))


def read_shard_header(path: str | Path) -> int:
    return read_shard_layout(path)[0]


def read_shard_layout(path: str | Path) -> tuple[int, np.dtype]:
    """(the number of tokens, their dtype) of a shard whose header agrees with its size, else a UserError."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise UserError(f"{path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte shard header; "
                         "it is truncated or not a token shard. Delete it and re-run the data preparation script.")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] not in (MAGIC, MAGIC_32):
        raise UserError(f"{path}: bad magic number {header[0]} (expected {MAGIC}); this is not a token shard of the "
                         "llm.c format. Re-create it with data/prepare.py or data/fineweb.py.")
    dtype = TOKEN_DTYPES.get((int(header[0]), int(header[1])))
    if dtype is None:
        raise UserError(f"{path}: unsupported shard version {header[1]} (expected {VERSION}, or {VERSION_32} under "
                        f"magic {MAGIC_32}: uint32 tokens). Re-create it with data/prepare.py or data/fineweb.py.")
    num_tokens = int(header[2])
    expected = HEADER_BYTES + num_tokens * dtype.itemsize
    if size != expected:
        raise UserError(f"{path}: header says {num_tokens} tokens ({expected} bytes) but the file has {size} bytes; "
                         "it was cut off mid-write or corrupted. Delete it and re-run the data preparation script.")
    return num_tokens, dtype


def find_shards(data_dir: str | Path, split: str) -> list[Path]:
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise UserError(f"data directory {data_dir} does not exist; prepare data first, e.g. "
                        "`python -m data.prepare --source shakespeare`, or point --data_dir at your shards.")
    shards = [data_dir / name for name in shard_names(data_dir, split)]
    if not shards:
        raise UserError(f"no {split} shards (files named <name>_{split}_<NNNNNN>.bin) in {data_dir}; "
                        "prepare data first, e.g. `python -m data.prepare --source shakespeare`.")
    for path in shards:
        if not path.is_file():
            raise UserError(f"{path} is a directory (or another non-file) named like a {split} shard. Shards are "
                            f"files; move it out of {data_dir} or rename it.")
    manifest = read_manifest(data_dir)
    unlisted = [path for path in shards if manifest and path.name not in manifest[1]]
    if unlisted:
        raise UserError(f"{unlisted[0]} is not one of the shards that {data_dir / MANIFEST} lists as written with the "
                        f"tokenizer {manifest[0].describe()} (one directory holds one tokenizer's shards). Move it out "
                        f"of {data_dir}, or write it into this directory with data/prepare.py or data/fineweb.py.")
    return shards


def shard_names(data_dir: Path, split: str = "(train|val)") -> list[str]:
    """The names of data_dir's files named like shards of split: <name>_<split>_NNNNNN.bin."""
    return sorted(p.name for p in data_dir.iterdir() if re.fullmatch(rf".*_{split}_\d+\.bin", p.name))


def read_manifest(data_dir: str | Path) -> tuple[TokenizerSpec, list[str]] | None:
    """data_dir's manifest: (the tokenizer that wrote its shards, their names); None where there is none. One that
    cannot be read (a symbolic link to nothing) is a UserError: taken as none, its shards would be read as GPT-2's."""
    path = Path(data_dir) / MANIFEST
    if not os.path.lexists(path):
        return None
    fix = ("It records the tokenizer that wrote the shards beside it; write them again with data/prepare.py or "
           "data/fineweb.py into a new --output_dir.")
    try:
        manifest = json.loads(path.read_bytes())
    except PARSE_ERRORS as e:
        raise UserError(f"{path} is {parse_problem(e)}. {fix}") from e
    except OSError as e:
        link = f", a symbolic link to {os.readlink(path)}" if path.is_symlink() else ""
        raise UserError(f"{path}{link}, could not be read ({e.strerror}). {fix}") from e
    if isinstance(manifest, dict) and (problem := version_problem(manifest, MANIFEST_VERSION, "manifests")):
        raise UserError(f"{path} {problem}. {fix}")
    if not (isinstance(manifest, dict) and manifest.keys() == {"version", "tokenizer", "shards"}
            and isinstance(manifest["shards"], list) and all(isinstance(name, str) for name in manifest["shards"])):
        raise UserError(f'{path} is not what data/prepare.py and data/fineweb.py write (an object with "version", '
                        f'"tokenizer" and "shards", a list of file names). {fix}')
    try:
        return TokenizerSpec.from_dict(manifest["tokenizer"], str(path)), manifest["shards"]
    except ValueError as e:  # the message names the file and what is wrong
        raise UserError(f"{e}. {fix}") from e


def read_data_tokenizer(data_dir: str | Path) -> TokenizerSpec:
    """The tokenizer of data_dir's shards: its manifest's, or GPT-2's where it has none (llm.c's shards)."""
    manifest = read_manifest(data_dir)
    return manifest[0] if manifest else gpt2_spec()


class ShardReadError(UserError):
    """A shard that changed under the run (ShardWatch) or could not be read (a short read, an I/O error)."""


class ShardWatch:
    """Each shard's os.stat at the start; check(*paths): a ShardReadError naming the first of paths (default: every
    shard) that changed (docs/data.md)."""

    def __init__(self, paths: list[Path]):
        self.started = {path: os.stat(path) for path in paths}

    def check(self, *paths: Path) -> None:
        for path in paths or self.started:
            change = shard_change(path, self.started[path])
            if change:
                raise ShardReadError(f"{path}: {change}.")


def shard_change(path: Path, then: os.stat_result) -> str | None:
    """How the file at `path` differs from `then`, its os.stat when the run started, in words; None if it does not."""
    try:
        now = os.stat(path)
    except OSError as e:
        return f"the shard was deleted or moved away since the run started ({e.strerror})"
    if (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino):
        return (f"another file ({now.st_size:,} bytes) took the shard's place since the run started: one renamed or "
                "moved over it, or the shard deleted and written anew")
    if now.st_size != then.st_size:
        return (f"the shard is now {now.st_size:,} bytes, not the {then.st_size:,} it had when the run started: it "
                "was truncated, appended to or rewritten in place")
    if now.st_ctime_ns != then.st_ctime_ns:
        return (f"the shard was written to in place since the run started: the same {now.st_size:,} bytes, but its "
                "change time (ctime) moved (a chmod, chown or new hard link moves it too)")
    return None


class Shard:
    """An open shard, read with plain reads (docs/data.md): every token asked for, or a ShardReadError naming it."""

    def __init__(self, path: Path, num_tokens: int, dtype: np.dtype = TOKEN_DTYPE):
        self.path, self.num_tokens, self.dtype = path, num_tokens, dtype  # (dtype: read_shard_layout's)
        try:
            self.file = FileIO(path, "r")
        except OSError as e:
            raise ShardReadError(f"{path}: the shard could not be opened ({e.strerror}).") from e

    def read(self, start: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens start..start+count-1 (the shard's dtype), in `out` (count tokens) if given."""
        tokens = np.empty(count, dtype=self.dtype) if out is None else out
        buffer = memoryview(tokens).cast("B")
        done = 0
        try:
            self.file.seek(HEADER_BYTES + start * self.dtype.itemsize)
            while done < len(buffer) and (n := self.file.readinto(buffer[done:])):
                done += n
        except OSError as e:
            raise ShardReadError(f"{self.path}: reading tokens {start:,} to {start + count - 1:,} failed "
                                 f"({type(e).__name__}: {e.strerror or e}).") from e
        if done < len(buffer):
            size = os.fstat(self.file.fileno()).st_size
            expected = HEADER_BYTES + self.num_tokens * self.dtype.itemsize
            raise ShardReadError(f"{self.path}: the shard is now {size:,} bytes, shorter than the {expected:,} "
                                 f"({self.num_tokens:,} tokens) it had when the run started, so tokens {start:,} to "
                                 f"{start + count - 1:,} could not be read: it was truncated or rewritten in place "
                                 "while the run read it.")
        return tokens

    def blocks(self) -> Iterator[tuple[int, np.ndarray]]:
        """The whole shard as (start, tokens) in pieces of SCAN_TOKENS, each in one reused buffer until the next."""
        buffer = np.empty(min(SCAN_TOKENS, self.num_tokens), dtype=self.dtype)
        for start in range(0, self.num_tokens, SCAN_TOKENS):
            count = min(SCAN_TOKENS, self.num_tokens - start)
            yield start, self.read(start, count, out=buffer[:count])

    def close(self) -> None:
        self.file.close()


def check_token_ids(shard: Shard, vocab_size: int) -> None:
    """UserError naming the shard and the position of an id outside the model's vocabulary (it would fail mid-step)."""
    largest, position, token = 0, None, None
    for start, tokens in shard.blocks():
        largest = max(largest, int(tokens.max()))
        if position is None and largest >= vocab_size:
            offset = int(np.argmax(tokens >= vocab_size))
            position, token = start + offset, int(tokens[offset])
    if position is not None:
        raise UserError(f"{shard.path}: token id {token} at position {position:,} is not in the model's vocabulary of "
                        f"{vocab_size:,} ids (the largest id in the shard is {largest:,}); the shard was made with "
                        "another tokenizer than the model's, or is corrupt. Re-create it with data/prepare.py or "
                        "data/fineweb.py (--tokenizer: the model's), or move it out of the data directory.")


def check_shard_fills_a_step(path: Path, num_tokens: int, chunks_per_step: int, B: int, T: int) -> None:
    """A UserError unless a shard of num_tokens tokens holds one optimizer step's chunks of B·T tokens (+1)."""
    step_tokens = chunks_per_step * B * T + 1
    if num_tokens < step_tokens:
        raise UserError(f"{path}: shard has {num_tokens} tokens, fewer than one optimizer step needs ({step_tokens} = "
                        f"{chunks_per_step} chunks of B·T = {B}·{T}, +1). Use a smaller --total_batch_size / "
                        "--micro_batch_size / --seq_len, or larger shards.")


class ReadAhead:
    """next_batch and read_ahead, over a loader's _read_batch (this rank's next micro-batch) and _state_dict."""

    def _forget_read_ahead(self) -> None:
        self._ahead: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ahead_from: dict | None = None  # the state before the batches read ahead

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (x, y) of a micro-step, each (B, T) int64 on the CPU, y x shifted by one; or ShardReadError."""
        if not self._ahead:
            return self._read_batch()
        batch = self._ahead.pop(0)
        if not self._ahead:
            self._ahead_from = None
        return batch

    def read_ahead(self) -> None:
        """Read this rank's micro-batches of the next step now, for next_batch; a ShardReadError is raised here, between
        steps. Until they are handed out, state_dict is the position before them (after a ShardReadError too)."""
        if self._ahead_from is None:
            self._ahead_from = self._state_dict()
        while len(self._ahead) < self.chunks_per_step // self.world_size:
            self._ahead.append(self._read_batch())
        self.check_unchanged()

    def state_dict(self) -> dict:
        return self._ahead_from or self._state_dict()


class DistributedDataLoader(ReadAhead):
    def __init__(self, data_dir: str | Path, split: str, B: int, T: int, rank: int = 0, world_size: int = 1,
                 grad_accum_steps: int = 1, shuffle: bool = False, seed: int = 0, vocab_size: int | None = None,
                 align_bos: bool = False):
        """vocab_size: the model's, above every token id (None: not checked). align_bos: rows start at documents."""
        self.B, self.T, self.rank, self.world_size, self.align_bos = B, T, rank, world_size, align_bos
        self.chunks_per_step = world_size * grad_accum_steps
        self.shuffle, self.seed = shuffle, seed
        self.data_dir, self.shards = str(data_dir), find_shards(data_dir, split)
        self.tokenizer = read_data_tokenizer(data_dir)  # (TokenizerSpec) its manifest's, or GPT-2's where none
        self.watch = ShardWatch(self.shards)  # before the first read, so that no change after it goes unseen
        # Check every header now, so a bad shard fails the run in its first second rather than hours in.
        layouts = [read_shard_layout(p) for p in self.shards]
        self.shard_tokens, self.shard_dtypes = [n for n, _ in layouts], [dtype for _, dtype in layouts]
        for path, n in zip(self.shards, self.shard_tokens):
            check_shard_fills_a_step(path, n, self.chunks_per_step, B, T)
        # One look at every shard's tokens: an id the model has no embedding for fails the run now too, and the
        # shards' sizes, first and last tokens, in order, tell which data this is, whatever directory holds it.
        fingerprint = hashlib.sha256()
        for path, n, dtype in zip(self.shards, self.shard_tokens, self.shard_dtypes):
            with closing(Shard(path, n, dtype)) as shard:
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
        self.watch.check(self.shards[shard_index])  # (one deleted or replaced is named as such, not opened)
        self.shard = Shard(self.shards[shard_index], num_tokens, self.shard_dtypes[shard_index])
        if self.align_bos:  # the whole shard in memory (packing reads every token anyway), packed on every opening
            self.tokens = self.shard.read(0, num_tokens)
            self.rows, _ = pack_rows(self.tokens, self.T + 1, self.tokenizer.eot)
            num_chunks = len(self.rows) // self.B
            if num_chunks < self.chunks_per_step:
                raise UserError(f"{self.shards[shard_index]}: its documents pack into {len(self.rows)} rows of "
                                f"--seq_len + 1 = {self.T + 1} tokens under --align_bos, fewer than one optimizer step "
                                f"needs ({self.chunks_per_step} chunks of {self.B} rows). Use a smaller "
                                "--total_batch_size / --seq_len, larger shards, or no --align_bos.")
        else:
            num_chunks = (num_tokens - 1) // (self.B * self.T)
        self.usable_chunks = num_chunks - num_chunks % self.chunks_per_step
        if self.shuffle:  # a fresh chunk order per (seed, epoch, shard), cheap to recompute on resume
            self.chunk_order = np.random.default_rng([self.seed, self.epoch, shard_index]).permutation(num_chunks)
        else:
            self.chunk_order = np.arange(num_chunks)

    def check_unchanged(self) -> None:
        """ShardReadError naming the first of the loader's shards that changed since the loader was made."""
        self.watch.check()

    def _read_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.read_chunk(self.rank)
        self.advance(self.world_size)
        return batch

    def read_chunk(self, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the chunk `offset` chunks on from the position (the loader's own rank reads offset rank)."""
        B, T = self.B, self.T
        chunk = int(self.chunk_order[self.chunk_position + offset])
        if self.align_bos:  # B consecutive packed rows of T+1 tokens, each its own x and y
            pieces = np.concatenate(self.rows[chunk * B : (chunk + 1) * B])
            buf = np.concatenate([self.tokens[start : start + n] for start, n in pieces]).astype(np.int64)
            rows = torch.from_numpy(buf).view(B, T + 1)
            x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        else:  # B consecutive T-token runs: B·T tokens in one slice, then reshaped
            buf = torch.from_numpy(self.shard.read(chunk * B * T, B * T + 1).astype(np.int64))  # uint16/32 until here
            x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        return x, y

    def advance(self, chunks: int) -> None:
        """Past `chunks` chunks, into the next shard (and epoch) at the end of this one's usable chunks."""
        self.chunk_position += chunks
        if self.chunk_position >= self.usable_chunks:
            self.chunk_position = 0
            self.shard_position += 1
            if self.shard_position == len(self.shards):
                self.shard_position = 0
                self.epoch += 1
            self._open_shard()

    def where(self) -> str:
        return f"epoch {self.epoch}, shard {self.shard_position}, chunk {self.chunk_position}"

    def tokens_by_source(self, steps: int) -> dict[str, int]:  # (of every rank)
        return {self.data_dir: steps * self.chunks_per_step * self.B * self.T}

    @property
    def sources(self) -> list["DistributedDataLoader"]:
        return [self]  # (a MixtureLoader's are several)

    def _state_dict(self) -> dict[str, int | str]:
        # B·T and chunks_per_step give the position its meaning; rank and world size do not (see docs/data.md).
        return {"epoch": self.epoch, "shard_position": self.shard_position, "chunk_position": self.chunk_position,
                "chunk_tokens": self.B * self.T, "chunks_per_step": self.chunks_per_step,
                "num_shards": len(self.shards), "shuffle": int(self.shuffle), "seed": self.seed, "seq_len": self.T,
                "align_bos": int(self.align_bos), "data_dir": self.data_dir, "data_fingerprint": self.data_fingerprint}

    def load_state_dict(self, state: dict, whole_steps: bool = True) -> None:
        """whole_steps: the position must be between two optimizer steps (a mixture's source is at any chunk)."""
        mine = self.state_dict()
        if "sources" in state:  # a --data_mix run's
            raise UserError(f"cannot resume the data loader: the snapshot's run trained on a --data_mix, this one on "
                            f"--data_dir {self.data_dir}. Pass its --data_mix, or start anew: --init_from SNAPSHOT.")
        if state["data_fingerprint"] != self.data_fingerprint:
            raise UserError(
                f"cannot resume the data loader: the snapshot's run read other shards (--data_dir {state['data_dir']}, "
                f"{state['num_shards']} shards) than this run's --data_dir {self.data_dir} holds ({len(self.shards)} "
                "shards, with other sizes or tokens). Pass the snapshot's --data_dir (or a copy of its shards), or "
                "start a new run on this data from its weights with --init_from SNAPSHOT.")
        for key in ("chunk_tokens", "chunks_per_step", "num_shards", "shuffle", "seed", "align_bos"):
            if state[key] != mine[key]:
                raise UserError(
                    f"cannot resume the data loader: the snapshot was taken with {key}={state[key]}, this run has "
                    f"{key}={mine[key]}: it would re-read or skip data. Keep --micro_batch_size·--seq_len, "
                    "--total_batch_size, the data, --shuffle, --seed and --align_bos (the number of ranks may "
                    "change), or start a fresh run with --resume never.")
        if state["seq_len"] != self.T:
            raise UserError(
                f"cannot resume the data loader: the snapshot's run cut its chunks of {self.B * self.T} tokens into "
                f"sequences of --seq_len {state['seq_len']}, and this run into sequences of --seq_len {self.T}: "
                f"another context length. Pass --seq_len {state['seq_len']} --micro_batch_size "
                f"{self.B * self.T // state['seq_len']}, or start a new run on its weights: --init_from SNAPSHOT.")
        if whole_steps and state["chunk_position"] % self.chunks_per_step:
            raise UserError(f"cannot resume the data loader: its state (chunk_position {state['chunk_position']}) "
                             "was taken in the middle of an optimizer step; snapshots are only valid between steps.")
        self.epoch, self.shard_position = state["epoch"], state["shard_position"]
        self._forget_read_ahead()
        self._open_shard()
        self.chunk_position = state["chunk_position"]

"""A snapshot on disk: written atomically, checked by checksums, read without running code.

What a snapshot holds is decided by snapshot_store.Snapshots; this module knows its two forms and how each is written
and read. With --parallel ddp, one file snapshot_<step>.pt that rank 0 writes; with --parallel fsdp, a directory
snapshot_<step>/ in which every rank writes its shards of the model and optimizer (torch.distributed.checkpoint,
which reshards them on loading, so a resume may use another number of ranks) and rank 0 the rest, meta.pt.

A snapshot is valid only once its final name exists: it is written under a temp name, fsynced and renamed, so a
crash mid-write leaves the previous snapshots as they were. Nothing is written over a file this code did not write
(written_here). Bytes that change after the write (a bit flip, a bad copy) are found by checksums: the CRC-32 that
torch.save's zip container keeps for every record, and a CRC-32 per shard file of a directory snapshot in its meta.pt.

Nothing read from a snapshot runs code. Torch files (a snapshot_*.pt, a directory's meta.pt) load with
torch.load(weights_only=True), so they hold only tensors, numbers, strings, lists and dicts; and mmap=True, so that
8 ranks resuming on one node share the file's pages instead of each reading the whole model and optimizer state
into its own memory. In a directory, torch.distributed.checkpoint would unpickle the .metadata file and the shards'
non-tensor values (the optimizer's hyperparameters) with plain pickle: load_shards reads the first with an
unpickler that knows only the classes such a file holds, and the second with weights_only=True; and every shard file
the .metadata names must lie inside the snapshot's directory.
"""

import os
import pickle
import pickletools
import random
import re
import shutil
import stat
import struct
import zipfile
import zlib
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.utils.serialization.config
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict

from model import ARCHITECTURES, GPT, GPTConfig
from training.distributed import any_rank
from training.errors import UserError
from training.files import atomic_write, fsync_directory
from training.tokenizer import Tokenizer, TokenizerSpec, gpt2_spec, tokenizer_from_spec

STEP = r"(\d{7}|[1-9]\d{7,})"  # f"{step:07d}", exactly
SNAPSHOT_NAME = re.compile(rf"snapshot_{STEP}(\.pt)?")  # a file (ddp) or a directory (fsdp)
# ...and while they are written: files.atomic_write's temp file, save_sharded_snapshot's temp directory
TEMP_NAME = re.compile(rf"snapshot_{STEP}(\.pt\.\d+)?\.tmp")
SHARD_DATA_NAME = re.compile(r"__\d+_\d+\.distcp")  # a rank's shards, in a directory snapshot
SHARD_FILE_NAME = re.compile(rf"{SHARD_DATA_NAME.pattern}|\.metadata|meta\.pt(\.\d+\.tmp)?")  # all its files
# What a snapshot holds, each of its type (in a directory snapshot, the model and optimizer are in the shards)
KEY_TYPES = {"model": dict, "model_config": dict, "optimizer": dict, "scaler": dict, "step": int, "loader": dict,
             "rng": list, "config": dict, "wandb_id": str}
REQUIRED_KEYS = tuple(KEY_TYPES)
SHARDED_KEYS = ("model", "optimizer")  # in a directory snapshot: in the shards, not in meta.pt
META_KEYS = tuple(k for k in REQUIRED_KEYS if k not in SHARDED_KEYS)


# ----------------------------------------------------------------------------------------------------------------
# names

def snapshot_path(snapshot_dir: str | Path, step: int, sharded: bool = False) -> Path:
    return Path(snapshot_dir) / (f"snapshot_{step:07d}" if sharded else f"snapshot_{step:07d}.pt")


def list_snapshots(snapshot_dir: str | Path) -> list[Path]:
    """Snapshots in snapshot_dir (entries named as this code names them), newest (highest step) first."""
    snapshot_dir = Path(snapshot_dir)
    if not snapshot_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in snapshot_dir.iterdir() if (m := SNAPSHOT_NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


# ----------------------------------------------------------------------------------------------------------------
# writing

def save_snapshot(state: dict, path: Path) -> None:
    check_replaceable(path)
    atomic_write(path, lambda f: torch_save(state, f))


def torch_save(obj, f) -> None:
    """torch.save with the CRC-32 of every record in the zip (torch's default, made sure of: load_snapshot checks
    them); a failed write raises the OSError behind it (ENOSPC, EIO), not torch's "unexpected pos" RuntimeError."""
    try:
        with torch.utils.serialization.config.patch({"save.compute_crc32": True}):
            torch.save(obj, f)
    except RuntimeError as e:
        if isinstance(e.__context__, OSError):
            raise e.__context__ from e
        raise


def save_sharded_snapshot(meta: dict | None, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                          path: Path, device: torch.device) -> None:
    """Every rank writes its shards of the model and optimizer into a temp directory, rank 0 adds meta (the rest of
    the snapshot, and the shard files' CRC-32s) and renames the directory into place once all are written.
    Collective; a failed write on any rank raises on every rank, with the temp directory removed."""
    tmp = path.with_name(path.name + ".tmp")
    failure = None
    if meta is not None:
        try:
            check_replaceable(path)
            check_replaceable(tmp)
            shutil.rmtree(tmp, ignore_errors=True)  # a dead run's
        except OSError as e:
            failure = e
    if any_rank(failure is not None, device):  # (and no rank writes into tmp before rank 0 has cleared it)
        raise failure or OSError(f"{path} could not be written: see rank 0's warning")
    model_state, optimizer_state = get_state_dict(model, optimizers)
    try:
        # dcp.save returns once all ranks have written, or raises CheckpointException on all if one failed.
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
        if meta is not None:
            meta = meta | {"shard_crc32": {p.name: file_crc32(p) for p in tmp.iterdir()}}
            atomic_write(tmp / "meta.pt", lambda f: torch_save(meta, f))
            shutil.rmtree(path, ignore_errors=True)  # a snapshot of the same step from before a restart
            os.replace(tmp, path)
            fsync_directory(path.parent)
    except (OSError, CheckpointException) as e:
        failure = e
    # A collective, so that nobody goes on (or exits) before the snapshot is complete, and all learn if it is not.
    if any_rank(failure is not None, device):
        if meta is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise failure or OSError(f"writing {tmp} failed on another rank")



def written_here(path: Path) -> bool:
    """Whether this code provably wrote `path`, so that it may delete it: a snapshot, or the temp file or directory
    of a snapshot write, by its name (SNAPSHOT_NAME, TEMP_NAME) and its contents. A file: a torch file whose
    pickle holds a snapshot's keys (snapshot_holds_keys). A directory: nothing but what save_sharded_snapshot
    writes into one (shard files, .metadata, meta.pt and its temp files), with meta.pt holding a snapshot's keys
    where it must be there (in a snapshot, not yet in the temp directory of one)."""
    if path.is_symlink() or not (SNAPSHOT_NAME.fullmatch(path.name) or TEMP_NAME.fullmatch(path.name)):
        return False
    if ".pt" in path.name:
        return path.is_file() and snapshot_holds_keys(path, REQUIRED_KEYS)
    if not path.is_dir():
        return False
    entries = list(path.iterdir())
    if not all(SHARD_FILE_NAME.fullmatch(e.name) and e.is_file() and not e.is_symlink() for e in entries):
        return False
    meta = path / "meta.pt"
    if SNAPSHOT_NAME.fullmatch(path.name) or meta.exists():  # (a temp directory has none until its shards are in)
        return snapshot_holds_keys(meta, META_KEYS)
    return True


def snapshot_holds_keys(path: Path, keys: tuple[str, ...]) -> bool:
    """Whether a torch file, complete or cut short by a crash, is a snapshot's: its pickle names every one of `keys`."""
    strings = pickle_strings(path)
    return strings is not None and set(keys) <= set(strings)


def pickle_strings(path: Path) -> list[str] | None:
    """The strings in a torch file's pickle, in order, read even from a file cut short after it: torch.save writes the
    object's pickle first (the zip record <archive>/data.pkl, stored). Only the pickle's opcodes are read
    (pickletools): nothing is unpickled. None if the file is unreadable or its pickle is not whole: nothing proven."""
    try:
        with open(path, "rb") as f:
            header = f.read(30)  # a zip record's local header
            signature, compression = header[:4], header[8:10]
            name_length, extra_length = struct.unpack_from("<HH", header, 26)
            if signature != b"PK\x03\x04" or compression != b"\0\0" or not f.read(name_length).endswith(b"/data.pkl"):
                return None
            f.seek(extra_length, os.SEEK_CUR)
            strings, memo, last = [], {}, None
            for opcode, arg, _ in pickletools.genops(f):
                if opcode.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):  # a string met again is a memo GET
                    memo[len(memo) if opcode.name == "MEMOIZE" else arg] = last
                    continue
                if opcode.name in ("GET", "BINGET", "LONG_BINGET"):
                    arg = memo.get(arg)
                last = arg if isinstance(arg, str) else None
                if last is not None:
                    strings.append(last)
            return strings
    except (OSError, ValueError, struct.error):  # unreadable, or cut short: no proof
        return None


def check_replaceable(path: Path) -> None:
    """FileExistsError if something this code did not write is where it is about to write (a snapshot of the same
    step is replaced, a dead run's temp file cleared): that is never overwritten or deleted."""
    if (path.exists() or path.is_symlink()) and not written_here(path):
        raise FileExistsError(f"{path} is in the way of a snapshot and was not written by this code, so it is left "
                              "as it is: move it out of --snapshot_dir")


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------------------
# checksums

def file_crc32(path: Path) -> int:
    """CRC-32 of a file's bytes (zlib's, ~0.4 s/GB on one core: see README), read in 16 MiB pieces."""
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(16 * 2**20):
            crc = zlib.crc32(piece, crc)
    return crc


def verify_checksums(path: Path, state: dict | None = None) -> None:
    """Raise ValueError naming the file if bytes of a snapshot changed since it was written: the CRC-32 of every
    record in a torch file's zip container, and for a directory snapshot every shard file's CRC-32 in meta.pt. A
    read error is raised as the OSError it is: it says nothing about the bytes."""
    if path.is_dir():
        verify_checksums(path / "meta.pt")
        for name, crc in (state or {}).get("shard_crc32", {}).items():  # (older directory snapshots have none)
            if not (path / name).is_file() or file_crc32(path / name) != crc:
                raise ValueError(f"{path / name} is missing or its bytes changed since it was written (CRC-32 "
                                 "mismatch): a bit flip or a bad copy.")
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every record and compares its CRC-32
    except (zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{path} could not be read as a snapshot ({type(e).__name__}: {e}); it is truncated, "
                         "corrupt or not a torch file.") from e
    if bad is not None:
        raise ValueError(f"{path}: the bytes of its record {bad} changed since it was written (CRC-32 mismatch): a "
                         "bit flip or a bad copy.")


# ----------------------------------------------------------------------------------------------------------------
# reading snapshots: nothing in them runs code

def load_snapshot(path: str | Path, verify: bool = True) -> dict:
    """Load and check a snapshot (of a directory snapshot: meta.pt, with its .metadata checked to hold nothing that
    could run code; the shards are read when restoring). Raises ValueError naming the file if it is truncated, not
    ours, unsafe, or (verify) its bytes changed since it was written; an OSError if it could not be read."""
    path = Path(path)
    sharded = path.is_dir()
    if sharded:
        read_shard_metadata(path)
    state = read_torch_file(path / "meta.pt" if sharded else path)
    missing = [k for k in (META_KEYS if sharded else REQUIRED_KEYS) if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{path} is not a training snapshot of this codebase (missing {missing}).")
    check_key_types(path, state)
    if verify:
        verify_checksums(path, state)
    return state



SNAPSHOT_FILE = ("a snapshot", "Pass a snapshot written by train_gpt2.py (a snapshot_*.pt file, or an fsdp run's "
                 "snapshot directory): its files hold only tensors, numbers and strings.")


def read_torch_file(path: Path, kind: tuple[str, str] = SNAPSHOT_FILE, map_location: str = "cpu"):
    """The one way a pickle-format file is read, whoever wrote it: our snapshots (a snapshot_*.pt, a directory's
    meta.pt, a file with just a model) and a Hugging Face pytorch_model.bin (hf.py). torch.load(weights_only=True),
    so it holds only tensors, numbers, strings and containers of them and runs no code; memory-mapped (map_location
    "meta": the tensors' shapes alone). kind: what the file should be, and the fix a refusal ends with. ValueError
    naming the file if it is missing, refused or torch cannot load it (torch raises even OSErrors for a truncated
    file); a read error of the file's first bytes is raised as the OSError it is."""
    what, fix = kind
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block the read, or never end
            raise ValueError(f"{path} could not be read as {what}: it is not a regular file (a FIFO, a socket or a "
                             f"device). {fix}")
        with open(path, "rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"  # torch.save's container (torch's message otherwise: about mmap)
    except FileNotFoundError as e:
        raise ValueError(f"{path} could not be read as {what}: it is missing.") from e
    except OSError as e:  # (a failing disk's EIO from read() names no file: errors.path_error names this one)
        e.filename = e.filename or str(path)
        raise
    if not is_zip:
        raise ValueError(f"{path} could not be read as {what}: it is truncated, corrupt or not a torch file.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except Exception as e:
        if (refused := unsafe_pickle(e)) is not None:
            raise ValueError(f"{path} was refused: its pickle holds {refused}, which is not plain data, and "
                             f"unpickling it could run code, so it will not be loaded. {fix}") from e
        raise ValueError(f"{path} could not be read as {what} ({type(e).__name__}: {first_line(e)}); it is "
                         "truncated, corrupt or not a torch file.") from e


def unsafe_pickle(e: BaseException) -> str | None:
    """What torch.load(weights_only=True) refused to unpickle ("the global posix.system"), if that is why it raised:
    the reason is on one line of torch's long message, whose advice to load it anyway we never repeat. A global is
    named either way torch says it: one it does not allow ("Unsupported global: GLOBAL builtins.print"), or one of a
    module it blocks ("unsupported GLOBAL posix.system whose module posix is blocked")."""
    text = str(e)
    if named := re.search(r"[Uu]nsupported (?:global: )?GLOBAL (\S+)", text):
        return f"the global {named.group(1)}"
    reason = next((line.split("WeightsUnpickler error:")[1].split(". Please")[0].strip()
                   for line in text.splitlines() if "WeightsUnpickler error:" in line), None)
    if reason is None and text.startswith("Weights only load failed"):
        return "something torch's weights-only unpickler does not allow"
    return reason


def first_line(e: BaseException) -> str:
    return str(e).strip().split("\n")[0]


# What the .metadata of a torch.distributed.checkpoint directory holds (walked with pickletools in the snapshots
# of real fsdp runs; the dtypes are allowed by their type, below). Unpickling calls what a pickle names, so any other
# name is refused: it could run code.
METADATA_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}  # (the checkpoint_id dcp.save was given)


class RefusedGlobal(pickle.UnpicklingError):
    """A name outside METADATA_GLOBALS in a .metadata pickle (the message: module.name)."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only the classes of METADATA_GLOBALS and torch's dtypes."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise RefusedGlobal(f"{module}.{name}")


def read_shard_metadata(directory: Path) -> Metadata:
    """The .metadata of a directory snapshot (the index of its shards), read with MetadataUnpickler. ValueError
    naming the file if it is missing or holds anything else; a read error is raised as the OSError it is."""
    path = directory / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except FileNotFoundError as e:
        raise ValueError(f"{directory} could not be read as a snapshot ({path} is missing): a write cut short, or "
                         "not a snapshot directory.") from e
    except RefusedGlobal as e:
        raise ValueError(f"{path} was refused: it names {e}, which a torch.distributed.checkpoint .metadata file "
                         "never holds, and unpickling it could run code. The snapshot directories of train_gpt2.py "
                         "--parallel fsdp hold no such thing: pass one of those.") from e
    except OSError:
        raise
    except Exception as e:  # anything else a damaged pickle raises
        raise ValueError(f"{directory} could not be read as a snapshot ({path}: {type(e).__name__}: "
                         f"{first_line(e)}): it is damaged, or not a snapshot directory.") from e
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} holds a {type(metadata).__name__}, not a torch.distributed.checkpoint Metadata: it "
                         "is not a snapshot directory of train_gpt2.py --parallel fsdp.")
    # Each tensor's bytes are read from the file its entry names: only a shard file in this directory, never a path
    # that leads out of it (absolute, or through ..).
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {None: None}
    outside = sorted({str(getattr(info, "relative_path", info)) for info in storage.values()
                      if not SHARD_DATA_NAME.fullmatch(str(getattr(info, "relative_path", "")))})
    if outside:
        raise ValueError(f"{path} was refused: it names {', '.join(outside[:3])} as shard files, and a snapshot's "
                         f"shards are files of its own directory ({directory}), named __<rank>_<n>.distcp. Pass a "
                         "snapshot directory written by train_gpt2.py --parallel fsdp.")
    return metadata


class SnapshotShardReader(FileSystemReader):
    """torch.distributed.checkpoint's reader of a directory, but for its .metadata: read_shard_metadata, where
    torch unpickles it with plain pickle."""

    def read_metadata(self) -> Metadata:
        # (Without torch's rank argument: after a refusal, dcp would look for per-rank files we never write.)
        metadata = read_shard_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()  # as FileSystemReader.read_metadata does
        metadata.storage_meta.load_id = self.load_id
        return metadata


class PlainDataLoadPlanner(DefaultLoadPlanner):
    """torch.distributed.checkpoint's default planner, but for the shards' non-tensor values (the optimizer's
    hyperparameters: floats, bools, tuples): unpickled with weights_only=True first, where torch's planner uses
    weights_only=False. Bytes that load so are plain data, and then load the same way in torch's planner."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = directory

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            reason = unsafe_pickle(e) or first_line(e)
            raise ValueError(f"{self.directory}: the value of {read_item.dest_index.fqn} in its shards was refused "
                             f"({reason}): it is not plain data, and unpickling it could run code. The snapshot "
                             "directories of train_gpt2.py --parallel fsdp hold no such thing: pass one of "
                             "those.") from e
        value.seek(0)
        super().load_bytes(read_item, value)


def load_shards(state: dict, directory: Path, no_dist: bool = False) -> None:
    """Fill `state` (what get_state_dict or a model's state_dict gives) from the shards of a directory snapshot:
    dcp.load, resharded to this run's ranks (no_dist: into one process without a process group), with nothing read
    that could run code. ValueError naming the file or value if anything is refused."""
    try:
        dcp.load(state, storage_reader=SnapshotShardReader(directory), planner=PlainDataLoadPlanner(directory),
                 no_dist=no_dist)
    except CheckpointException as e:  # (a BaseException) wraps what each rank raised
        errors = [error for error, _ in e.failures.values()]
        ours = next((error for error in errors if isinstance(error, ValueError)), None)
        raise ValueError(str(ours) if ours else f"{directory} could not be read as a snapshot "
                         f"({type(errors[0]).__name__}: {first_line(errors[0])}).") from e


def read_model(path: str | Path) -> GPT:
    """A plain GPT from a training snapshot (a snapshot_*.pt file, or the directory of an fsdp run's, whose shards
    torch.distributed.checkpoint puts back together in one process), or from a file with just a snapshot's "model"
    and "model_config": what sample.py, export_hf.py, evaluate.py and --init_from load. Its bytes are checked as a
    resume checks them (verify_checksums): ValueError naming the file if they changed since they were written."""
    path = Path(path)
    state = load_model_snapshot(path)
    verify_checksums(path, state)
    model = GPT(model_config_of(state, path))
    if path.is_dir():
        state = {"model": model.state_dict()}
        load_shards(state, path, no_dist=True)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:  # torch lists every missing, unexpected and misshapen weight: its first lines say it
        raise ValueError(f"{path}: its weights do not fit the model its model_config describes "
                         f"({' '.join(str(e).split())[:300]}...). Pass a snapshot written by train_gpt2.py.") from e
    return model


def read_model_config(path: str | Path) -> GPTConfig:
    """The shape of the model read_model would load, without its weights (nor their checksums: read_model checks
    them when it loads them)."""
    return model_config_of(load_model_snapshot(path), path)


def model_config_of(state: dict, path: str | Path) -> GPTConfig:
    """The model shape a snapshot's "model_config" names (one written before --arch or --attention_bias lacks those:
    their defaults, as that code built). ValueError naming the file if it is not a shape this code builds."""
    saved, names = state.get("model_config"), {f.name for f in fields(GPTConfig)}
    shape = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")
    valid = isinstance(saved, dict) and set(shape) <= set(saved) <= names and all(
        type(saved[k]) is int and saved[k] > 0 for k in shape) and saved.get("arch", "gpt2") in ARCHITECTURES and \
        type(saved.get("attention_bias", False)) is bool and saved["n_embd"] % saved["n_head"] == 0
    if not valid:
        raise ValueError(f"{path} is not a snapshot this code can build a model from: its model_config is {saved!r}, "
                         f"where a snapshot's holds the positive integers {', '.join(shape)} (n_embd a multiple of "
                         f"n_head), and may hold arch ({' or '.join(ARCHITECTURES)}) and attention_bias (true or "
                         "false), nothing else. Pass a snapshot written by train_gpt2.py.")
    return GPTConfig(**saved)


def read_tokenizer(path: str | Path) -> TokenizerSpec:
    """The tokenizer of the run that wrote a snapshot (or a file with just its model): what its token ids mean.
    ValueError naming the file if its record is malformed."""
    return tokenizer_of(load_model_snapshot(path), path)


def tokenizer_of(state: dict, path: str | Path) -> TokenizerSpec:
    """A snapshot's record of its run's tokenizer (the data's); GPT-2's for a snapshot from before they recorded it."""
    recorded = state.get("tokenizer")
    return gpt2_spec() if recorded is None else TokenizerSpec.from_dict(recorded, str(path))


def load_tokenizer_of(path: str | Path) -> Tokenizer:
    """read_tokenizer's tokenizer, to encode and decode with (sample.py, evaluate.py, export_hf.py): a UserError
    naming the snapshot and the tokenizer where it cannot be had here (a tiktoken encoding not in the offline cache)."""
    spec = read_tokenizer(path)
    try:
        return tokenizer_from_spec(spec)
    except UserError as e:
        raise UserError(f"{path} was trained with the tokenizer {spec.describe()}, which reads and writes its text: "
                        f"{e}") from e


def check_tokenizer(source: str, its: TokenizerSpec, data_dir: str | Path, data: TokenizerSpec, fix: str) -> None:
    """A UserError naming both unless `source` (a snapshot, a model) was trained with the tokenizer of the data in
    data_dir: under another tokenizer each id is other text, so its weights would be trained or scored on noise."""
    if its.sha256 != data.sha256:
        raise UserError(f"{source} was trained with the tokenizer {its.describe()}, but the data in {data_dir} was "
                        f"written with {data.describe()}: the same token id is other text under each. {fix}")


def is_snapshot_directory(path: Path) -> bool:
    """Whether `path` is a snapshot in the directory form (an fsdp run's, with its meta.pt)."""
    return path.is_dir() and (path / "meta.pt").is_file()


def load_model_snapshot(path: str | Path) -> dict:
    """What read_model, read_model_config and evaluate.py read: a snapshot's dict (of a directory snapshot, its
    meta.pt: the weights are in the shards, for load_shards), or a file's with just a snapshot's "model" and
    "model_config". FileNotFoundError or ValueError naming the file if it is none of those."""
    path = Path(path)
    if is_snapshot_directory(path):
        return load_snapshot(path, verify=False)
    if not path.exists():
        raise FileNotFoundError(f"snapshot {path}: no such file. Pass a snapshot_*.pt written by train_gpt2.py.")
    state = read_torch_file(path)
    if not isinstance(state, dict) or "model" not in state or "model_config" not in state:
        raise ValueError(f"{path} is not a snapshot of this codebase (it lacks 'model' and 'model_config'). "
                         "Pass a snapshot_*.pt written by train_gpt2.py.")
    check_key_types(path, state)
    return state


def check_key_types(path: Path, state: dict) -> None:
    """ValueError naming the file if a key of a snapshot holds another type than this code writes there."""
    wrong = [f"{key} is a {type(state[key]).__name__}" for key, kind in KEY_TYPES.items()
             if key in state and (not isinstance(state[key], kind) or isinstance(state[key], bool))]
    if wrong:
        raise ValueError(f"{path} is not a snapshot this code wrote: {', '.join(wrong)}, where a snapshot's "
                         f"{', '.join(f'{k} is a {t.__name__}' for k, t in KEY_TYPES.items())}.")


# ----------------------------------------------------------------------------------------------------------------
# random number generators

def capture_rng_state(device: torch.device) -> dict:
    """Every generator a training process draws from: Python's, numpy's, torch's CPU one, and the training
    device's (only that one: asking CUDA on a --device cpu run would open a CUDA context on GPU 0)."""
    # numpy's state is converted to plain lists/tensors so that weights_only loading accepts it.
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device.type == "mps":
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_rng_state(state: dict, device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    elif device.type == "mps" and "mps" in state:
        torch.mps.set_rng_state(state["mps"])

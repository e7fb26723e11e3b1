"""Reading a directory snapshot (--parallel fsdp) without running code (torch's reader: plain pickle); refusals are
ValueErrors naming why. Its own module: torch.distributed.checkpoint takes a second to import; only fsdp needs it."""

import pickle
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from training.files import reason
from training.safe_load import unsafe_pickle

SHARD_DATA_NAME = re.compile(r"__\d+_\d+\.distcp")  # a rank's shards, in a directory snapshot
FSDP_FIX = "The snapshot directories of train_gpt2.py --parallel fsdp hold no such thing: pass one of those."


# What a torch.distributed.checkpoint .metadata holds (and torch's dtypes): any other name could run code.
METADATA_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}  # (the checkpoint_id dcp.save was given)


class RefusedGlobal(pickle.UnpicklingError):
    """A name outside METADATA_GLOBALS in a .metadata pickle (the message: module.name)."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise RefusedGlobal(f"{module}.{name}")


def read_shard_metadata(directory: Path) -> Metadata:
    """A directory snapshot's .metadata (its shards' index) by MetadataUnpickler; ValueError naming what is wrong."""
    path = directory / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except FileNotFoundError as e:
        raise ValueError(f"{directory} could not be read as a snapshot ({path} is missing): a write cut short, or "
                         "not a snapshot directory.") from e
    except RefusedGlobal as e:
        raise ValueError(f"{path} was refused: it names {e}, which a torch.distributed.checkpoint .metadata file "
                         f"never holds, and unpickling it could run code. {FSDP_FIX}") from e
    except OSError:
        raise
    except Exception as e:  # anything else a damaged pickle raises
        raise ValueError(f"{directory} could not be read as a snapshot ({path}: {reason(e)}): it is damaged, or not "
                         "a snapshot directory.") from e
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} holds a {type(metadata).__name__}, not a torch.distributed.checkpoint Metadata: it "
                         "is not a snapshot directory of train_gpt2.py --parallel fsdp.")
    # Each tensor is read from the file its entry names: only a shard file of this directory, never one out of it.
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {None: None}
    outside = sorted({str(getattr(info, "relative_path", info)) for info in storage.values()
                      if not SHARD_DATA_NAME.fullmatch(str(getattr(info, "relative_path", "")))})
    if outside:
        raise ValueError(f"{path} was refused: it names {', '.join(outside[:3])} as shard files, and a snapshot's "
                         f"shards are files of its own directory ({directory}), named __<rank>_<n>.distcp. Pass a "
                         "snapshot directory written by train_gpt2.py --parallel fsdp.")
    return metadata


class SnapshotShardReader(FileSystemReader):
    """torch's reader, its .metadata read by read_shard_metadata (torch's: plain pickle)."""

    def read_metadata(self) -> Metadata:
        metadata = read_shard_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()  # as FileSystemReader.read_metadata does
        metadata.storage_meta.load_id = self.load_id
        return metadata


class PlainDataLoadPlanner(DefaultLoadPlanner):
    """torch's planner, the shards' non-tensor values unpickled with weights_only=True first (torch's: False)."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = directory

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            raise ValueError(f"{self.directory}: the value of {read_item.dest_index.fqn} in its shards was refused "
                             f"({unsafe_pickle(e) or reason(e)}): it is not plain data, and unpickling it could run "
                             f"code. {FSDP_FIX}") from e
        value.seek(0)
        super().load_bytes(read_item, value)


def load_shards(state: dict, directory: Path, no_dist: bool = False) -> None:
    """Fill `state` from a directory snapshot's shards, resharded (no_dist: one process without a process group)."""
    try:
        dcp.load(state, storage_reader=SnapshotShardReader(directory), planner=PlainDataLoadPlanner(directory),
                 no_dist=no_dist)
    except CheckpointException as e:  # (a BaseException) wraps what each rank raised
        errors = [error for error, _ in e.failures.values()]
        ours = next((error for error in errors if isinstance(error, ValueError)), None)
        raise ours or ValueError(f"{directory} could not be read as a snapshot ({reason(errors[0])}).") from e

"""One snapshot on disk: a file snapshot_<step>.pt (ddp) or a directory snapshot_<step>/ of shards and meta.pt (fsdp),
written atomically, checked by CRC-32s, read without running code. Why and how: docs/reliability.md, "Checksums"."""

import os
import re
import shutil
import zipfile
import zlib
from pathlib import Path

import torch

from model import ARCHITECTURES, GPT, GPTConfig
from training.distributed import any_rank
from training.files import atomic_write, fsync_directory, reason
from training.safe_load import read_torch_file

FORMAT = 1  # of what a snapshot holds; a snapshot of another format is refused, naming it
SNAPSHOT_NAME = re.compile(r"snapshot_(\d{7}|[1-9]\d{7,})(\.pt)?")  # f"{step:07d}": a file (ddp), a directory (fsdp)
# What a snapshot holds, each of its type (in a directory snapshot the model and optimizer are in the shards)
KEY_TYPES = {"format": int, "model": dict, "model_config": dict, "optimizer": dict, "scaler": dict, "step": int,
             "loader": dict, "rng": list, "config": dict, "wandb_id": str, "healthy": bool, "tokenizer": dict}
REQUIRED_KEYS = tuple(KEY_TYPES)


def snapshot_path(snapshot_dir: str | Path, step: int, sharded: bool = False) -> Path:
    return Path(snapshot_dir) / (f"snapshot_{step:07d}" if sharded else f"snapshot_{step:07d}.pt")


def list_snapshots(snapshot_dir: str | Path) -> list[Path]:
    """Newest (highest step) first."""
    found = Path(snapshot_dir).iterdir() if Path(snapshot_dir).is_dir() else []
    return sorted((p for p in found if SNAPSHOT_NAME.fullmatch(p.name)), reverse=True,
                  key=lambda p: int(SNAPSHOT_NAME.fullmatch(p.name)[1]))


def save_snapshot(state: dict, path: Path) -> None:
    atomic_write(path, lambda f: torch_save(state, f))


def torch_save(obj, f) -> None:
    """torch.save (its zip has every record's CRC-32); a failed write raises its OSError (ENOSPC), not RuntimeError."""
    try:
        torch.save(obj, f)
    except RuntimeError as e:
        if isinstance(e.__context__, OSError):
            raise e.__context__ from e
        raise


def save_sharded_snapshot(meta: dict | None, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                          path: Path, device: torch.device) -> None:
    """Every rank writes its shards into a temp directory; rank 0 (meta: not None) adds meta.pt, with the shard
    files' CRC-32s, and renames it into place. Collective: a failure on any rank raises its OSError on every rank."""
    import torch.distributed.checkpoint as dcp  # (imported by fsdp runs alone: a second of start-up)
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = path.with_name(path.name + ".tmp")
    if meta is not None:
        shutil.rmtree(tmp, ignore_errors=True)  # a dead write's (the store checked that path is this run's)
    failure = None
    model_state, optimizer_state = get_state_dict(model, optimizers)
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)  # raises on every rank
        if meta is not None:
            meta = meta | {"shard_crc32": {p.name: file_crc32(p) for p in tmp.iterdir()}}
            atomic_write(tmp / "meta.pt", lambda f: torch_save(meta, f))
            shutil.rmtree(path, ignore_errors=True)  # this run's own of the same step, from before a restart
            os.replace(tmp, path)
            fsync_directory(path.parent)
    except OSError as e:
        failure = e
    except CheckpointException as e:  # (a BaseException) wraps what each rank raised: the store is told its OSError
        errors = [error for error, _ in e.failures.values()]
        failure = next((error for error in errors if isinstance(error, OSError)), None) or OSError(reason(errors[0]))
    if any_rank(failure is not None, device):  # nobody goes on before the snapshot is whole, and all learn if not
        if meta is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise failure or OSError(f"writing {tmp} failed on another rank")


def remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def file_crc32(path: Path) -> int:
    """zlib's CRC-32 of a file's bytes, read in 16 MiB pieces."""
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(16 * 2**20):
            crc = zlib.crc32(piece, crc)
    return crc


def verify_checksums(path: Path, state: dict) -> None:
    """ValueError naming the file if a snapshot's bytes changed (of a directory: meta.pt's and every shard's); a read
    error is raised as the OSError it is."""
    if path.is_dir():
        verify_checksums(path / "meta.pt", state)
        for name, crc in state["shard_crc32"].items():
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


def load_snapshot(path: str | Path, verify: bool = True) -> dict:
    """A snapshot's state (of a directory: meta.pt, its .metadata checked). ValueError naming the file if it is
    truncated, not a snapshot of this format, unsafe, or (verify) its bytes changed; an OSError if unreadable."""
    path = Path(path)
    sharded = path.is_dir()
    if sharded:
        from training.safe_load_shards import read_shard_metadata  # (fsdp's: lazily)

        read_shard_metadata(path)
    state = read_torch_file(path / "meta.pt" if sharded else path)
    check_state(path, state, [k for k in REQUIRED_KEYS if not sharded or k not in ("model", "optimizer")])
    if verify:
        verify_checksums(path, state)
    return state


def check_state(path: Path, state, keys: list[str]) -> None:
    """ValueError naming the file unless `state` is a snapshot's of this format: `keys`, each of its type."""
    if isinstance(state, dict) and "format" in state and state["format"] != FORMAT:
        raise ValueError(f"{path} is a snapshot of format {state['format']!r}, written by another version of "
                         f"train_gpt2.py; this one reads format {FORMAT}. Read it with the version that wrote it, or "
                         "start a new run (--resume never).")
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{path} is not a training snapshot of this codebase (missing {missing}).")
    wrong = [f"{key} is a {type(state[key]).__name__}" for key, kind in KEY_TYPES.items()
             if key in state and (not isinstance(state[key], kind) or isinstance(state[key], bool) != (kind is bool))]
    if wrong:
        raise ValueError(f"{path} is not a snapshot this code wrote: {', '.join(wrong)}, where a snapshot's "
                         f"{', '.join(f'{k} is a {t.__name__}' for k, t in KEY_TYPES.items())}.")


# the model in a snapshot (or in a file with just a snapshot's "model" and "model_config"): tools, --init_from

def read_model(path: str | Path) -> GPT:
    """A plain GPT from a snapshot (a directory's shards put together in one process), its bytes checked."""
    path = Path(path)
    state = load_model_snapshot(path)
    verify_checksums(path, state)
    model = GPT(model_config_of(state, path))
    if path.is_dir():
        from training.safe_load_shards import load_shards  # (fsdp's: lazily)

        state = {"model": model.state_dict()}
        load_shards(state, path, no_dist=True)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:  # torch lists every missing, unexpected and misshapen weight: its first lines say it
        raise ValueError(f"{path}: its weights do not fit the model its model_config describes "
                         f"({' '.join(str(e).split())[:300]}...). Pass a snapshot written by train_gpt2.py.") from e
    return model


def read_model_config(path: str | Path) -> GPTConfig:
    return model_config_of(load_model_snapshot(path), path)


def model_config_of(state: dict, path: str | Path) -> GPTConfig:
    """The model shape a snapshot's "model_config" names; ValueError naming the file if this code cannot build it."""
    saved, shape = state.get("model_config"), ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")
    valid = isinstance(saved, dict) and set(saved) == set(GPTConfig.__dataclass_fields__) and \
        all(type(saved[k]) is int and saved[k] > 0 for k in shape) and saved["arch"] in ARCHITECTURES and \
        type(saved["attention_bias"]) is bool and saved["n_embd"] % saved["n_head"] == 0
    if not valid:
        raise ValueError(f"{path} is not a snapshot this code can build a model from: its model_config is {saved!r}, "
                         f"where a snapshot's holds the positive integers {', '.join(shape)} (n_embd a multiple of "
                         f"n_head), arch ({' or '.join(ARCHITECTURES)}) and attention_bias (true or false). Pass a "
                         "snapshot written by train_gpt2.py.")
    return GPTConfig(**saved)


def is_snapshot_directory(path: Path) -> bool:
    return path.is_dir() and (path / "meta.pt").is_file()


def load_model_snapshot(path: str | Path) -> dict:
    """A snapshot's dict (of a directory: meta.pt), or a file's with just "model" and "model_config"."""
    path = Path(path)
    if is_snapshot_directory(path):
        return load_snapshot(path, verify=False)
    if not path.exists():
        raise FileNotFoundError(f"snapshot {path}: no such file. Pass a snapshot_*.pt written by train_gpt2.py.")
    state = read_torch_file(path)
    if not isinstance(state, dict) or "model" not in state or "model_config" not in state:
        raise ValueError(f"{path} is not a snapshot of this codebase (it lacks 'model' and 'model_config'). "
                         "Pass a snapshot_*.pt written by train_gpt2.py.")
    check_state(path, state, REQUIRED_KEYS if "format" in state else ["model", "model_config"])
    return state

"""Training snapshots: written atomically by rank 0, found again after a crash, loaded without pickles.

A snapshot is valid only once its final name exists: it is written to a temp file, fsynced and renamed, so
a crash mid-write leaves the previous snapshots as they were. Loading uses torch.load(weights_only=True),
so everything in a snapshot is tensors, numbers, strings, lists and dicts.
"""

import os
import random
import re
import sys
from pathlib import Path

import numpy as np
import torch

SNAPSHOT_NAME = re.compile(r"snapshot_(\d+)\.pt")
REQUIRED_KEYS = ("model", "model_config", "optimizer", "scaler", "step", "loader", "rng", "config", "wandb_id")


def snapshot_path(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"snapshot_{step:07d}.pt"


def save_snapshot(state: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # disk full, Ctrl-C: don't leave gigabytes of half a snapshot on a full disk
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_snapshot(path: str | Path) -> dict:
    """Load and check a snapshot; raises ValueError naming the file if it is truncated or not ours."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's message can run to a page; its first line says what failed
        first_line = str(e).strip().split("\n")[0]
        raise ValueError(f"{path} could not be read as a snapshot ({type(e).__name__}: {first_line}); "
                         "it is truncated, corrupt or not a torch file.") from e
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{path} is not a training snapshot of this codebase (missing {missing}).")
    return state


def list_snapshots(ckpt_dir: str | Path) -> list[Path]:
    """Snapshots in ckpt_dir, newest (highest step) first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := SNAPSHOT_NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def find_latest_snapshot(ckpt_dir: str | Path) -> tuple[Path, dict] | None:
    """The newest snapshot that loads; broken ones are skipped with a warning naming them."""
    for path in list_snapshots(ckpt_dir):
        try:
            return path, load_snapshot(path)
        except ValueError as e:
            print(f"WARNING: skipping snapshot: {e} Trying the next older one.", file=sys.stderr)
    return None


def prune_snapshots(ckpt_dir: str | Path, keep_last: int) -> None:
    """Delete all but the keep_last newest snapshots, and the temp files of writes that a crash cut short."""
    for old in list_snapshots(ckpt_dir)[keep_last:]:
        old.unlink(missing_ok=True)
    # One writer saves one snapshot at a time, so once a save has finished every temp file is a dead run's.
    for tmp in Path(ckpt_dir).glob("snapshot_*.pt.tmp"):
        tmp.unlink(missing_ok=True)


def capture_rng_state() -> dict:
    # numpy's state is converted to plain lists/tensors so that weights_only loading accepts it.
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

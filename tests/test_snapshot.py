"""snapshot.py: snapshots survive crashes mid-write, broken files are skipped by name, RNG states round-trip.

These use small stand-in snapshots; tests/test_resume.py checks real ones written by train_gpt2.py.
"""

import io
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_leaves

from conftest import ROOT, flip_a_byte_in_tensor_data
from snapshot import (
    REQUIRED_KEYS,
    capture_rng_state,
    find_latest_snapshot,
    list_snapshots,
    load_snapshot,
    prune_snapshots,
    restore_rng_state,
    save_snapshot,
    snapshot_path,
    torch_save,
)

CPU = torch.device("cpu")


def fake_snapshot(step: int) -> dict:
    """A snapshot with every required key; its weights say which step wrote it."""
    state = {key: {} for key in REQUIRED_KEYS}
    model = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(model.weight, float(step))
    state.update(model=model.state_dict(), step=step, rng=[capture_rng_state(CPU)], wandb_id="abc123")
    return state


def test_snapshot_round_trips_through_weights_only_loading(tmp_path):
    state = fake_snapshot(7)
    save_snapshot(state, snapshot_path(tmp_path, 7))
    loaded = load_snapshot(snapshot_path(tmp_path, 7))  # weights_only: would raise on anything but plain data
    assert loaded["step"] == 7
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    assert [p.name for p in tmp_path.iterdir()] == ["snapshot_0000007.pt"]  # no temp file left behind


REAL_TORCH_SAVE = torch.save


def save_half(obj, f, then) -> None:
    """A torch.save that writes the first half of the file, then calls then() to crash."""
    whole = io.BytesIO()
    REAL_TORCH_SAVE(obj, whole)
    f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
    f.flush()
    then()


def raise_disk_full():
    raise OSError(28, "No space left on device")


def test_failed_write_leaves_previous_snapshot_and_no_temp_file(tmp_path, monkeypatch):
    save_snapshot(fake_snapshot(3), snapshot_path(tmp_path, 3))
    monkeypatch.setattr(torch, "save", lambda obj, f: save_half(obj, f, then=raise_disk_full))
    with pytest.raises(OSError, match="No space left"):
        save_snapshot(fake_snapshot(4), snapshot_path(tmp_path, 4))
    assert [p.name for p in tmp_path.iterdir()] == ["snapshot_0000003.pt"]
    assert find_latest_snapshot(tmp_path)[1]["step"] == 3


# A process killed half-way through a write has no chance to clean up: run one and SIGKILL it mid-write.
KILLED_MID_WRITE = """
import os, signal, sys, torch
import snapshot
from test_snapshot import fake_snapshot, save_half
torch.save = lambda obj, f: save_half(obj, f, then=lambda: os.kill(os.getpid(), signal.SIGKILL))
snapshot.save_snapshot(fake_snapshot(4), snapshot.snapshot_path(sys.argv[1], 4))
"""


def test_killed_write_leaves_previous_snapshot_and_the_next_save_removes_its_temp_file(tmp_path):
    save_snapshot(fake_snapshot(3), snapshot_path(tmp_path, 3))
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path)], env=env, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()

    assert not snapshot_path(tmp_path, 4).exists()  # the final name appears only once the file is complete
    [partial] = tmp_path.glob("snapshot_0000004.pt.*tmp")
    assert 0 < partial.stat().st_size < snapshot_path(tmp_path, 3).stat().st_size
    path, state = find_latest_snapshot(tmp_path)
    assert path == snapshot_path(tmp_path, 3) and state["step"] == 3

    save_snapshot(fake_snapshot(5), snapshot_path(tmp_path, 5))
    prune_snapshots(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot_0000003.pt", "snapshot_0000005.pt"]


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garbage(path):
    path.write_bytes(b"not a torch file at all\n" * 100)


def foreign(path):
    torch.save({"state_dict": {"w": torch.zeros(2)}, "epoch": 3}, path)  # a torch file, but not a snapshot of ours


@pytest.mark.parametrize("damage", [truncate, garbage, foreign])
def test_broken_newest_snapshot_is_skipped_with_a_warning_naming_it(tmp_path, capsys, damage):
    for step in (10, 20):
        save_snapshot(fake_snapshot(step), snapshot_path(tmp_path, step))
    damage(snapshot_path(tmp_path, 20))
    path, state = find_latest_snapshot(tmp_path)
    assert path == snapshot_path(tmp_path, 10) and state["step"] == 10
    warning = capsys.readouterr().err
    assert "WARNING" in warning and str(snapshot_path(tmp_path, 20)) in warning
    with pytest.raises(ValueError, match="snapshot_0000020.pt"):
        load_snapshot(snapshot_path(tmp_path, 20))


def test_a_flipped_byte_in_tensor_data_is_found_by_its_checksum_and_the_older_snapshot_used(tmp_path, capsys):
    for step in (10, 20):
        save_snapshot(fake_snapshot(step), snapshot_path(tmp_path, step))
    before = tree_leaves(torch.load(snapshot_path(tmp_path, 20), weights_only=True))
    record = flip_a_byte_in_tensor_data(snapshot_path(tmp_path, 20))
    after = tree_leaves(torch.load(snapshot_path(tmp_path, 20), weights_only=True))  # torch loads it without a word
    assert [torch.equal(x, y) for x, y in zip(before, after) if isinstance(x, torch.Tensor)].count(False) == 1

    path, state = find_latest_snapshot(tmp_path)
    assert path == snapshot_path(tmp_path, 10) and state["step"] == 10
    warning = capsys.readouterr().err
    assert f"{snapshot_path(tmp_path, 20)}: the bytes of its record {record} changed" in warning
    assert load_snapshot(snapshot_path(tmp_path, 20), verify=False)["step"] == 20  # the check is what found it


def test_a_write_error_inside_torch_save_surfaces_as_the_oserror_behind_it(tmp_path):
    class FailingFile(io.BytesIO):
        def write(self, data):
            raise OSError(5, "Input/output error")  # EIO; torch.save alone would raise "unexpected pos"

    with pytest.raises(OSError, match="Input/output error"):
        torch_save(fake_snapshot(1), FailingFile())


def test_no_valid_snapshot_means_a_fresh_start(tmp_path):
    assert find_latest_snapshot(tmp_path / "missing") is None
    garbage(snapshot_path(tmp_path, 1))
    assert find_latest_snapshot(tmp_path) is None


def test_snapshots_are_ordered_by_step_and_pruned_to_keep_last(tmp_path):
    steps = [9, 10, 99, 10_000_000]  # 10,000,000 outgrows the 7-digit padding: order must stay numeric
    for step in steps:
        save_snapshot(fake_snapshot(step), snapshot_path(tmp_path, step))
    (tmp_path / "notes.txt").write_text("not a snapshot")
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, s) for s in reversed(steps)]
    prune_snapshots(tmp_path, keep_last=2)
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, 10_000_000), snapshot_path(tmp_path, 99)]
    assert (tmp_path / "notes.txt").exists()


def draw() -> tuple:
    return random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist()


def test_rng_state_restores_every_generator_after_a_save(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    np.random.randn()  # leaves a cached Gaussian in numpy's state, the part that is easy to lose
    save_snapshot(fake_snapshot(0) | {"rng": [capture_rng_state(CPU)]}, snapshot_path(tmp_path, 0))
    expected = draw()
    draw()  # move every generator on
    restore_rng_state(load_snapshot(snapshot_path(tmp_path, 0))["rng"][0], CPU)
    assert draw() == expected


def test_a_snapshot_is_fsynced_before_its_rename_and_the_directory_after(tmp_path, monkeypatch):
    import files
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr(files.os, "replace", replace)
    save_snapshot(fake_snapshot(5), snapshot_path(tmp_path, 5))
    assert [kind for kind, _ in events] == ["fsync", "rename", "fsync"]
    assert events[0][1].startswith("snapshot_0000005.pt.") and events[0][1].endswith(".tmp")  # the data, then...
    assert events[1][1] == "snapshot_0000005.pt" and events[2][1] == tmp_path.name  # ...the name, then the directory

"""snapshot.py: snapshots survive crashes mid-write, broken files are skipped by name, RNG states round-trip,
nothing read from a snapshot runs code, and pruning deletes only what this code wrote.

Most use small stand-in snapshots; the safety tests use a real fsdp run's (one process), and tests/test_resume.py
checks real ones written by train_gpt2.py.
"""

import errno
import io
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import zlib
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.utils._pytree import tree_leaves

import tools.evaluate
import tools.sample
from conftest import (
    ROOT,
    eio_the_first_time,
    failing,
    flip_a_byte_in_tensor_data,
    make_shards,
    save_tiny_model,
    tiny_snapshots,
)
from helpers_train import main_in_process, read_metrics
from model import GPT, GPTConfig
from rundir import snapshot, store
from rundir.lock import LOCK_FILE
from rundir.snapshot import (
    FORMAT,
    REQUIRED_KEYS,
    file_crc32,
    list_snapshots,
    load_snapshot,
    read_model,
    read_model_config,
    save_snapshot,
    snapshot_path,
    torch_save,
    verify_checksums,
)
from rundir.store import RUN_FILE
from rundir.training_state import capture_rng_state, restore_rng_state
from training.errors import UserError

CPU = torch.device("cpu")


def fake_snapshot(step: int) -> dict:
    """A snapshot with every required key; its weights say which step wrote it."""
    state = {key: {} for key in REQUIRED_KEYS}
    model = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(model.weight, float(step))
    state.update(format=FORMAT, model=model.state_dict(), step=step, rng=[capture_rng_state(CPU)], wandb_id="abc123",
                 healthy=True)
    return state


def latest(directory: Path) -> store.Entry:
    """The snapshot a resume of these would restore (a run's own): the newest that loads, each before it named."""
    return store.first_loadable(store.survey(directory), f"in {directory}")


def save_fake_sharded_snapshot(path: Path, step: int, **changes) -> None:
    """fake_snapshot(step) (with `changes`) as a directory snapshot, as one process writes it."""
    model = torch.nn.Linear(4, 4)
    meta = {k: v for k, v in fake_snapshot(step).items() if k not in ("model", "optimizer")} | changes
    snapshot.save_sharded_snapshot(meta, model, [torch.optim.AdamW(model.parameters())], path, CPU)


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
    assert latest(tmp_path).state["step"] == 3


# A process killed half-way through a write has no chance to clean up: run one and SIGKILL it mid-write.
KILLED_MID_WRITE = """
import os, signal, sys, torch
from rundir import snapshot
from test_snapshot import fake_snapshot, save_half
torch.save = lambda obj, f: save_half(obj, f, then=lambda: os.kill(os.getpid(), signal.SIGKILL))
snapshot.save_snapshot(fake_snapshot(4), snapshot.snapshot_path(sys.argv[1], 4))
"""


@pytest.mark.slow  # a few seconds: keeps `-m 'not slow'` under 90 s
def test_killed_write_leaves_the_previous_snapshot_as_it_was(tmp_path):
    save_snapshot(fake_snapshot(3), snapshot_path(tmp_path, 3))
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path)], env=env, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()

    assert not snapshot_path(tmp_path, 4).exists()  # the final name appears only once the file is complete
    [partial] = tmp_path.glob("snapshot_0000004.pt.*tmp")
    assert 0 < partial.stat().st_size < snapshot_path(tmp_path, 3).stat().st_size
    entry = latest(tmp_path)
    path, state = entry.path, entry.state
    assert path == snapshot_path(tmp_path, 3) and state["step"] == 3


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
    entry = latest(tmp_path)
    path, state = entry.path, entry.state
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

    entry = latest(tmp_path)
    path, state = entry.path, entry.state
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


@pytest.fixture
def data(tmp_path) -> Path:
    make_shards(tmp_path / "data", "train", [2000], vocab=100, tokenizer="bytes")
    return tmp_path / "data"


def test_a_failed_write_is_not_reported_as_written_and_a_stop_at_that_step_writes_it_again(data, tmp_path,
                                                                                            monkeypatch, capsys):
    writes, messages = eio_the_first_time(monkeypatch), []
    snapshots = tiny_snapshots(data, tmp_path / "run", messages.append, every=5)
    assert snapshots.save_if_due(4, last_step=9, stopping=False) is None  # due, and failed: training goes on
    assert f"WARNING: the snapshot of step 4 could not be written to {tmp_path / 'run'} (OSError: [Errno 5] " \
        "Input/output error; " in capsys.readouterr().err
    assert messages == [] and list_snapshots(tmp_path / "run") == []
    # A SIGTERM during the evaluation before step 5: the stop's snapshot is of step 4 again, and this time written.
    path = snapshots.save_if_due(4, last_step=9, stopping=True)
    assert path == snapshot_path(tmp_path / "run", 4) and list_snapshots(tmp_path / "run") == [path]
    assert writes == [4, 4] and messages == [f"snapshot written: {path}"]
    # Another stop at that step (during the next evaluation): nothing trained since, nothing written again.
    assert snapshots.save_if_due(4, last_step=9, stopping=True) is None and writes == [4, 4]


@pytest.mark.parametrize("step, stopping", [(9, False), (2, True)])  # the run's last step; a stop on SIGTERM
def test_a_lost_last_or_stop_snapshot_fails_the_run(data, tmp_path, monkeypatch, step, stopping):
    eio_the_first_time(monkeypatch)
    snapshots = tiny_snapshots(data, tmp_path / "run", every=5)
    with pytest.raises(UserError, match=f"the snapshot of step {step} could not be written .* and it was the run's "
                                        "last; there is no older snapshot"):
        snapshots.save_if_due(step, last_step=9, stopping=stopping)


def test_a_failed_write_names_the_space_left_and_the_newest_older_snapshot_and_a_lost_last_one_the_way_on(
        data, tmp_path, monkeypatch, capsys):
    snapshots = tiny_snapshots(data, tmp_path / "run", keep_last=3)
    older, real_torch_save = [snapshots.save_if_due(step, last_step=9, stopping=False) for step in (0, 1)], torch_save
    monkeypatch.setattr(snapshot, "torch_save", failing(errno.ENOSPC))
    monkeypatch.setattr(store.shutil, "disk_usage", lambda path: SimpleNamespace(total=3 * 2**30, free=6 * 2**20))
    capsys.readouterr()
    what = (f"the snapshot of step {{}} could not be written to {tmp_path / 'run'} ({{}}; 6 MiB free of 3,072 "
            f"MiB){{}}; the older snapshots are intact, the newest is {older[1]}")
    full = f"OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"
    assert snapshots.save_if_due(2, last_step=9, stopping=False) is None
    assert f"WARNING: {what.format(2, full, '')}. Training goes on; the next due snapshot tries again.\n" in \
        capsys.readouterr().err
    assert not store.sidecar(snapshot_path(tmp_path / "run", 2)).exists()  # no .json of a snapshot that is not there
    with monkeypatch.context() as patch:  # the .json, written first, fails: no snapshot without it
        patch.setattr(store, "write_record", failing(errno.ENOSPC))
        patch.setattr(snapshot, "torch_save", real_torch_save)
        assert snapshots.save_if_due(3, last_step=9, stopping=False) is None
    assert f"WARNING: {what.format(3, full, '')}." in capsys.readouterr().err
    last, fix = ", and it was the run's last", (". Free space (or point --snapshot_dir at a disk with room) and rerun "
                                                "the same command to resume from there.")
    with pytest.raises(UserError) as lost:
        snapshots.save_if_due(9, last_step=9, stopping=False)
    assert str(lost.value) == what.format(9, full, last) + fix
    # A rank whose own part was written learns that another's failed: the same words, why unknown there.
    with pytest.raises(UserError) as elsewhere:
        snapshots._write_failed(9, snapshot_path(tmp_path / "run", 9), None, final=True)
    assert str(elsewhere.value) == what.format(9, "on another rank", last) + fix
    assert list_snapshots(tmp_path / "run") == older[::-1]


def test_a_snapshot_of_another_model_optimizer_or_layout_is_refused_naming_each_difference(data, tmp_path):
    snapshots = tiny_snapshots(data, tmp_path / "run")
    path = snapshots.save_if_due(1, last_step=9, stopping=False)
    state, ours = load_snapshot(path), asdict(snapshots.trainee.raw.config)
    theirs = state | {"model_config": ours | {"n_layer": 3}, "config": state["config"] | {"optimizer": "muon"}}
    fix = ("Resume it with the flags of the run that wrote it (--arch/--model/--n_layer/--n_head/--n_embd/--block_size"
           "/--[no-]attention_bias, --optimizer; --parallel on any number of ranks), or start a new run from its "
           "weights with --init_from {} (a fresh optimizer, schedule and data order).")
    with pytest.raises(UserError) as refused:
        snapshots.restore(str(path), theirs)
    assert str(refused.value) == (f"{path} was written with a model {ours | {'n_layer': 3}} (this run: {ours}); "
                                  f"--optimizer muon (this run: adamw). {fix.format(path)}")
    directory = snapshot_path(tmp_path, 1, sharded=True)
    directory.mkdir()
    with pytest.raises(UserError) as refused:
        snapshots.restore(str(directory), state)
    assert str(refused.value) == \
        f"{directory} was written with --parallel fsdp (this run: ddp). {fix.format(directory)}"


def test_a_snapshot_of_another_tokenizer_is_refused_first_its_model_shape_being_no_cause(data, tmp_path):
    from training.tokenizer import gpt2_spec

    snapshots = tiny_snapshots(data, tmp_path / "run")
    path = snapshots.save_if_due(1, last_step=9, stopping=False)
    state, gpt2 = load_snapshot(path), gpt2_spec()
    with pytest.raises(UserError) as refused:
        snapshots.restore(str(path), state | {"tokenizer": gpt2.to_dict(), "model_config": {"n_layer": 3}})
    assert str(refused.value) == (
        f"{path} was trained with the tokenizer {gpt2.describe()}, but the data in {data} was written with "
        f"{snapshots.train_loader.tokenizer.describe()}: the same token id is other text under each. Resume it on data "
        "written with its tokenizer (--data_dir or --data_mix), or start a new run on this data with --resume never.")


def test_a_restore_on_another_number_of_ranks_seeds_torch_from_the_seed_step_and_rank(data, tmp_path):
    messages = []
    snapshots = tiny_snapshots(data, tmp_path / "run", messages.append)
    path = snapshots.save_if_due(4, last_step=9, stopping=False)
    state = load_snapshot(path)
    snapshots.restore(str(path), state | {"rng": state["rng"] * 2})  # written by 2 ranks, restored on 1
    drawn = torch.rand(3)
    torch.manual_seed(snapshots.run_config["seed"] + 4)
    assert torch.equal(drawn, torch.rand(3)) and messages == [f"snapshot written: {path}"]


def test_an_fp16_run_takes_the_loss_scale_of_an_fp16_snapshot_and_starts_it_fresh_from_another(data, tmp_path):
    messages = []
    snapshots = tiny_snapshots(data, tmp_path / "run", messages.append)
    path = snapshots.save_if_due(1, last_step=9, stopping=False)
    state = load_snapshot(path)
    snapshots.trainee.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)  # as an fp16 run's
    snapshots.restore(str(path), state)  # a snapshot of an fp32 run: no scale to carry
    assert messages[1:] == [f"{path} was written without fp16, so it has no GradScaler state: the fp16 loss scale "
                            "starts fresh."] and snapshots.trainee.scaler.get_scale() == 2.0**16
    fp16 = torch.amp.GradScaler("cpu", init_scale=8.0)
    snapshots.restore(str(path), state | {"scaler": fp16.state_dict()})
    assert snapshots.trainee.scaler.get_scale() == 8.0 and len(messages) == 2


def test_only_broken_snapshots_are_an_error_naming_them(tmp_path):
    assert store.survey(tmp_path / "missing") == []
    (tmp_path / "notes.txt").write_text("not a snapshot")
    assert store.survey(tmp_path) == []
    garbage(snapshot_path(tmp_path, 1))
    with pytest.raises(ValueError, match=re.escape(f"none of the 1 snapshots in {tmp_path} loads: ") +
                       ".*snapshot_0000001.pt"):
        latest(tmp_path)


def test_snapshots_are_ordered_by_step(tmp_path):
    steps = [9, 10, 99, 9_999_999, 10_000_000]  # 10,000,000 outgrows the 7-digit padding: the order stays numeric
    for step in steps:
        save_snapshot(fake_snapshot(step), snapshot_path(tmp_path, step))
    (tmp_path / "notes.txt").write_text("not a snapshot")
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, s) for s in reversed(steps)]


def test_rng_state_restores_torchs_generator_after_a_save(tmp_path):
    torch.manual_seed(1)
    save_snapshot(fake_snapshot(0) | {"rng": [capture_rng_state(CPU)]}, snapshot_path(tmp_path, 0))
    expected = torch.rand(3)
    torch.rand(3)  # move the generator on
    restore_rng_state(load_snapshot(snapshot_path(tmp_path, 0))["rng"][0], CPU)
    assert torch.equal(torch.rand(3), expected)


def test_a_snapshot_is_fsynced_before_its_rename_and_the_directory_after(tmp_path, monkeypatch):
    from training import files
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


# ----------------------------------------------------------------------------------------------------------------
# nothing read from a snapshot runs code: a real fsdp snapshot, booby-trapped

B, T = 2, 16
JOB = ["--micro_batch_size", str(B), "--seq_len", str(T), "--total_batch_size", str(B * T * 2), "--max_steps", "3",
       "--warmup_steps", "2", "--max_lr", "1e-3", "--val_every", "0", "--dtype", "fp32", "--snapshot_every", "1",
       "--keep_last", "3"]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """A real --parallel fsdp run of 3 steps on one process (a process group of one): its data in data/, and in run/
    its directory snapshots of steps 0, 1 and 2 and its metrics.jsonl; in gpt2_data/, shards of GPT-2's tokenizer."""
    root = tmp_path_factory.mktemp("fsdp_snapshots")
    # The bytes tokenizer's shards: a model 257 ids wide, its snapshots KB, not GPT-2's 20 MB.
    make_shards(root / "data", "train", [4000], vocab=100, tokenizer="bytes")
    make_shards(root / "data", "val", [500], seed=1, vocab=100, tokenizer="bytes")
    make_shards(root / "gpt2_data", "train", [4000], vocab=100)  # for the model files save_tiny_model writes (GPT-2's)
    main_in_process([*JOB, "--data_dir", str(root / "data"), "--parallel", "fsdp", "--log_dir", str(root / "run")])
    return root


class RunsCode:
    """Unpickled, it creates the file `marker`: the least that code planted in a snapshot could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def trap_metadata(snapshot: Path, marker: Path) -> str:
    """The payload inside the pickle of the directory's .metadata. Returns what the refusal must name."""
    metadata = pickle.loads((snapshot / ".metadata").read_bytes())  # (our own run's file)
    metadata.planner_data["payload"] = RunsCode(marker)
    (snapshot / ".metadata").write_bytes(pickle.dumps(metadata))
    return str(snapshot / ".metadata")


def trap_shard_value(snapshot: Path, marker: Path) -> str:
    """The payload as a non-tensor value in a shard file (these hold the optimizer's hyperparameters, and
    torch.distributed.checkpoint unpickles them with weights_only=False), declared as the value of a weight, so that
    loading the model alone reads it too. The .metadata holds only the classes a real one does."""
    payload = io.BytesIO()
    torch.save(RunsCode(marker), payload)
    shard = snapshot / "__0_0.distcp"
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    metadata = pickle.loads((snapshot / ".metadata").read_bytes())
    key = "model.transformer.ln_f.bias"
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(shard.name, offset, len(payload.getvalue()))
    (snapshot / ".metadata").write_bytes(pickle.dumps(metadata))
    return f"{snapshot}: the value of {key}"


def booby_trapped(fsdp_run: Path, directory: Path, trap) -> tuple[Path, str]:
    """A copy of the real snapshot of step 1 in `directory` with a payload planted by `trap`, and its meta.pt's shard
    checksums made to match, as whoever planted it would. Returns it and what a refusal must name."""
    copy = snapshot_path(directory, 1, sharded=True)
    shutil.copytree(snapshot_path(fsdp_run / "run", 1, sharded=True), copy)
    named = trap(copy, directory.parent / "code_ran")
    meta = torch.load(copy / "meta.pt", weights_only=True)
    meta["shard_crc32"] = {p.name: file_crc32(p) for p in copy.iterdir() if p.name != "meta.pt"}
    torch.save(meta, copy / "meta.pt")
    return copy, named


def adopt(path: Path) -> None:
    """Make `path` the own snapshot of the run its directory holds (run.json, its .json), for --resume auto to read."""
    store.write_record(path.parent / RUN_FILE, {"run": "trapped", "init_from": None, "resumed_from": None})
    store.write_record(store.sidecar(path), {"run": "trapped", "step": int(path.name[9:16])})


def run_args(fsdp_run: Path, log_dir: Path, *args: str) -> list[str]:
    return [*JOB, "--data_dir", str(fsdp_run / "data"), "--log_dir", str(log_dir), *args]


# Every way in: read_model (tools/sample.py, export_hf.py and evaluate.py --snapshot load through it),
# two of those tools end to end, a resume from the path, --resume auto (the trapped snapshot is the only one), and
# --init_from.
ENTRY_POINTS = {
    "read_model": lambda run, snapshot: read_model(snapshot),
    "sample.py": lambda run, snapshot: tools.sample.main(["--snapshot", str(snapshot), "--device", "cpu"]),
    "evaluate.py": lambda run, snapshot: tools.evaluate.main(["--snapshot", str(snapshot), "--device", "cpu"]),
    "--resume PATH": lambda run, snapshot: main_in_process(run_args(run, snapshot.parent / "other", "--parallel",
                                                                    "fsdp", "--resume", str(snapshot))),
    "--resume auto": lambda run, snapshot: adopt(snapshot) or main_in_process(run_args(run, snapshot.parent,
                                                                                       "--parallel", "fsdp")),
    "--init_from": lambda run, snapshot: main_in_process(run_args(run, snapshot.parent / "other", "--init_from",
                                                                  str(snapshot))),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("trap", [trap_metadata, trap_shard_value])
def test_a_snapshot_directory_that_would_run_code_is_refused_by_every_entry_point(fsdp_run, tmp_path, capsys, trap,
                                                                                   entry):
    snapshot, named = booby_trapped(fsdp_run, tmp_path / "logs", trap)
    with pytest.raises((ValueError, UserError, SystemExit)) as refused:
        ENTRY_POINTS[entry](fsdp_run, snapshot)
    message = f"{refused.value} {capsys.readouterr().err}"  # (sample.py reports through argparse: exit 2, stderr)
    assert not (tmp_path / "code_ran").exists()
    assert named in message and "could run code" in message
    if isinstance(refused.value, SystemExit):
        assert refused.value.code == 2


def test_a_real_fsdp_snapshot_loads_as_torch_reads_it_and_resumes_with_the_same_loss(fsdp_run, tmp_path):
    snapshot = snapshot_path(fsdp_run / "run", 1, sharded=True)
    model = read_model(snapshot)
    expected = {"model": GPT(model.config).state_dict()}
    dcp.load(expected, checkpoint_id=snapshot, no_dist=True)  # torch's own reader (our own run's files)
    assert model.state_dict().keys() == expected["model"].keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected["model"].items())

    # The resume reads the optimizer's hyperparameters too: the values that are not tensors.
    main_in_process(run_args(fsdp_run, tmp_path, "--parallel", "fsdp", "--resume", str(snapshot)))
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path) if "loss" in r}
    whole = {r["step"]: r["loss"] for r in read_metrics(fsdp_run / "run") if "loss" in r}
    assert resumed == {2: whole[2]}


def flipped_model_file(fsdp_run: Path, directory: Path) -> tuple[Path, str, Path]:
    """A file with just a model, a byte of its weights flipped; what the refusal must say; data of its tokenizer."""
    path = save_tiny_model(directory / "model.pt")
    return (path, f"{path}: the bytes of its record {flip_a_byte_in_tensor_data(path)} changed since it was written",
            fsdp_run / "gpt2_data")


def flipped_snapshot_directory(fsdp_run: Path, directory: Path) -> tuple[Path, str, Path]:
    """A copy of the real fsdp snapshot of step 1, a byte of its largest shard file flipped; what the refusal must
    say; data of its tokenizer."""
    copy = snapshot_path(directory, 1, sharded=True)
    shutil.copytree(snapshot_path(fsdp_run / "run", 1, sharded=True), copy)
    shard = max(copy.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(data)
    return copy, f"{shard} is missing or its bytes changed since it was written", fsdp_run / "data"


@pytest.mark.parametrize("flipped", [flipped_model_file, flipped_snapshot_directory])
def test_a_model_read_from_bytes_that_changed_since_they_were_written_is_refused(fsdp_run, tmp_path, flipped):
    path, refusal, data = flipped(fsdp_run, tmp_path)
    with pytest.raises(ValueError, match=re.escape(refusal)):
        read_model(path)  # sample.py, export_hf.py, evaluate.py: as a resume checks a snapshot
    with pytest.raises(UserError, match=re.escape(f"--init_from: {refusal}")):
        main_in_process(run_args(fsdp_run, tmp_path / "run", "--init_from", str(path), "--data_dir", str(data)))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step


# ----------------------------------------------------------------------------------------------------------------
# pruning and cleaning delete only what this code wrote

# The entries that --keep_last 1 deleted in issue 24, and someone else's files under exactly the names this code writes.
ISSUE_24_ENTRIES = {"snapshot_2023/photo.jpg": b"\xff\xd8 a photo", "snapshot_1.pt": b"not ours",
                    "snapshot_draft.tmp": b"a draft", "snapshot_thesis_tmp/ch1.tex": b"\\chapter{One}"}
OUR_NAMES_FOREIGN_ENTRIES = {
    "snapshot_0000005.pt": b"notes", "snapshot_0000005.pt.123.tmp": b"notes", "snapshot_0000007/photo.jpg": b"photo",
    "snapshot_0000008.tmp/ch2.tex": b"\\chapter{Two}", "snapshot_0000009.tmp/__0_0.distcp": b"shards?",
    "snapshot_0000009.tmp/notes.txt": b"...but notes beside them"}


def plant(directory: Path, entries: dict[str, bytes]) -> dict[str, bytes]:
    for name, content in entries.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)
    return entries


def files_under(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_pruning_and_cleaning_delete_only_the_runs_own_snapshots_and_temp_files(data, tmp_path):
    run = tmp_path / "run"
    plant(run, ISSUE_24_ENTRIES | OUR_NAMES_FOREIGN_ENTRIES)
    foreign(run / "snapshot_0000006.pt")  # a torch file, but not a snapshot
    before = files_under(run)
    snapshots = tiny_snapshots(data, run, keep_last=1)
    snapshots.save_if_due(10, last_step=20, stopping=False)
    # What crashes of this run leave behind: a snapshot file cut short mid-write, and an fsdp snapshot's temp
    # directory with some shards in it, at steps whose .json it wrote first.
    for step, temp in ((11, "snapshot_0000011.pt.4242.tmp"), (12, "snapshot_0000012.tmp/__0_0.distcp")):
        store.write_record(store.sidecar(snapshot_path(run, step)), {"run": snapshots.run, "step": step})
        plant(run, {temp: b"half"})
    snapshots.save_if_due(13, last_step=20, stopping=False)
    after = files_under(run)
    assert {name: after[name] for name in before} == before  # every file not the run's, as it was
    assert sorted(set(after) - set(before)) == ["snapshot_0000011.json", "snapshot_0000012.json",
                                                "snapshot_0000013.json", "snapshot_0000013.pt"]


def test_a_run_with_keep_last_1_leaves_foreign_files_alone(fsdp_run, tmp_path):
    plant(tmp_path, ISSUE_24_ENTRIES)
    main_in_process(run_args(fsdp_run, tmp_path, "--keep_last", "1"))
    after = files_under(tmp_path)
    assert after.keys() == ISSUE_24_ENTRIES.keys() | {"metrics.jsonl", LOCK_FILE, RUN_FILE, "snapshot_0000002.pt",
                                                      "snapshot_0000002.json"}
    assert {name: after[name] for name in ISSUE_24_ENTRIES} == ISSUE_24_ENTRIES


# ----------------------------------------------------------------------------------------------------------------
# files from elsewhere (issue 50, items 8, 9, 10, 13)

def trap_outside_shard(snapshot: Path, marker: Path, outside: str = "absolute") -> str:
    """The .metadata names a shard file outside the directory (an absolute path, or one through ..), which holds the
    weights that would be read instead: a copy of the real shard, so that torch's own reader loads it quietly."""
    metadata = pickle.loads((snapshot / ".metadata").read_bytes())
    elsewhere = snapshot.parent / "elsewhere.distcp"
    shutil.copy(snapshot / "__0_0.distcp", elsewhere)
    name = str(elsewhere) if outside == "absolute" else f"../{elsewhere.name}"
    metadata.storage_data = {index: _StorageInfo(name, info.offset, info.length, info.transform_descriptors)
                             for index, info in metadata.storage_data.items()}
    (snapshot / ".metadata").write_bytes(pickle.dumps(metadata))
    return name


@pytest.mark.parametrize("outside", ["absolute", "parent"])
@pytest.mark.parametrize("entry", ["read_model", "--resume PATH", "--init_from"])
def test_a_snapshot_directory_whose_metadata_names_a_file_outside_it_is_refused(fsdp_run, tmp_path, entry, outside):
    snapshot, named = booby_trapped(fsdp_run, tmp_path / "logs", lambda s, m: trap_outside_shard(s, m, outside))
    model_config = GPTConfig(**torch.load(snapshot / "meta.pt", weights_only=True)["model_config"])
    dcp.load({"model": GPT(model_config).state_dict()}, checkpoint_id=snapshot,
             no_dist=True)  # torch's reader follows the path (today's read_model did too)
    with pytest.raises((ValueError, UserError)) as refused:
        ENTRY_POINTS[entry](fsdp_run, snapshot)
    assert f"it names {named} as shard files" in str(refused.value)


def tool_refusal(tool, argv: list[str], capsys) -> str:
    """The one paragraph a tool refuses with: its UserError (exit 2 from the entry point), or argparse's exit 2."""
    with pytest.raises((UserError, SystemExit)) as refused:
        tool(argv)
    if refused.type is SystemExit:
        assert refused.value.code == 2
        return capsys.readouterr().err
    return str(refused.value)


def payload_snapshot(path: Path, marker: Path) -> Path:
    """A snapshot file with every key, one of them a payload that runs code when unpickled."""
    torch.save(fake_snapshot(1) | {"scaler": RunsCode(marker)}, path)
    return path


@pytest.mark.parametrize("entry", ["read_model", "sample.py", "evaluate.py", "--resume PATH", "--resume auto",
                                   "--init_from"])
def test_a_snapshot_file_that_would_run_code_is_refused_and_nobody_advises_loading_it_anyway(fsdp_run, tmp_path,
                                                                                           capsys, entry):
    (tmp_path / "logs").mkdir()
    snapshot = payload_snapshot(snapshot_path(tmp_path / "logs", 1), tmp_path / "code_ran")
    with pytest.raises((ValueError, UserError, SystemExit)) as refused:
        ENTRY_POINTS[entry](fsdp_run, snapshot)
    message = f"{refused.value} {capsys.readouterr().err}"
    assert not (tmp_path / "code_ran").exists()
    assert f"{snapshot} was refused: its pickle holds the global exec, which is not plain data" in message
    assert "could run code, so it will not be loaded" in message and "weights_only" not in message


def test_a_fifo_or_device_given_as_a_snapshot_is_refused_at_once(fsdp_run, tmp_path):
    fifo = tmp_path / "snapshot_0000001.pt"
    os.mkfifo(fifo)  # reading it would block until a writer comes: SIGTERM could not stop that run
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(ValueError, match=f"{path} could not be read as a snapshot: it is not a regular file"):
            read_model(path)
    with pytest.raises(UserError, match="it is not a regular file"):
        main_in_process(run_args(fsdp_run, tmp_path / "run", "--resume", str(fifo)))


@pytest.mark.parametrize("change, named", [
    (lambda s: s["model_config"].update(rotary=True), "its model_config is {"),
    (lambda s: s["model_config"].pop("n_layer"), "its model_config is {"),
    (lambda s: s["model_config"].update(n_head=-4), "its model_config is {"),
])
def test_a_snapshot_with_a_model_config_this_code_does_not_write_is_refused(fsdp_run, tmp_path, capsys,
                                                                                     change, named):
    main_in_process(run_args(fsdp_run, tmp_path / "run", "--max_steps", "1"))
    path = snapshot_path(tmp_path / "run", 0)
    state = torch.load(path, weights_only=True)
    change(state)
    save_snapshot(state, path)
    with pytest.raises(UserError, match=re.escape(named)):
        main_in_process(run_args(fsdp_run, tmp_path / "run", "--max_steps", "2"))
    if "model_config" in named:
        assert named in tool_refusal(tools.sample.main, ["--snapshot", str(path), "--device", "cpu"], capsys)


def test_the_model_shape_of_a_snapshot_this_code_cannot_build_is_refused_naming_the_file(tmp_path):
    path = save_tiny_model(tmp_path / "model.pt")
    state = torch.load(path, weights_only=True)
    state["model_config"].update(n_head=3)
    torch.save(state, path)
    for read in (read_model_config, read_model):
        with pytest.raises(ValueError, match=f"^{re.escape(str(path))} is not a snapshot this code can build a model"):
            read(path)


def test_weights_that_do_not_fit_their_model_config_are_refused_with_the_start_of_what_torch_says(tmp_path):
    path = save_tiny_model(tmp_path / "model.pt")
    state = torch.load(path, weights_only=True)
    state["model"] = {name: weight for name, weight in state["model"].items() if ".h.0." not in name}
    torch.save(state, path)
    with pytest.raises(RuntimeError) as torch_says:
        GPT(GPTConfig(**state["model_config"])).load_state_dict(state["model"])
    assert len(str(torch_says.value)) > 300
    with pytest.raises(ValueError) as refused:
        read_model(path)
    assert str(refused.value) == (f"{path}: its weights do not fit the model its model_config describes "
                                  f"({' '.join(str(torch_says.value).split())[:300]}...). Pass a snapshot written by "
                                  "train_gpt2.py.")


@pytest.mark.parametrize("change, named", [
    (lambda s: s.update(step="7"), "step is a str"),
    (lambda s: s.update(config=[]), "config is a list"),
    (lambda s: s.update(model=[1, 2]), "model is a list"),
    (lambda s: s["model"].pop("lm_head.weight"), "its weights do not fit the model its model_config describes"),
    (lambda s: s["model_config"].update(n_head=3), "(n_embd a multiple of n_head)"),
])
def test_a_snapshot_whose_keys_hold_what_this_code_never_writes_is_refused_by_the_tools(tmp_path, capsys, change,
                                                                                         named):
    path = save_tiny_model(tmp_path / "model.pt")
    state = torch.load(path, weights_only=True) | {"step": 3, "config": {}}
    change(state)
    torch.save(state, path)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}.*{re.escape(named)}"):
        read_model(path)
    for tool in (tools.sample.main, tools.evaluate.main):
        assert named in tool_refusal(tool, ["--snapshot", str(path), "--device", "cpu"], capsys)


# ----------------------------------------------------------------------------------------------------------------
# pruning and rollbacks delete only the run's own snapshots


def test_a_rollback_deletes_the_abandoned_snapshots_it_wrote_and_not_a_symlink_among_them(data, tmp_path):
    messages = []
    run = tmp_path / "run"
    snapshots = tiny_snapshots(data, run, messages.append, every=1, keep_last=5)
    for step, healthy in ((1, True), (2, False), (3, False)):
        snapshots.save_if_due(step, last_step=9, stopping=False, healthy=healthy)
    kept_elsewhere = shutil.copy(snapshot_path(run, 3), tmp_path / "copy.pt")  # unhealthy, and this timeline's
    snapshot_path(run, 4).symlink_to(kept_elsewhere)
    step, path = snapshots.rollback()
    assert (step, path) == (1, str(snapshot_path(run, 1)))
    snapshots.commit_rollback(step, path)
    assert list_snapshots(run) == [snapshot_path(run, 4), snapshot_path(run, 1)]
    assert snapshot_path(run, 4).is_symlink() and load_snapshot(kept_elsewhere)["step"] == 3
    assert messages[-2:] == [f"removed {snapshot_path(run, s)}: written while updates were being skipped, after {path}"
                             for s in (3, 2)]


def test_a_rollback_to_a_directory_snapshot_rewrites_its_meta_pt_alone_keeping_the_shards_checksums(data, tmp_path):
    snapshots = tiny_snapshots(data, tmp_path / "run")
    path = snapshot_path(tmp_path / "run", 1, sharded=True)
    save_fake_sharded_snapshot(path, 1)
    shards = {p.name: p.read_bytes() for p in path.iterdir() if p.name != "meta.pt"}
    snapshots.train_loader.next_batch()  # the data position after the divergence, which the rollback keeps
    snapshots.commit_rollback(1, str(path))
    rolled_back = load_snapshot(path)  # its shards' checksums verified
    assert rolled_back["wandb_id"] == snapshots.run and rolled_back["loader"] == snapshots.train_loader.state_dict()
    assert {p.name: p.read_bytes() for p in path.iterdir() if p.name != "meta.pt"} == shards
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]


def test_a_rollback_that_cannot_be_written_warns_that_a_crash_would_undo_it(data, tmp_path, monkeypatch, capsys):
    snapshots = tiny_snapshots(data, tmp_path / "run")
    path = snapshots.save_if_due(1, last_step=9, stopping=False)
    monkeypatch.setattr(snapshot, "torch_save", failing(errno.ENOSPC))
    snapshots.commit_rollback(1, str(path))
    assert (f"WARNING: the rollback could not be written to {path} (OSError: [Errno {errno.ENOSPC}] "
            f"{os.strerror(errno.ENOSPC)}); a crash before the next snapshot would resume from before the rollback.\n"
            ) in capsys.readouterr().err
    assert load_snapshot(path)["step"] == 1 and list_snapshots(path.parent) == [path]  # as it was


def test_a_sharded_snapshot_clears_a_dead_runs_temp_directory_renames_into_place_and_fsyncs_the_directory(
        tmp_path, monkeypatch):
    path = snapshot_path(tmp_path, 2, sharded=True)
    dead = tmp_path / "snapshot_0000002.tmp"  # what a run killed mid-write of this step left
    dead.mkdir()
    (dead / "__0_0.distcp").write_bytes(b"\0" * 100)
    (dead / "__1_0.distcp").write_bytes(b"\0" * 100)  # a rank this run does not have
    synced = []
    monkeypatch.setattr(snapshot, "fsync_directory", lambda d: synced.append((Path(d), sorted(os.listdir(d)))))
    save_fake_sharded_snapshot(path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot_0000002"]
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]
    assert synced == [(tmp_path, ["snapshot_0000002"])]  # the directory, once the new name is in it
    assert load_snapshot(path)["step"] == 2
    # The same step again (a run restarted before its next snapshot): the old one replaced, checksums and all.
    save_fake_sharded_snapshot(path, 2, wandb_id="again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot_0000002"]
    assert load_snapshot(path)["wandb_id"] == "again"
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    with pytest.raises(ValueError, match=re.escape(f"{shard} is missing or its bytes changed since it was written")):
        load_snapshot(path)


# before the temp directory exists; a shard's write inside dcp.save (which wraps it in a CheckpointException); once
# the directory holds shards
@pytest.mark.parametrize("fails", ["dcp.save", "filesystem._write_item", "file_crc32"])
def test_a_sharded_snapshot_whose_write_fails_raises_that_error_and_leaves_nothing(tmp_path, monkeypatch, fails):
    where = {"dcp.save": dcp, "filesystem._write_item": dcp.filesystem, "file_crc32": snapshot}[fails]
    monkeypatch.setattr(where, fails.split(".")[-1], failing(errno.EIO))
    with pytest.raises(OSError, match=r"^\[Errno 5\] Input/output error$"):
        save_fake_sharded_snapshot(snapshot_path(tmp_path, 2, sharded=True), 2)
    assert list(tmp_path.iterdir()) == []


def test_a_rollback_with_no_healthy_snapshot_of_the_timeline_finds_none(data, tmp_path):
    snapshots = tiny_snapshots(data, tmp_path / "run", every=1, keep_last=5)
    snapshots.save_if_due(1, last_step=9, stopping=False, healthy=False)
    assert snapshots.newest_healthy() is None and snapshots.rollback() is None


def test_a_shard_checksum_is_zlibs_crc32_of_the_files_bytes(tmp_path):
    """What meta.pt records is the plain CRC-32 any tool computes (zlib.crc32), not one only this code reproduces."""
    data = bytes(range(256)) * 40
    (tmp_path / "__0_0.distcp").write_bytes(data)
    assert file_crc32(tmp_path / "__0_0.distcp") == zlib.crc32(data) == 0xBBCE3B9D


def test_a_snapshot_that_cannot_be_deleted_is_a_warning_naming_it(tmp_path, monkeypatch, capsys):

    def busy(path):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))

    monkeypatch.setattr(snapshot, "remove", busy)
    store.remove_or_warn(snapshot_path(tmp_path, 1))
    assert capsys.readouterr().err == (f"WARNING: could not delete {snapshot_path(tmp_path, 1)} (OSError: "
                                       f"{os.strerror(errno.EBUSY)}); it is left as it is, and training goes on. "
                                       "Delete it yourself once it can be.\n")


def test_a_directory_snapshot_whose_shard_changed_is_skipped_by_a_resume(tmp_path, capsys):
    save_snapshot(fake_snapshot(1), snapshot_path(tmp_path, 1))
    newest = snapshot_path(tmp_path, 2, sharded=True)
    save_fake_sharded_snapshot(newest, 2)
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))  # its meta.pt as it was
    assert latest(tmp_path).path == snapshot_path(tmp_path, 1)
    assert f"WARNING: skipping snapshot: {shard} is missing or its bytes changed since it was written (CRC-32 " \
        "mismatch): a bit flip or a bad copy. Trying the next older one." in capsys.readouterr().err


def test_a_directory_snapshot_of_the_run_whose_shard_changed_is_not_its_newest_healthy_one(data, tmp_path):
    snapshots = tiny_snapshots(data, tmp_path / "run")
    older = snapshots.save_if_due(1, last_step=9, stopping=False)
    newest = snapshot_path(tmp_path / "run", 2, sharded=True)
    save_fake_sharded_snapshot(newest, 2)
    store.write_record(store.sidecar(newest), {"run": snapshots.run, "step": 2})
    assert snapshots.newest_healthy() == str(newest)
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))  # its meta.pt as it was
    assert snapshots.newest_healthy() == str(older)


def test_a_file_that_is_no_zip_container_fails_its_checksums_naming_it(tmp_path):
    garbage(tmp_path / "snapshot_0000001.pt")
    with pytest.raises(ValueError) as refused:
        verify_checksums(tmp_path / "snapshot_0000001.pt", {})
    assert str(refused.value) == (f"{tmp_path / 'snapshot_0000001.pt'} could not be read as a snapshot (BadZipFile: "
                                  "File is not a zip file); it is truncated, corrupt or not a torch file.")


def test_each_snapshot_a_resume_skips_is_named_with_why_and_a_read_error_with_its_error(tmp_path, monkeypatch,
                                                                                        capsys):
    for step in (1, 2, 3):
        save_snapshot(fake_snapshot(step), snapshot_path(tmp_path, step))
    changed = {step: flip_a_byte_in_tensor_data(snapshot_path(tmp_path, step)) for step in (3,)}
    unreadable, verify = snapshot_path(tmp_path, 2), snapshot.verify_checksums

    def eio_for_unreadable(path, state=None):
        if path == unreadable:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        verify(path, state)

    monkeypatch.setattr(snapshot, "verify_checksums", eio_for_unreadable)
    assert latest(tmp_path).path == snapshot_path(tmp_path, 1)

    def flipped(step: int) -> str:
        return (f"{snapshot_path(tmp_path, step)}: the bytes of its record {changed[step]} changed since it was "
                "written (CRC-32 mismatch): a bit flip or a bad copy.")

    read_error = f"{unreadable} (OSError: [Errno {errno.EIO}] {os.strerror(errno.EIO)})"
    assert capsys.readouterr().err.splitlines() == [f"WARNING: skipping snapshot: {problem} Trying the next older one."
                                                    for problem in (flipped(3), read_error)]
    changed[1] = flip_a_byte_in_tensor_data(snapshot_path(tmp_path, 1))
    with pytest.raises(ValueError) as none_loads:
        latest(tmp_path)
    assert str(none_loads.value) == (f"none of the 3 snapshots in {tmp_path} loads: {flipped(3)} {read_error} "
                                     f"{flipped(1)}")


def test_removing_a_file_someone_deleted_first_is_no_error(tmp_path):
    snapshot.remove(snapshot_path(tmp_path, 1))  # (a prune that another process, or the user, got to first)


def test_pruning_with_nothing_to_delete_reads_no_snapshot_through(data, tmp_path, monkeypatch):
    # Its health check reads a snapshot whole (checksums): gigabytes at every snapshot for nothing, were it run.
    snapshots = tiny_snapshots(data, tmp_path, keep_last=2)
    monkeypatch.setattr(snapshot, "verify_checksums", lambda *args: pytest.fail("a snapshot was read through"))
    for step in (1, 2):
        snapshots.save_if_due(step, last_step=9, stopping=False)
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, 2), snapshot_path(tmp_path, 1)]


def test_a_model_file_without_its_weights_or_their_shape_or_that_is_missing_is_refused_naming_it(data, tmp_path):
    path = save_tiny_model(tmp_path / "model.pt")
    whole = torch.load(path, weights_only=True)
    for key in ("model", "model_config"):
        torch.save({k: v for k, v in whole.items() if k != key}, path)
        with pytest.raises(ValueError) as refused:
            read_model(path)
        assert str(refused.value) == (f"{path} is not a snapshot of this codebase (it lacks 'model' and "
                                      "'model_config'). Pass a snapshot_*.pt written by train_gpt2.py.")
    snapshot_file = tiny_snapshots(data, tmp_path / "run").save_if_due(1, last_step=9, stopping=False)
    without_loader = {k: v for k, v in torch.load(snapshot_file, weights_only=True).items() if k != "loader"}
    torch.save(without_loader, path)  # a snapshot's, so held to all of a snapshot's keys
    with pytest.raises(ValueError) as refused:
        read_model(path)
    assert str(refused.value) == f"{path} is not a training snapshot of this codebase (missing ['loader'])."
    with pytest.raises(FileNotFoundError) as missing:
        read_model(tmp_path / "gone.pt")
    assert str(missing.value) == (f"snapshot {tmp_path / 'gone.pt'}: no such file. Pass a snapshot_*.pt written by "
                                  "train_gpt2.py.")


def test_a_snapshot_file_without_a_key_or_with_a_key_of_another_type_is_refused_naming_it(tmp_path):
    no_model, step_as_text = fake_snapshot(3), fake_snapshot(3) | {"step": "3"}
    del no_model["model"]  # (what only a directory snapshot's meta.pt may lack: its shards hold the weights)
    for name, state in (("no_model.pt", no_model), ("step_as_text.pt", step_as_text)):
        save_snapshot(state, tmp_path / name)
    with pytest.raises(ValueError) as refused:
        load_snapshot(tmp_path / "no_model.pt")
    assert str(refused.value) == (f"{tmp_path / 'no_model.pt'} is not a training snapshot of this codebase "
                                  "(missing ['model']).")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'step_as_text.pt'} is not a snapshot this code "
                                                   "wrote: step is a str, where")):
        load_snapshot(tmp_path / "step_as_text.pt")

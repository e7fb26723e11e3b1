"""A run trains on exactly the shards it started with (issue 55). A train or val shard replaced (a file renamed over
it), overwritten in place at the same size (a copy over it), deleted or truncated under a running job stops every
rank between two steps with a snapshot of the last step, exit 2, one paragraph naming the shard; restored, the same
command resumes with the losses of an uninterrupted run. A val shard cut short in the middle of a validation does
the same, on every rank together. And data/prepare.py (data/fineweb.py too: one check) refuses a directory that holds
another corpus's shards, writing nothing.

The runs are real processes, tests/train_with_pauses.py: every rank waits at a chosen call while the test changes the
shard, so the change lands at a known step, without a timing race.
"""

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from conftest import ROOT, make_shards
from data import fineweb, prepare
from dataloader import HEADER_BYTES, DistributedDataLoader, ShardReadError, write_shard
from evaluation.validation import VAL_STOP_CHECK_EVERY, validation_loss
from helpers_train import go_on, main_in_process, on_ranks, read_metrics, start_paused, wait_for_pause, wait_train
from model import GPT, PRESETS
from rundir.snapshot import list_snapshots, snapshot_path
from training.errors import UserError
from training.parallel import shard

# 2 micro-batches of 2 × 16 tokens a step, on 1 rank or 2; a train shard of 200 tokens is 3 steps (6 chunks of 32)
JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--warmup_steps", "1", "--dtype",
       "fp32", "--no-shuffle", "--max_steps", "6", "--snapshot_every", "100"]
TRAIN_SHARD_TOKENS, VAL_SHARD_TOKENS = 200, 400
TINY = replace(PRESETS["tiny"], vocab_size=257)  # the model of the bytes tokenizer's shards (copy_of_shards)
OUR_FRAME = re.compile(rf'File "{re.escape(str(ROOT))}/(?!\.venv/)')  # (torchrun's launcher prints its own traceback)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return copy_of_shards(tmp_path_factory.mktemp("data"))


def copy_of(data: Path, directory: Path) -> Path:
    shutil.copytree(data, directory)
    return directory


# ----------------------------------------------------------------------------------------------------------------
# the changes, as a user's commands make them

def other_tokens(shard: Path) -> np.ndarray:
    """Tokens for a shard of the same size with other contents."""
    return np.fromfile(shard, dtype="<u2", offset=HEADER_BYTES)[::-1].astype(np.int64)


def moved_over(shard: Path) -> None:
    """`mv other.bin shard`: a new file (another inode) takes its name."""
    write_shard(shard.with_name("other.bin"), other_tokens(shard))
    os.replace(shard.with_name("other.bin"), shard)


def copied_over(shard: Path) -> None:
    """`cp other.bin shard`: the same file (inode) rewritten in place, to the same size."""
    write_shard(shard.with_name("other.bin"), other_tokens(shard))
    wait_for_the_file_clock(shard)
    shutil.copyfile(shard.with_name("other.bin"), shard)


def deleted(shard: Path) -> None:
    shard.unlink()


def truncated(shard: Path) -> None:
    os.truncate(shard, HEADER_BYTES + 2 * 50)


CHANGES = {"mv": moved_over, "cp": copied_over, "delete": deleted, "truncate": truncated}
# what each change is called in the error, after "error: SHARD: "
SAID = {"mv": r"another file \([\d,]+ bytes\) took the shard's place since the run started",
        "cp": r"the shard was written to in place since the run started: the same [\d,]+ bytes, but its change time",
        "delete": r"the shard was deleted or moved away since the run started \(No such file or directory\)",
        "truncate": r"the shard is now 1,124 bytes, not the [\d,]+ it had when the run started"}


def wait_for_the_file_clock(path: Path) -> None:
    """Until a file written now gets a later change time than path's: the kernel stamps files from a coarse clock
    (a few ms a tick), and a write within the tick of path's last change would leave its ctime as it was."""
    probe = path.with_name("clock.probe")
    while probe.write_bytes(b"") is not None and probe.stat().st_ctime_ns <= path.stat().st_ctime_ns:
        time.sleep(0.001)
    probe.unlink()


def restore(shard: Path, tokens: np.ndarray) -> None:
    shard.with_name("other.bin").unlink(missing_ok=True)
    write_shard(shard, tokens)


# ----------------------------------------------------------------------------------------------------------------
# the loader and the validation, in this process

B, T = 2, 16


@pytest.mark.parametrize("change", CHANGES)
def test_the_loader_names_a_shard_changed_after_it_was_made_at_the_next_step(tmp_path, change):
    data = copy_of_shards(tmp_path)
    loader = DistributedDataLoader(data, "train", B, T, grad_accum_steps=2)
    loader.read_ahead()
    [loader.next_batch() for _ in range(2)]
    CHANGES[change](data / "test_train_000001.bin")  # not read yet: the loader is in shard 0
    with pytest.raises(ShardReadError, match=rf"^{re.escape(str(data / 'test_train_000001.bin'))}: {SAID[change]}"):
        loader.read_ahead()
    assert loader.state_dict()["chunk_position"] == 2  # a snapshot now resumes at step 1


def test_reading_and_a_file_beside_the_shards_change_nothing_the_watch_sees(tmp_path):
    data = copy_of_shards(tmp_path)
    loader = DistributedDataLoader(data, "train", B, T, grad_accum_steps=2)
    for path in data.iterdir():
        path.read_bytes()
    wait_for_the_file_clock(data / "test_train_000000.bin")
    (data / "notes.txt").write_text("a file beside the shards")
    for _ in range(10):  # three shards and on into the second epoch: every shard opened again
        loader.read_ahead()
        [loader.next_batch() for _ in range(2)]
    assert loader.state_dict()["epoch"] == 1


def copy_of_shards(tmp_path: Path) -> Path:
    """The job's shards, of the bytes tokenizer: a model 257 ids wide (TINY), not GPT-2's 50,257, is several times
    cheaper a step."""
    # steps 0-2, 3-5, 6-8
    make_shards(tmp_path / "data", "train", [TRAIN_SHARD_TOKENS] * 3, seed=0, vocab=257, tokenizer="bytes")
    make_shards(tmp_path / "data", "val", [VAL_SHARD_TOKENS], seed=1, vocab=257, tokenizer="bytes")
    return tmp_path / "data"


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_val_shard_changed_before_or_during_a_validation_is_a_shard_read_error(tmp_path, when, monkeypatch):
    data = copy_of_shards(tmp_path)
    shard = data / "test_val_000000.bin"
    loader = DistributedDataLoader(data, "val", B, T)
    model = GPT(TINY)
    assert validation_loss(model, loader, 4, torch.device("cpu"), torch.float32) is not None
    if when == "before":
        truncated(shard)
    else:  # cut short after the second batch is read
        real_forward, calls = GPT.forward, []

        def forward(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                truncated(shard)
            return real_forward(self, *args, **kwargs)

        monkeypatch.setattr(GPT, "forward", forward)
    with pytest.raises(ShardReadError, match=f"^{re.escape(str(shard))}: the shard is now 1,124 bytes"):
        validation_loss(model, loader, 4, torch.device("cpu"), torch.float32)


def validate_with_rank_1_failing(rank: int, data: str, fail_at: int) -> list[dict]:
    """validation_loss of an FSDP model on 2 ranks, rank 1's read of batch `fail_at` failing, with 20 batches (a stop
    check after 16) and with 8: what each rank raised, and how many batches it read."""
    return [validate_failing(rank, data, fail_at, steps) for steps in (VAL_STOP_CHECK_EVERY + 4, 8)]


def validate_failing(rank: int, data: str, fail_at: int, steps: int) -> dict:
    loader = DistributedDataLoader(data, "val", B, T, rank, 2)
    real_next_batch, reads = loader.next_batch, []

    def next_batch():
        reads.append(1)
        if rank == 1 and len(reads) == fail_at + 1:
            raise ShardReadError(f"rank 1 could not read batch {fail_at}")
        return real_next_batch()

    loader.next_batch, error = next_batch, None
    model = GPT(TINY)
    shard(model, torch.float32, init_device_mesh("cpu", (2,)))  # FSDP2: every forward is a collective of the ranks
    try:
        validation_loss(model, loader, steps, torch.device("cpu"), torch.float32)
    except ShardReadError as e:
        error = str(e)
    return {"error": error, "reads": len(reads)}


@pytest.mark.slow  # 2 spawned processes: about 10 s
def test_a_read_failing_on_one_rank_during_a_validation_raises_its_error_on_every_rank_together(tmp_path):
    data = copy_of_shards(tmp_path)
    rank_0, rank_1 = on_ranks(validate_with_rank_1_failing, tmp_path / "ranks", str(data), 3)
    # Neither rank waits for the other in a collective: both raise rank 1's error at the first check after batch 3,
    # the stop check after batch 16 or the end of 8; rank 0 reads on until then, rank 1 reads no more.
    assert [r["error"] for r in rank_0 + rank_1] == ["rank 1 could not read batch 3"] * 4
    assert [r["reads"] for r in rank_0] == [VAL_STOP_CHECK_EVERY, 8] and [r["reads"] for r in rank_1] == [4, 4]


# ----------------------------------------------------------------------------------------------------------------
# real runs: a change at a known step stops every rank with a snapshot; restored, the same command resumes exactly

def stopped_with_a_snapshot(data: Path, logs: Path, args: list[str], pause: tuple[str, int], change, shard: Path,
                            nproc: int | None) -> subprocess.CompletedProcess:
    """Start the run, change the shard while every rank waits at `pause`, let it go on; its end, which must be exit 2
    on every rank with no traceback of ours."""
    proc = start_paused([*JOB, "--data_dir", str(data), *args], logs, [pause], nproc)
    markers = wait_for_pause(proc, logs, *pause, ranks=nproc or 1)
    change(shard)
    go_on(markers)
    run = wait_train(proc, logs, timeout=300, check=False)
    if nproc is None:
        assert run.proc.returncode == 2 and "Traceback" not in run.proc.stderr, run.output[-4000:]
    else:  # torchrun reports its workers' exit status (the first, or both), and a traceback of its own launcher's
        assert run.proc.returncode != 0 and "exitcode  : 2" in run.output, run.output[-4000:]
        assert not OUR_FRAME.search(run.output), run.output[-4000:]
    return run.proc


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> dict[int, float]:
    """The losses of the run uninterrupted, by step (on 1 rank)."""
    logs = tmp_path_factory.mktemp("uninterrupted")
    main_in_process([*JOB, "--data_dir", str(data), "--val_every", "2", "--val_tokens", "192", "--log_dir", str(logs)])
    return {r["step"]: r["loss"] for r in read_metrics(logs) if "loss" in r}


def resumes_exactly(data: Path, logs: Path, args: list[str], uninterrupted: dict[int, float], from_step: int,
                    exact: bool) -> None:
    """The same command again (on 1 rank): it resumes after from_step and trains on as the uninterrupted run did."""
    main_in_process([*JOB, "--data_dir", str(data), *args, "--log_dir", str(logs)])
    resumed = {r["step"]: r["loss"] for r in read_metrics(logs) if "loss" in r and r["step"] > from_step}
    assert resumed.keys() == set(range(from_step + 1, 6))
    if exact:
        assert resumed == {step: uninterrupted[step] for step in resumed}
    else:  # a 2-rank run's weights: its all-reduce sums in another order
        assert all(abs(resumed[s] / uninterrupted[s] - 1) < 1e-4 for s in resumed), (resumed, uninterrupted)


def errors_naming(stderr: str, shard: Path, change: str) -> list[str]:
    return re.findall(rf"^error: {re.escape(str(shard))}: {SAID[change]}.*$", stderr, re.M)


@pytest.mark.slow  # real processes (torchrun with 2 ranks), then the resume
@pytest.mark.parametrize("nproc", [None, 2], ids=["1 rank", "2 ranks"])
@pytest.mark.parametrize("change", CHANGES)
def test_a_train_shard_changed_under_a_run_stops_every_rank_with_a_snapshot_and_restored_resumes_exactly(
        data, tmp_path, uninterrupted, change, nproc):
    data = copy_of(data, tmp_path / "data")
    shard = data / "test_train_000001.bin"  # not read yet: step 2's batches end shard 0, and then it is opened
    tokens = np.fromfile(shard, dtype="<u2", offset=HEADER_BYTES).astype(np.int64)
    logs, args = tmp_path / "logs", ["--val_every", "2", "--val_tokens", "192"]
    proc = stopped_with_a_snapshot(data, logs, args, ("read_ahead", 3), CHANGES[change], shard, nproc)
    errors = errors_naming(proc.stderr, shard, change)
    assert len(errors) == (nproc or 1), proc.stderr[-4000:]  # every rank's
    assert all(e.endswith(f"Every rank stopped after step 1; the newest snapshot is {snapshot_path(logs, 1)}: restore "
                          "the shard and rerun the same command to resume from it. (A run trains on exactly the shards "
                          "it started with, so any change to one under it stops it, a new file renamed over it too: "
                          "write new or re-made shards into another directory, for a new run.)") for e in errors)
    assert list_snapshots(logs) == [snapshot_path(logs, 1)]
    assert max(r["step"] for r in read_metrics(logs) if "loss" in r) == 1  # step 2 never trained

    restore(shard, tokens)
    resumes_exactly(data, logs, args, uninterrupted, from_step=1, exact=nproc is None)


@pytest.mark.slow  # real processes, then the resume
@pytest.mark.parametrize("change", CHANGES)
def test_a_val_shard_changed_before_a_validation_stops_the_run_with_a_snapshot_and_restored_resumes_exactly(
        data, tmp_path, uninterrupted, change):
    data = copy_of(data, tmp_path / "data")
    shard = data / "test_val_000000.bin"
    tokens = np.fromfile(shard, dtype="<u2", offset=HEADER_BYTES).astype(np.int64)
    logs, args = tmp_path / "logs", ["--val_every", "2", "--val_tokens", "192"]
    proc = stopped_with_a_snapshot(data, logs, args, ("validation_loss", 2), CHANGES[change], shard, None)
    (error,) = errors_naming(proc.stderr, shard, change)
    assert f"Every rank stopped during the evaluation before step 2; the newest snapshot is {snapshot_path(logs, 1)}" \
        in error
    assert list_snapshots(logs) == [snapshot_path(logs, 1)]

    restore(shard, tokens)
    resumes_exactly(data, logs, args, uninterrupted, from_step=1, exact=True)


@pytest.mark.slow  # real processes (torchrun with 2 ranks), then the resume
@pytest.mark.parametrize("nproc", [None, 2], ids=["1 rank", "2 ranks"])
def test_a_val_shard_truncated_during_a_validation_stops_every_rank_together_with_a_snapshot(data, tmp_path,
                                                                                           uninterrupted, nproc):
    data = copy_of(data, tmp_path / "data")
    # one pass of 20 batches a rank, on 2 ranks
    make_shards(data, "val", [20 * 32 * 2 + 1], seed=1, vocab=257, tokenizer="bytes")
    shard = data / "test_val_000000.bin"
    tokens = np.fromfile(shard, dtype="<u2", offset=HEADER_BYTES).astype(np.int64)
    # 20 val batches, so that the ranks agree at the stop check after batch 16. Forward calls: the validation before
    # step 0 (20), steps 0 and 1 (2 micro-batches on 1 rank, 1 each on 2 ranks), then the one before step 2: cut short
    # at its 3rd batch's forward, when 3 have been read.
    logs, args = tmp_path / "logs", ["--val_every", "2", "--val_tokens", str(20 * 32 * (nproc or 1))]
    forward = 20 + (4 if nproc is None else 2) + 3
    proc = stopped_with_a_snapshot(data, logs, args, ("forward", forward), truncated, shard, nproc)
    errors = re.findall(rf"^error: {re.escape(str(shard))}: the shard is now 1,124 bytes.*$", proc.stderr, re.M)
    assert len(errors) == (nproc or 1), proc.stderr[-4000:]
    assert all("Every rank stopped during the evaluation before step 2; the newest snapshot is "
               f"{snapshot_path(logs, 1)}" in e for e in errors)
    assert list_snapshots(logs) == [snapshot_path(logs, 1)]
    assert [r["step"] for r in read_metrics(logs) if "val_loss" in r] == [0]  # the cut one was never logged

    restore(shard, tokens)
    resumes_exactly(data, logs, args, uninterrupted, from_step=1, exact=nproc is None)


# ----------------------------------------------------------------------------------------------------------------
# data/prepare.py and data/fineweb.py: a directory holding another corpus's shards is refused, nothing written

def contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture
def texts(tmp_path) -> dict[str, Path]:
    texts = {}
    for name in ("a", "b"):
        texts[name] = tmp_path / f"{name}.txt"
        texts[name].write_text(f"The text of corpus {name}, which is short. " * 20)
    return texts


def test_prepare_into_a_directory_with_another_corpuss_shards_is_refused_naming_them_and_nothing_is_written(
        texts, tmp_path, gpt2_encoding):
    out = tmp_path / "out"
    prepare.main(["--input", str(texts["a"]), "--output_dir", str(out)])
    prepare.main(["--input", str(texts["a"]), "--output_dir", str(out)])  # the same again: the same shards
    before = contents(out)
    assert {"out_train_000000.bin", "out_val_000000.bin", "progress.json"} <= before.keys()
    texts["a"].with_suffix(".jsonl").write_text(json.dumps({"text": texts["a"].read_text()}) + "\n")
    with pytest.raises(UserError) as refused:  # (run_entry_point: exit 2 and this paragraph)
        prepare.main(["--input", str(texts["b"]), "--output_dir", str(out)])
    assert str(refused.value) == (
        f"{out} already holds shards of data.prepare --input {texts['a']} --val_fraction 0.1 with --shard_size "
        f"100000000 (see {out / 'progress.json'}), not of data.prepare --input {texts['b']} --val_fraction 0.1 with "
        f"--shard_size 100000000. Pass another --output_dir, or delete {out} to start over.")
    with pytest.raises(UserError, match="already holds shards of data.prepare"):  # data/fineweb.py: the same check
        fineweb.main(["--input", str(texts["a"].with_suffix(".jsonl")), "--output_dir", str(out), "--num_proc", "1"])
    assert contents(out) == before


def test_prepare_or_fineweb_into_a_directory_with_shards_no_record_accounts_for_writes_nothing(texts, tmp_path,
                                                                                               gpt2_encoding):
    out = tmp_path / "out"
    make_shards(out, "train", [100, 100])  # test_train_000000.bin, ...: another tool's, or copied in
    before = contents(out)
    message = (f"{out} already holds shards that no progress.json there accounts for (test_train_000000.bin, "
               "test_train_000001.bin): another corpus's, or written by other means. The data loader reads every "
               f"shard of a directory, so it would train on them with these. Pass another --output_dir, or move them "
               f"out of {out}.")
    with pytest.raises(UserError) as refused:
        prepare.main(["--input", str(texts["a"]), "--output_dir", str(out)])
    assert str(refused.value) == message
    texts["a"].with_suffix(".jsonl").write_text(json.dumps({"text": texts["a"].read_text()}) + "\n")
    with pytest.raises(UserError) as refused:
        fineweb.main(["--input", str(texts["a"].with_suffix(".jsonl")), "--output_dir", str(out), "--num_proc", "1"])
    assert str(refused.value) == message
    assert contents(out) == before
    # beside our own shards too
    shutil.rmtree(out)
    prepare.main(["--input", str(texts["a"]), "--output_dir", str(out)])
    make_shards(out, "val", [100])
    with pytest.raises(UserError, match=r"accounts for \(test_val_000000.bin\)"):
        prepare.main(["--input", str(texts["a"]), "--output_dir", str(out)])

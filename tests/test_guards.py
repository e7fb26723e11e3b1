"""The divergence guards: a NaN or a spike never reaches the weights, snapshots stay healthy, and a run that keeps
diverging stops with a clear message or rolls back to its newest healthy snapshot.

Faults are planted in the data: a forward hook multiplies the loss of chosen batches (found by their tokens) by NaN
or by a spike factor, so a planted batch stays bad wherever and whenever the run reads it, as a bad batch of real
data would. In-process runs (train_gpt2.run) keep these tests fast; the exit status and a 2-rank run need real
processes.
"""

import builtins
import errno
import json
import math
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

import train_gpt2
from conftest import copy_run, flip_a_byte_in_tensor_data, make_shards, tiny_snapshots
from dataloader import DistributedDataLoader
from helpers_train import TINY_ARGS, read_metrics, run_train
from model import GPT
from rundir import store as snapshot_store
from rundir.snapshot import list_snapshots, load_snapshot, save_snapshot, snapshot_path
from training.config import TrainConfig, parse_args
from training.distributed import Distributed
from training.divergence import DivergenceGuard
from training.errors import UserError
from training.run_logger import RunLogger

CPU = torch.device("cpu")
B, T, ACCUM = 2, 16, 2  # 2 micro-steps of 2 × 16 tokens per step
JOB = ["--micro_batch_size", str(B), "--seq_len", str(T), "--total_batch_size", str(B * T * ACCUM),
       "--warmup_steps", "3", "--max_lr", "1e-3", "--val_every", "0", "--dtype", "fp32", "--snapshot_every", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """One shard of 40,000 tokens: 625 steps, so no test reaches an epoch boundary."""
    directory = tmp_path_factory.mktemp("guards") / "data"
    # A small vocabulary: the loss falls, steps differ (and the model is 257 ids wide, its steps quick).
    make_shards(directory, "train", [40_000], vocab=100, tokenizer="bytes")
    make_shards(directory, "val", [500], seed=1, vocab=100, tokenizer="bytes")
    return directory


def run_in_process(data: Path, log_dir: Path, *args: str) -> list[dict]:
    """train_gpt2.run on one CPU process; returns its metrics.jsonl."""
    cfg = parse_args([*TINY_ARGS, "--data_dir", str(data), "--log_dir", str(log_dir), *JOB, *args])
    train_gpt2.run(cfg, Distributed(0, 0, 1, CPU))
    return read_metrics(log_dir)


def job_loader(data: Path) -> DistributedDataLoader:
    """The training data as a run with JOB reads it."""
    return DistributedDataLoader(data, "train", B, T, grad_accum_steps=ACCUM, shuffle=True, seed=1337)


def micro_batches_of(data: Path, steps: list[int], every_micro_step: bool = False) -> dict[tuple, int]:
    """A key for the first micro-batch (or every one) of each of `steps` (its first tokens), as a run with JOB reads
    them. A step's micro-batches are the same whatever the number of ranks (see dataloader.py)."""
    loader = job_loader(data)
    keys = {}
    for step in range(max(steps) + 1):
        for micro_step in range(ACCUM):
            x, _ = loader.next_batch()
            if step in steps and (micro_step == 0 or every_micro_step):
                keys[batch_key(x)] = step
    return keys


def batch_key(x: torch.Tensor) -> tuple:
    return tuple(x[0, :8].tolist())


def plant(monkeypatch, data: Path, steps: list[int], factor: float) -> None:
    """Multiply the loss of the first micro-batch of each of `steps` (that data, whenever it is read) by factor."""
    bad = micro_batches_of(data, steps)
    real_forward = GPT.forward

    def forward(self, idx, targets=None):
        logits, loss = real_forward(self, idx, targets)
        if loss is not None and batch_key(idx) in bad:
            loss = loss * factor
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)


def losses(records: list[dict]) -> dict[int, float]:
    """{step: loss} of the training steps; a step logged again (after a rollback) keeps its later line."""
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def skipped(records: list[dict]) -> dict[int, str]:
    return {r["step"]: r["skip_reason"] for r in records if r.get("skipped")}


# ----------------------------------------------------------------------------------------------------------------
# the guard on its own

def test_guard_names_the_reason_for_a_non_finite_step_and_counts_skips_in_a_row():
    guard = DivergenceGuard()
    assert guard.review(3.0, 1.0, fp16=False) is None
    assert guard.review(math.nan, 1.0, fp16=False) == "non-finite loss"
    assert guard.review(3.0, math.inf, fp16=False) == "non-finite grad norm"
    assert guard.review(3.0, math.inf, fp16=True) == "fp16 overflow"
    assert guard.review(math.inf, 1.0, fp16=False) == guard.review(-math.inf, 1.0, fp16=False) == "non-finite loss"
    assert guard.skips_in_a_row == 5
    assert guard.review(3.0, 1.0, fp16=False) is None
    assert guard.skips_in_a_row == 0
    assert list(guard.losses) == [3.0, 3.0]  # skipped steps never enter the statistics


def test_spike_guard_waits_for_its_warmup_then_skips_outliers_only():
    guard = DivergenceGuard(zscore=4.0)
    history = [5.0 + 0.1 * (i % 3) for i in range(DivergenceGuard.SPIKE_WARMUP - 1)]  # mean 5.1, spread 0.08
    for loss in history:
        assert guard.review(loss, 1.0 + loss / 100, fp16=False) is None
    assert guard.review(50.0, 1.0, fp16=False) is None  # one short of the warm-up: not judged (and now recorded)
    guard = DivergenceGuard(zscore=4.0)
    for loss in history + [5.1]:
        guard.review(loss, 1.0 + loss / 100, fp16=False)
    assert guard.review(5.2, 1.05, fp16=False) is None  # z = 1.2
    reason = guard.review(5.6, 1.0, fp16=False)  # loss z ≈ 6
    assert re.fullmatch(r"loss spike z=\d+\.\d", reason) and float(reason.split("=")[1]) > 4
    assert guard.review(5.1, 9.0, fp16=False).startswith("grad norm spike z=")
    state = guard.state_dict()
    resumed = DivergenceGuard(zscore=4.0)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state and resumed.review(5.6, 1.0, fp16=False) == reason


def steady_guard(steps: int) -> DivergenceGuard:
    """A spike guard (zscore 4) that has recorded `steps` applied steps of loss ≈ 5.1 and grad norm ≈ 1.05."""
    guard = DivergenceGuard(zscore=4.0)
    for i in range(steps):
        assert guard.review(5.0 + 0.1 * (i % 3), 1.0 + 0.05 * (i % 3), fp16=False) is None
    return guard


def test_spikes_are_judged_from_exactly_spike_warmup_recorded_steps_and_only_above_the_mean():
    assert steady_guard(DivergenceGuard.SPIKE_WARMUP).review(50.0, 1.0, fp16=False).startswith("loss spike z=")
    # Far below the mean (z ≈ -60) is a good step, not a spike: only an outlier upwards is skipped.
    low = steady_guard(DivergenceGuard.SPIKE_WARMUP)
    assert low.review(0.1, 1.0, fp16=False) is None and low.review(5.1, 0.01, fp16=False) is None


def test_the_spike_windows_hold_the_last_spike_window_steps_also_after_a_load():
    window = DivergenceGuard.SPIKE_WINDOW
    guard = steady_guard(window + 50)
    resumed = DivergenceGuard(zscore=4.0)
    resumed.load_state_dict(guard.state_dict())
    for each in (guard, resumed):
        assert each.losses.maxlen == each.grad_norms.maxlen == window
        assert len(each.losses) == len(each.grad_norms) == window
    for _ in range(window):
        resumed.review(5.1, 1.05, fp16=False)
    assert len(resumed.losses) == len(resumed.grad_norms) == window


# ----------------------------------------------------------------------------------------------------------------
# healthy snapshots

def written(data: Path, directory: Path, healthy: dict[int, bool], keep_last: int = 2, corrupt=()):
    """A run's Snapshots with snapshots of each step `healthy` names, healthy or not, pruned to keep_last after each
    save; the steps of `corrupt` get a flipped byte right after they are written."""
    snapshots = tiny_snapshots(data, directory, keep_last=keep_last)
    for step, flag in healthy.items():
        snapshots.save_if_due(step, last_step=99, stopping=False, healthy=flag)
        if step in corrupt:
            flip_a_byte_in_tensor_data(snapshot_path(directory, step))  # healthy by its flag, but its bytes changed
    return snapshots


def test_a_corrupt_healthy_snapshot_is_neither_rolled_back_to_nor_kept_by_pruning(data, tmp_path):
    snapshots = written(data, tmp_path, {4: True, 9: True, 14: False, 19: False}, corrupt=(9,))
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, step) for step in (19, 14, 4)]
    assert snapshots.newest_healthy() == str(snapshot_path(tmp_path, 4))


def test_pruning_keeps_the_newest_healthy_snapshot_beyond_keep_last(data, tmp_path):
    written(data, tmp_path, {4: True, 9: True, 14: False, 19: False})
    assert [p.name for p in list_snapshots(tmp_path)] == ["snapshot_0000019.pt", "snapshot_0000014.pt",
                                                          "snapshot_0000009.pt"]


@pytest.mark.parametrize("healthy, kept", [
    ({4: False, 9: True, 14: False, 19: False, 24: False}, [24, 19, 9]),  # the only healthy one is unreadable
    ({4: True, 9: True, 14: False, 19: False, 24: False}, [24, 19, 9, 4]),  # one newer than the newest readable
])
def test_a_snapshot_whose_health_a_read_error_hides_is_kept_by_pruning(data, tmp_path, monkeypatch, healthy, kept):
    # snapshot_9 cannot be read for now (EIO): it may be the newest healthy snapshot, so pruning keeps it, and the
    # older healthy one too if there is one; the unhealthy ones beyond --keep_last go.
    snapshots = written(data, tmp_path, {step: flag for step, flag in healthy.items() if step < 24}, keep_last=9)
    snapshots.keep_last = 2
    unreadable, real_open = snapshot_path(tmp_path, 9), builtins.open

    def open_but_not_9(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file) == unreadable:
            raise OSError(errno.EIO, "Input/output error", str(file))
        return real_open(file, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", open_but_not_9)
        snapshots.save_if_due(24, last_step=99, stopping=False, healthy=False)
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, step) for step in kept]
    assert snapshots.newest_healthy() == str(unreadable)  # once it reads again


def test_no_snapshot_is_written_from_nan_weights(data, tmp_path):
    messages = []
    snapshots = tiny_snapshots(data, tmp_path, messages.append)
    assert snapshots.save_if_due(0, 10, False) == snapshot_path(tmp_path, 0)
    with torch.no_grad():
        snapshots.trainee.raw.transformer.h[1].mlp.c_fc.weight[3, 5] = math.nan
    assert snapshots.save_if_due(1, 10, False) is None
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, 0)]
    assert "no snapshot after step 1: the weights or optimizer state hold NaN or inf" in messages[-1]


def test_a_rollback_adds_one_to_the_runs_count_whatever_the_snapshot_holds(data, tmp_path):
    # The snapshot restored can hold fewer rollbacks than the run has made (its rewrite after an earlier rollback
    # failed, or a newer one turned out broken): --max_rollbacks counts the run's.
    guard = DivergenceGuard()
    snapshots = tiny_snapshots(data, tmp_path, guard=guard)
    snapshots.save_if_due(0, 10, False)
    guard.rollbacks, guard.skips_in_a_row = 2, 3
    cfg = TrainConfig(on_divergence="rollback", max_skips=3, max_rollbacks=5)
    response = train_gpt2.DivergenceResponse(cfg, snapshots, guard, snapshots.train_loader,
                                             RunLogger(tmp_path / "logs", "run"), print)
    assert response.respond(7, "non-finite loss") == 1
    assert guard.rollbacks == 3 and guard.skips_in_a_row == 0
    assert load_snapshot(snapshot_path(tmp_path, 0))["guard"]["rollbacks"] == 3


@pytest.mark.parametrize("flags, message", [
    (["--on_divergence", "rollback"], "--on_divergence rollback reloads .* --snapshot_every 0"),
    (["--skip_zscore", "-3"], r"--skip_zscore -3.0: pass a number at least 0 \(--help: \"also skip an update"),
    (["--skip_zscore", "nan"], r"--skip_zscore nan: pass a finite number at least 0"),
    (["--max_skips", "0"], r"--max_skips 0: pass a number at least 1 \(--help: \"skipped updates in a row")])
def test_guard_flags_that_cannot_work_are_refused(data, tmp_path, flags, message):
    with pytest.raises(UserError, match=message):
        run_in_process(data, tmp_path, "--max_steps", "2", *flags)


# ----------------------------------------------------------------------------------------------------------------
# runs with planted faults

# bf16 in the whole suite only: emulated on CPUs without bf16 arithmetic, it takes 18 s there
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_a_nan_loss_skips_that_update_and_training_goes_on_as_without_it(data, tmp_path, monkeypatch, dtype, capsys):
    # The reference: no NaN, and AdamW's 6th update (step 5's) simply not made, the data of step 5 still read.
    real_step, calls = torch.optim.AdamW.step, []

    def step_but_the_sixth(self, *args, **kwargs):
        calls.append(1)
        return None if len(calls) == 6 else real_step(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.optim.AdamW, "step", step_but_the_sixth)
        reference = losses(run_in_process(data, tmp_path / "reference", "--max_steps", "8", "--dtype", dtype))

    plant(monkeypatch, data, [5], math.nan)
    records = run_in_process(data, tmp_path / "nan", "--max_steps", "8", "--dtype", dtype)

    assert skipped(records) == {5: "non-finite loss"}
    assert re.search(r"step     5 \| loss nan .* \| step skipped: non-finite loss\n", capsys.readouterr().out)
    got = losses(records)
    assert got[5] is None  # NaN is logged as null
    assert {s: v for s, v in got.items() if s != 5} == {s: v for s, v in reference.items() if s != 5}
    assert got[7] < got[0] - 0.1  # and the run really trained (by 0.13)


@pytest.mark.slow  # over 3 s: keeps `-m 'not slow'` under 90 s
def test_rollback_reloads_the_newest_healthy_snapshot_and_skips_the_bad_data(data, tmp_path, monkeypatch):
    plant(monkeypatch, data, [6, 7, 8], math.nan)  # bad data at steps 6-8: 3 skips in a row, then a rollback
    args = ["--max_steps", "14", "--snapshot_every", "5", "--keep_last", "3", "--max_skips", "3",
            "--on_divergence", "rollback"]
    rollback, before_rollback = snapshot_store.Snapshots.rollback, snapshot_path(tmp_path, 4)

    def copy_then_rollback(self):  # (the rollback writes its own state over the snapshot it restores)
        shutil.copy(snapshot_path(tmp_path / "run", 4), before_rollback)
        return rollback(self)

    monkeypatch.setattr(snapshot_store.Snapshots, "rollback", copy_then_rollback)
    records = run_in_process(data, tmp_path / "run", *args)

    assert skipped(records) == {6: "non-finite loss", 7: "non-finite loss", 8: "non-finite loss"}
    rollbacks = [r for r in records if r.get("event") == "rollback"]
    assert len(rollbacks) == 1
    assert rollbacks[0] | {"data_position": None} == {
        "event": "rollback", "step": 8, "to_step": 5, "snapshot": str(snapshot_path(tmp_path / "run", 4)),
        "rollbacks": 1, "reason": "non-finite loss", "data_position": None}
    after = losses(records[records.index(rollbacks[0]) + 1:])
    assert list(after) == list(range(5, 14)) and all(math.isfinite(v) for v in after.values())

    # Independently: resume from the step-4 snapshot with the data loader moved 4 steps on (past steps 5-8's
    # batches), with no fault planted. Training from there must be the same, to the bit.
    monkeypatch.undo()
    state = load_snapshot(before_rollback)
    state["loader"]["chunk_position"] += 4 * state["loader"]["chunks_per_step"]
    moved = snapshot_path(tmp_path / "moved", 4)
    save_snapshot(state, moved)
    reference = losses(run_in_process(data, tmp_path / "reference", *args, "--resume", str(moved)))
    assert after == reference


def test_a_rollback_removes_the_unhealthy_snapshots_of_the_abandoned_timeline(data, tmp_path, monkeypatch):
    # Bad data at steps 8-10: snapshot_9 is written while updates are skipped (unhealthy), then the rollback goes to
    # snapshot_4. Left on disk, snapshot_9 would be what --resume auto picks after a crash before the new step 9,
    # with the old timeline's data position (before the skipped batches).
    plant(monkeypatch, data, [8, 9, 10], math.nan)
    run_dir = tmp_path / "run"
    on_disk_after_rollback = []
    commit_rollback = snapshot_store.Snapshots.commit_rollback

    def spied_rollback(self, step, path):
        assert [p.name for p in list_snapshots(run_dir)] == ["snapshot_0000009.pt", "snapshot_0000004.pt"]
        assert not load_snapshot(snapshot_path(run_dir, 9))["healthy"]
        commit_rollback(self, step, path)
        on_disk_after_rollback.extend(p.name for p in list_snapshots(run_dir))

    monkeypatch.setattr(snapshot_store.Snapshots, "commit_rollback", spied_rollback)
    records = run_in_process(data, run_dir, "--max_steps", "12", "--snapshot_every", "5", "--keep_last", "3",
                             "--max_skips", "3", "--on_divergence", "rollback")
    assert on_disk_after_rollback == ["snapshot_0000004.pt"]
    assert [r["to_step"] for r in records if r.get("event") == "rollback"] == [5]
    # The new timeline's snapshots of steps 9 and 11 (the last), written though the old one had a step-9 snapshot.
    assert [p.name for p in list_snapshots(run_dir)] == ["snapshot_0000011.pt", "snapshot_0000009.pt",
                                                         "snapshot_0000004.pt"]
    assert all(load_snapshot(p)["healthy"] for p in list_snapshots(run_dir))  # the new step 9's, and step 11's


class Crash(BaseException):
    """A crash: nothing of the run after it runs."""


@pytest.mark.slow  # over 3 s: keeps `-m 'not slow'` under 90 s
def test_a_rollback_is_written_at_once_so_a_crash_after_it_resumes_after_it(data, tmp_path, monkeypatch):
    # Bad data at steps 6-8: a rollback at step 8 to snapshot_4, then steps 5-11 read data 9-15. A crash right after
    # the rollback, before snapshot_9, must resume with the data after the bad batches and the rollback counted.
    plant(monkeypatch, data, [6, 7, 8], math.nan)
    args = ["--max_steps", "12", "--snapshot_every", "5", "--keep_last", "3", "--max_skips", "3",
            "--on_divergence", "rollback"]
    whole = run_in_process(data, tmp_path / "whole", *args)
    rollback = [r for r in whole if r.get("event") == "rollback"]
    assert [r["to_step"] for r in rollback] == [5]

    respond = train_gpt2.DivergenceResponse.respond

    def respond_then_crash(self, step, reason):
        respond(self, step, reason)
        raise Crash

    with monkeypatch.context() as patch:
        patch.setattr(train_gpt2.DivergenceResponse, "respond", respond_then_crash)
        with pytest.raises(Crash):
            run_in_process(data, tmp_path / "crashed", *args)
    assert list_snapshots(tmp_path / "crashed") == [snapshot_path(tmp_path / "crashed", 4)]
    state = load_snapshot(snapshot_path(tmp_path / "crashed", 4))
    read_9_steps = job_loader(data)
    for _ in range(9 * ACCUM):
        read_9_steps.next_batch()
    assert state["loader"] == read_9_steps.state_dict()  # past the data of steps 0-8, bad ones included
    assert state["guard"]["rollbacks"] == 1 and state["healthy"] and state["step"] == 4

    records = run_in_process(data, tmp_path / "crashed", *args)  # the same bad data, still there
    rerun = records[max(i for i, r in enumerate(records) if r.get("event") == "resume"):]
    assert rerun[0]["step"] == 5 and not skipped(rerun) and not any(r.get("event") == "rollback" for r in rerun)
    assert losses(rerun) == losses(whole[whole.index(rollback[0]) + 1:])
    assert load_snapshot(snapshot_path(tmp_path / "crashed", 11))["guard"]["rollbacks"] == 1


def test_the_rollback_count_survives_a_restart(data, tmp_path, monkeypatch):
    args = ["--snapshot_every", "5", "--keep_last", "5", "--max_skips", "3", "--on_divergence", "rollback",
            "--max_rollbacks", "1"]
    plant(monkeypatch, data, [6, 7, 8], math.nan)
    first = run_in_process(data, tmp_path, *args, "--max_steps", "10")  # rolls back to step 4, ends at step 9
    assert [r["rollbacks"] for r in first if r.get("event") == "rollback"] == [1]
    # Restarted and longer: steps now read the data 4 positions on, so data 16-18 go bad at steps 12-14. The one
    # rollback allowed was spent before the restart, so this divergence stops the run.
    monkeypatch.undo()
    plant(monkeypatch, data, [16, 17, 18], math.nan)
    with pytest.raises(UserError, match=r"after 1 rollback\(s\) \(--max_rollbacks 1\), 3 updates in a row .* step 14"):
        run_in_process(data, tmp_path, *args, "--max_steps", "20")

def test_spike_guard_skips_a_planted_spike_and_no_normal_step(data, tmp_path, monkeypatch):
    monkeypatch.setattr(DivergenceGuard, "SPIKE_WARMUP", 5)  # (20 in real runs: fewer steps keep the test short)
    plant(monkeypatch, data, [12], 10.0)
    records = run_in_process(data, tmp_path, "--max_steps", "16", "--skip_zscore", "5")
    assert list(skipped(records)) == [12]
    assert re.fullmatch(r"loss spike z=\d+\.\d", skipped(records)[12])


def test_spike_statistics_resume_exactly(data, tmp_path, monkeypatch):
    monkeypatch.setattr(DivergenceGuard, "SPIKE_WARMUP", 5)
    # A spike 3 steps after the resume: a guard that restarted its warm-up there would let it through.
    plant(monkeypatch, data, [12], 10.0)
    args = ["--max_steps", "16", "--skip_zscore", "5", "--snapshot_every", "10", "--keep_last", "3"]
    uninterrupted = run_in_process(data, tmp_path / "uninterrupted", *args)
    copy_run(tmp_path / "uninterrupted", tmp_path / "resumed", 9)
    resumed = run_in_process(data, tmp_path / "resumed", *args)

    assert list(skipped(uninterrupted)) == list(skipped(resumed)) == [12]
    assert losses(resumed) == {s: v for s, v in losses(uninterrupted).items() if s >= 10}
    final = [load_snapshot(snapshot_path(tmp_path / d, 15))["guard"] for d in ("uninterrupted", "resumed")]
    assert final[0] == final[1] and len(final[0]["losses"]) == 15


# ----------------------------------------------------------------------------------------------------------------
# runs that diverge in real processes (the exit status, torchrun)
#
# Where a huge learning rate first gives a non-finite step depends on the CPU's floating-point kernels (step 2 on one
# CPU, after the first snapshot on another), so the exact outcomes are tested with NaNs planted at chosen steps, and
# the real divergence only for what holds wherever it begins.

PLANTED_NAN_SCRIPT = Path(__file__).parent / "train_with_planted_nan.py"
REAL_PROCESS_JOB = [*JOB, "--snapshot_every", "5", "--keep_last", "2", "--max_steps", "30"]


def run_with_nan_planted(data: Path, log_dir: Path, data_steps: list[int], *args: str, nproc: int | None = None,
                         sigkill_at: list[int] = ()):
    """train_gpt2.py in a real process (under torchrun with nproc ranks), every micro-batch of the data of
    `data_steps` (as a run with JOB reads them uninterrupted) giving a NaN loss, and the process SIGKILLed as it
    reads the data of `sigkill_at`; see train_with_planted_nan.py."""
    keys = [list(key) for key in micro_batches_of(data, data_steps, every_micro_step=True)]
    kill_keys = [list(key) for key in micro_batches_of(data, sigkill_at)] if sigkill_at else []
    return run_train(["--data_dir", str(data), *REAL_PROCESS_JOB, *args], log_dir, nproc=nproc, check=False,
                     env={"PLANTED_NAN_BATCHES": json.dumps(keys), "SIGKILL_AT_BATCHES": json.dumps(kill_keys)},
                     script=PLANTED_NAN_SCRIPT)


def assert_every_snapshot_loads_and_is_finite(ckpt_dir: Path) -> list[Path]:
    found = list_snapshots(ckpt_dir)
    for path in found:
        state = load_snapshot(path)
        moments = (v for optimizer in state["optimizer"].values() for s in optimizer["state"].values()
                   for v in s.values())
        tensors = [*state["model"].values(), *moments]
        assert all(torch.isfinite(t).all() for t in tensors), f"{path} holds NaN or inf"
    return found


@pytest.mark.slow
def test_a_diverging_run_stops_with_the_newest_healthy_snapshot_and_keeps_it(data, tmp_path):
    # Data 7-16 bad: 10 skips in a row (--max_skips' default) end at step 16. Snapshots 9 and 14 are written while
    # skipping (unhealthy); with --keep_last 2 the healthy step-4 one must survive their pruning.
    run = run_with_nan_planted(data, tmp_path, list(range(7, 17)))
    assert run.proc.returncode == 2, run.output
    message = run.proc.stderr.strip().splitlines()[-1]
    healthy = str(snapshot_path(tmp_path, 4))
    assert message.startswith("error: training diverged: 10 updates in a row were skipped up to step 16 (the last "
                              "for non-finite loss; --max_skips 10)")
    assert f"The newest healthy snapshot is {healthy}: restart from it with --resume {healthy}" in message
    for advice in ("the data loader at", "a lower --max_lr (now 0.001)", "--skip_zscore", "--on_divergence rollback"):
        assert advice in message
    assert [p.name for p in assert_every_snapshot_loads_and_is_finite(tmp_path)] == [
        "snapshot_0000014.pt", "snapshot_0000009.pt", "snapshot_0000004.pt"]
    assert [load_snapshot(p)["healthy"] for p in list_snapshots(tmp_path)] == [False, False, True]
    assert run.records[-1] | {"data_position": None} == {
        "event": "diverged", "step": 16, "reason": "non-finite loss", "rollbacks": 0, "data_position": None,
        "healthy_snapshot": healthy}
    assert list(skipped(run.records)) == list(range(7, 17))


@pytest.mark.slow
def test_two_ranks_roll_back_together_then_stop_when_rollbacks_run_out(data, tmp_path):
    # Three runs of 4 bad batches (--max_skips 4). Data 6-9 at steps 6-9: rollback 1 to snapshot 4, step 5 then reads
    # data 10. Data 16-19 at steps 11-14: rollback 2 to snapshot 9, step 10 reads data 20. Data 26-29 at steps
    # 16-19: no rollback left, so both ranks stop at step 19, pointing at snapshot 14.
    run = run_with_nan_planted(data, tmp_path, [*range(6, 10), *range(16, 20), *range(26, 30)], "--max_skips", "4",
                               "--on_divergence", "rollback", "--max_rollbacks", "2", nproc=2)
    assert run.proc.returncode != 0, run.output
    errors = [line for line in run.output.splitlines() if line.startswith("error: training diverged")]
    assert len(errors) == 2 and errors[0] == errors[1]  # both ranks, the same step and message
    assert errors[0].startswith("error: training diverged: after 2 rollback(s) (--max_rollbacks 2), 4 updates in a "
                                "row were skipped up to step 19")
    assert f"The newest healthy snapshot is {snapshot_path(tmp_path, 14)}" in errors[0]
    rollbacks = [(r["step"], r["to_step"], r["rollbacks"]) for r in run.records if r.get("event") == "rollback"]
    assert rollbacks == [(9, 5, 1), (14, 10, 2)]
    assert assert_every_snapshot_loads_and_is_finite(tmp_path)


@pytest.mark.slow
def test_a_run_killed_two_steps_after_a_rollback_resumes_after_it_with_the_uninterrupted_losses(data, tmp_path):
    # Data 6-8 bad: a rollback at step 8 to snapshot_4, then steps 5, 6, 7 read data 9, 10, 11. The process is
    # SIGKILLed as step 7 reads data 11: two steps after the rollback, before the snapshot of step 9.
    args = ["--max_skips", "3", "--on_divergence", "rollback", "--max_steps", "12"]
    whole = run_with_nan_planted(data, tmp_path / "whole", [6, 7, 8], *args)
    assert whole.proc.returncode == 0, whole.output
    killed = run_with_nan_planted(data, tmp_path / "killed", [6, 7, 8], *args, sigkill_at=[11])
    assert killed.proc.returncode == -signal.SIGKILL, killed.output
    assert [(r["step"], r["to_step"]) for r in killed.records if r.get("event") == "rollback"] == [(8, 5)]
    assert killed.train[-1]["step"] == 6  # killed in step 7

    again = run_with_nan_planted(data, tmp_path / "killed", [6, 7, 8], *args)  # the same command, the same data
    assert again.proc.returncode == 0, again.output
    rerun = again.records[max(i for i, r in enumerate(again.records) if r.get("event") == "resume"):]
    assert rerun[0] == {"event": "resume", "step": 5, "snapshot": str(snapshot_path(tmp_path / "killed", 4))}
    assert not skipped(rerun) and not any(r.get("event") == "rollback" for r in rerun)
    rollback = next(i for i, r in enumerate(whole.records) if r.get("event") == "rollback")
    assert losses(rerun) == losses(whole.records[rollback + 1:])
    final = [load_snapshot(snapshot_path(tmp_path / run, 11))["guard"]["rollbacks"] for run in ("whole", "killed")]
    assert final == [1, 1]


@pytest.mark.slow
def test_a_real_divergence_ends_in_a_clean_stop_with_only_finite_snapshots(data, tmp_path):
    # A learning rate of 1000: where the first non-finite step falls depends on the CPU, so only what holds wherever
    # it is: exit 2 with the one-paragraph message, and no snapshot on disk holds NaN or inf.
    run = run_train(["--data_dir", str(data), *REAL_PROCESS_JOB, "--max_lr", "1000", "--warmup_steps", "100",
                     "--max_steps", "60"], tmp_path, check=False)
    assert run.proc.returncode == 2, run.output
    message = run.proc.stderr.strip().splitlines()[-1]
    assert message.startswith("error: training diverged: 10 updates in a row were skipped up to step ")
    assert "restart from it with --resume" in message or "There is no healthy snapshot" in message
    assert_every_snapshot_loads_and_is_finite(tmp_path)
    healthy = run.records[-1]["healthy_snapshot"]
    assert healthy is None or load_snapshot(healthy)["healthy"]

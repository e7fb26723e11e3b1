"""Fault tolerance end to end: a run that is stopped, killed, or moved to another number of ranks trains on as if
nothing had happened.

Every test compares against two uninterrupted runs of one 12-step job (1 rank, and 2 ranks under torchrun, gloo).
The job's two 300-token train shards hold 4 steps each, so the 12 steps cross shard boundaries and, at step 8,
an epoch boundary (with shuffling on): a resume has to get the data position exactly right, not just the weights.
torchrun launches cost 10-20 s each on 2 cores, so tests share the reference runs (and a 1-rank run that needs no
process of its own runs in this one)."""

import json
import os
import re
import shutil
import signal
import time
from functools import cached_property
from pathlib import Path

import pytest
import torch

from conftest import (
    copy_run,
    eio_the_first_time,
    fill_up,
    flip_a_byte_in_tensor_data,
    make_document_shards,
    make_shards,
    mounted_tmpfs,
)
from dataloader import MANIFEST, DistributedDataLoader
from helpers_train import (
    TrainRun,
    launched,
    main_in_process,
    read_metrics,
    records_so_far,
    run_train,
    wait_until,
    worker_pids,
)
from rundir.snapshot import SNAPSHOT_NAME, list_snapshots, load_snapshot, read_model, save_snapshot, snapshot_path
from training.errors import UserError

LAST_STEP = 11
JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--max_steps", str(LAST_STEP + 1),
       "--warmup_steps", "3", "--val_every", "4", "--val_tokens", "64", "--dtype", "fp32", "--resume", "auto"]

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers in /proc")


class Job:
    """The uninterrupted runs that the tests compare against: one process now (it keeps snapshots 3, 7 and 11), and
    2 torchrun ranks (snapshots 8 and 11) on first use, so that the tests without torchrun do not wait for it."""

    def __init__(self, root: Path):
        self.root, self.data = root, root / "data"
        # The bytes tokenizer's 257 ids, not GPT-2's 50,257: the output layer is then no longer most of each step.
        make_shards(self.data, "train", [300, 300], seed=0, vocab=257, tokenizer="bytes")
        # (1M tokens for the long validation: the others read 64)
        make_shards(self.data, "val", [1_000_001], seed=1, vocab=257, tokenizer="bytes")
        self.args = [*JOB, "--data_dir", str(self.data)]
        self.one_rank = root / "one_rank"
        # (in this process: no interpreter to start)
        main_in_process([*self.args, "--snapshot_every", "4", "--keep_last", "3", "--log_dir", str(self.one_rank)])
        self.one_rank_run = TrainRun(None, read_metrics(self.one_rank))

    @cached_property
    def two_ranks_run(self) -> TrainRun:
        return run_train([*self.args, "--snapshot_every", "3", "--keep_last", "2"], self.root / "two_ranks", nproc=2)

    @property
    def two_ranks(self) -> Path:
        self.two_ranks_run  # noqa: B018 (run it on first use)
        return self.root / "two_ranks"


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Job:
    return Job(tmp_path_factory.mktemp("job"))


def by_step(records: list[dict], key: str) -> dict[int, float]:
    """{step: value}; a step logged twice (replayed after a restart) keeps its later line."""
    return {r["step"]: r[key] for r in records if key in r}


def max_rel_diff(got: dict[int, float], expected: dict[int, float], steps) -> float:
    steps = list(steps)
    assert set(steps) <= set(got), f"steps {sorted(set(steps) - set(got))} were not logged"
    return max(abs(got[s] - expected[s]) / abs(expected[s]) for s in steps)


def assert_continues_exactly(records: list[dict], reference: TrainRun, from_step: int, tol: float) -> None:
    """Train and val losses logged from from_step on equal the uninterrupted run's, within a relative tol."""
    train_steps, val_steps = range(from_step, LAST_STEP + 1), [s for s in (4, 8, 11) if s >= from_step]
    train = max_rel_diff(by_step(records, "loss"), by_step(reference.records, "loss"), train_steps)
    val = max_rel_diff(by_step(records, "val_loss"), by_step(reference.records, "val_loss"), val_steps)
    print(f"steps {from_step}..{LAST_STEP}: max relative difference, train loss {train:.2e}, val loss {val:.2e}")
    assert train <= tol and val <= tol


def after_resume(records: list[dict]) -> tuple[dict, list[dict]]:
    """The last resume event and the records logged after it."""
    i = max(i for i, r in enumerate(records) if r.get("event") == "resume")
    return records[i], records[i + 1:]


# ----------------------------------------------------------------------------------------------------------------
# runs in the background, for tests that interrupt them

def newest_snapshot_step(log_dir: Path) -> int:
    snapshots = list_snapshots(log_dir)
    return int(SNAPSHOT_NAME.fullmatch(snapshots[0].name).group(1)) if snapshots else -1


# ----------------------------------------------------------------------------------------------------------------
# the tests

@pytest.mark.slow  # over 3 s: keeps `-m 'not slow'` under 90 s
def test_one_rank_resume_after_a_crash_continues_exactly(job, tmp_path):
    # The state a crash after step 5 leaves: the snapshot of step 3, and metrics up to step 5.
    copy_run(job.one_rank, tmp_path, 3)
    lines = (job.one_rank / "metrics.jsonl").read_text().splitlines(keepends=True)
    crashed = [line for line in lines if json.loads(line).get("step", 0) <= 5]
    (tmp_path / "metrics.jsonl").write_text("".join(crashed))

    main_in_process([*job.args, "--log_dir", str(tmp_path)])

    records = read_metrics(tmp_path)
    assert records[:len(crashed)] == [json.loads(line) for line in crashed]  # appended to, not overwritten
    event, after = after_resume(records)
    assert event == {"event": "resume", "step": 4, "snapshot": str(snapshot_path(tmp_path, 3))}
    assert min(by_step(after, "loss")) == 4
    assert_continues_exactly(after, job.one_rank_run, from_step=4, tol=1e-6)


@needs_proc
@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_after_the_same_step_and_resumes_exactly(job, tmp_path):
    args = [*job.args, "--snapshot_every", "100"]  # so the only snapshot is the one SIGTERM asks for
    with launched(args, tmp_path, nproc=2) as proc:
        wait_until(lambda: by_step(records_so_far(tmp_path), "loss").keys() >= {2}, proc, tmp_path, "step 2")
        os.kill(worker_pids(proc)[1], signal.SIGTERM)  # rank 1: rank 0, the writer, learns of it only by agreeing
        assert proc.wait(timeout=120) == 0, (tmp_path / "output.txt").read_text()[-4000:]
    stopped = max(by_step(read_metrics(tmp_path), "loss"))
    assert 2 <= stopped < LAST_STEP
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, stopped)]
    assert f"stopping after step {stopped} on SIGTERM" in (tmp_path / "output.txt").read_text()

    run = run_train(job.args, tmp_path, nproc=2)

    event, after = after_resume(run.records)
    assert event == {"event": "resume", "step": stopped + 1, "snapshot": str(snapshot_path(tmp_path, stopped))}
    assert_continues_exactly(after, job.two_ranks_run, from_step=stopped + 1, tol=1e-6)


@needs_proc
@pytest.mark.slow
def test_killed_ranks_are_restarted_by_torchrun_and_finish_exactly(job, tmp_path):
    """SIGKILL a worker three times in one run; each time torchrun restarts both ranks from the newest snapshot.

    Restarted workers meet in the launcher's TCPStore, where the dead round's addresses still are; this repeats
    the restart to show setup_distributed()'s per-restart prefix makes every round meet only its own peers."""
    resumes, restart_seconds = [], []
    with launched([*job.args, "--snapshot_every", "2"], tmp_path, nproc=2,
                  launcher_args=["--max-restarts", "3"]) as proc:
        resume_step = 2  # first kill after the snapshot of step 3
        for kill, rank in enumerate((1, 0, 1)):
            # Kill once this round has written a snapshot of its own, so the restart resumes from a new one.
            wait_until(lambda since=resume_step: newest_snapshot_step(tmp_path) > since, proc, tmp_path,
                       f"kill {kill + 1}")
            os.kill(worker_pids(proc)[rank], signal.SIGKILL)
            killed_at = time.monotonic()
            wait_until(lambda kills=kill: sum(r.get("event") == "resume" for r in records_so_far(tmp_path)) > kills,
                       proc, tmp_path, f"the restart after kill {kill + 1}")
            restart_seconds.append(time.monotonic() - killed_at)
            resume_step = after_resume(records_so_far(tmp_path))[0]["step"]
            resumes.append(resume_step)
        assert proc.wait(timeout=120) == 0, (tmp_path / "output.txt").read_text()[-4000:]
    print(f"resumed at steps {resumes}; kill to resume: {', '.join(f'{s:.1f}' for s in restart_seconds)} s")
    assert resumes == sorted(set(resumes)) and resumes[-1] < LAST_STEP
    assert_continues_exactly(read_metrics(tmp_path), job.two_ranks_run, from_step=0, tol=1e-6)


@pytest.mark.slow
def test_two_rank_snapshot_resumes_exactly_on_one_rank(job, tmp_path):
    # Same B·T and total batch: 1 rank accumulates 2 micro-steps where 2 ranks took 1 each, on the same tokens.
    ckpt_dir = tmp_path / "snapshots"
    main_in_process([*job.args, "--resume", str(snapshot_path(job.two_ranks, 8)), "--snapshot_dir", str(ckpt_dir),
                     "--log_dir", str(tmp_path / "logs")])
    records = read_metrics(tmp_path / "logs")
    assert after_resume(records)[0]["step"] == 9
    assert_continues_exactly(records, job.two_ranks_run, from_step=9, tol=1e-4)
    assert list_snapshots(ckpt_dir) == [snapshot_path(ckpt_dir, 11)] and not list_snapshots(tmp_path / "logs")


@pytest.mark.slow
def test_snapshots_hold_the_whole_training_state(job):
    assert list_snapshots(job.one_rank) == [snapshot_path(job.one_rank, s) for s in (11, 7, 3)]  # --keep_last 3
    assert list_snapshots(job.two_ranks) == [snapshot_path(job.two_ranks, s) for s in (11, 8)]  # --keep_last 2
    state = load_snapshot(snapshot_path(job.two_ranks, 8))
    assert state["step"] == 8 and state["config"]["max_steps"] == LAST_STEP + 1
    assert len(state["rng"]) == 2  # one per rank
    assert state["loader"]["chunks_per_step"] == 2 and state["loader"]["chunk_tokens"] == 32
    assert state["wandb_id"] == load_snapshot(snapshot_path(job.two_ranks, 11))["wandb_id"]
    assert not [k for k in state["model"] if k.startswith(("module.", "_orig_mod."))]  # saved unwrapped


def test_snapshot_loads_into_a_plain_gpt_that_reproduces_the_logged_val_loss(job):
    # Validation at step 8 runs before step 8's update, on the weights the snapshot of step 7 holds.
    model = read_model(snapshot_path(job.one_rank, 7)).eval()
    val = DistributedDataLoader(job.data, "val", B=2, T=16)
    with torch.no_grad():
        loss = sum(model(*val.next_batch())[1] for _ in range(2)) / 2  # --val_tokens 64 = 2 micro-batches of 32
    logged = by_step(job.one_rank_run.records, "val_loss")[8]
    assert loss.item() == pytest.approx(logged, rel=1e-6)


# Runs that stop before training, or train a single step, run in this process: no interpreter to start.

def test_auto_resume_of_a_finished_run_trains_nothing(job, capsys):
    before = (job.one_rank / "metrics.jsonl").read_text()
    main_in_process([*job.args, "--log_dir", str(job.one_rank)])
    assert "already finished, nothing to do" in capsys.readouterr().out
    assert (job.one_rank / "metrics.jsonl").read_text() == before


def test_resume_never_starts_fresh(job, tmp_path):
    shutil.copy(snapshot_path(job.one_rank, 7), tmp_path)
    main_in_process([*job.args, "--log_dir", str(tmp_path), "--resume", "never", "--max_steps", "1"])
    records = read_metrics(tmp_path)
    assert [r["event"] for r in records if "event" in r] == ["timeline"]  # a new one: not resumed
    assert by_step(records, "loss")[0] == pytest.approx(by_step(job.one_rank_run.records, "loss")[0], rel=1e-6)
    assert snapshot_path(tmp_path, 0).exists()  # the last step writes a snapshot even off the --snapshot_every beat


def test_resume_from_a_missing_file_is_a_clear_error(job, tmp_path):
    with pytest.raises(UserError, match="--resume .*nope.pt: no such file"):
        main_in_process([*job.args, "--log_dir", str(tmp_path), "--resume", str(tmp_path / "nope.pt")])


@pytest.mark.parametrize("change, message", [
    (["--micro_batch_size", "1", "--total_batch_size", "32"], "chunk_tokens=32, this run has chunk_tokens=16"),
    (["--total_batch_size", "128"], "chunks_per_step=2, this run has chunks_per_step=4"),
    (["--n_layer", "3"], "n_layer.*Resume it with the flags of the run that wrote it \\(--arch/--model"),
    (["--arch", "modern"], "'arch': 'gpt2'.*'arch': 'modern'.*Resume it with the flags of the run that wrote it"),
    # The same B·T = 32 tokens a micro-batch and the same total batch, in sequences of 8.
    (["--seq_len", "8", "--micro_batch_size", "4"], "--seq_len 16, and this run into sequences of --seq_len 8"),
])
def test_resume_with_a_different_batch_or_model_is_a_clear_error(job, tmp_path, change, message):
    with pytest.raises(UserError, match=message):
        main_in_process([*job.args, "--log_dir", str(tmp_path), "--resume", str(snapshot_path(job.one_rank, 7)),
                         *change])


def test_resume_on_other_data_is_a_clear_error_and_on_a_copy_of_the_data_continues_exactly(job, tmp_path):
    other, moved = tmp_path / "other", tmp_path / "moved"
    make_shards(other, "train", [300, 300], seed=5, vocab=257, tokenizer="bytes")  # as many, as large, other tokens
    for name in ("test_val_000000.bin", MANIFEST):  # the same val shard, and a manifest that lists it
        shutil.copy(job.data / name, other)
    copy_run(job.one_rank, tmp_path, 7)
    with pytest.raises(UserError) as raised:
        main_in_process([*job.args, "--log_dir", str(tmp_path), "--data_dir", str(other)])
    assert f"--data_dir {job.data}" in str(raised.value) and f"--data_dir {other}" in str(raised.value)
    shutil.copytree(job.data, moved)
    main_in_process([*job.args, "--log_dir", str(tmp_path), "--data_dir", str(moved)])
    assert_continues_exactly(read_metrics(tmp_path), job.one_rank_run, from_step=8, tol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# fp16: the GradScaler's loss scale is saved and restored, and snapshots move between dtypes

def scale_in(path: Path) -> float | None:
    return load_snapshot(path)["scaler"].get("scale")


@pytest.mark.slow  # over 3 s: keeps `-m 'not slow'` under 90 s
def test_an_fp16_run_saves_its_loss_scale_and_a_resume_carries_it_on(job, tmp_path):
    fp16 = ["--dtype", "fp16", "--max_steps", "4", "--snapshot_every", "2", "--val_every", "0"]
    main_in_process([*job.args, *fp16, "--log_dir", str(tmp_path / "whole")])
    whole = read_metrics(tmp_path / "whole")
    assert scale_in(snapshot_path(tmp_path / "whole", 1)) == 2.0**16  # GradScaler's initial scale: it was on

    # A resume continues the fp16 run exactly...
    copy_run(tmp_path / "whole", tmp_path, 1)
    main_in_process([*job.args, *fp16, "--log_dir", str(tmp_path)])
    assert by_step(read_metrics(tmp_path), "loss") == {s: by_step(whole, "loss")[s] for s in (2, 3)}
    # ...with the scale the snapshot holds: one that a fresh GradScaler would not have (it grows only every 2000
    # steps, so it is still the same two steps later).
    state = load_snapshot(snapshot_path(tmp_path / "whole", 1))
    state["scaler"]["scale"] = 1024.0
    save_snapshot(state, snapshot_path(tmp_path / "scaled", 1))
    main_in_process([*job.args, *fp16, "--log_dir", str(tmp_path / "scaled"), "--resume",
                     str(snapshot_path(tmp_path / "scaled", 1))])
    assert scale_in(snapshot_path(tmp_path / "scaled", 3)) == 1024.0


@pytest.mark.slow  # a few seconds: keeps `-m 'not slow'` under 90 s
@pytest.mark.parametrize("written, resumed", [("fp32", "fp16"), ("bf16", "fp16"), ("fp16", "bf16")])
def test_a_snapshot_resumes_in_another_dtype(job, tmp_path, capsys, written, resumed):
    """An A100's bf16 run continued on a V100 in fp16, and back: the loss scale starts fresh or is dropped."""
    steps = ["--max_steps", "4", "--snapshot_every", "2", "--val_every", "0"]
    main_in_process([*job.args, *steps, "--dtype", written, "--log_dir", str(tmp_path / "first"), "--max_steps", "2"])
    copy_run(tmp_path / "first", tmp_path, 1)
    main_in_process([*job.args, *steps, "--dtype", resumed, "--log_dir", str(tmp_path)])
    losses = by_step(read_metrics(tmp_path), "loss")
    assert sorted(losses) == [2, 3] and all(4.5 < loss < 7 for loss in losses.values())  # ln 257 = 5.55
    if resumed == "fp16":
        assert "has no GradScaler state: the fp16 loss scale starts fresh" in capsys.readouterr().out
        assert scale_in(snapshot_path(tmp_path, 3)) == 2.0**16
    else:
        assert load_snapshot(snapshot_path(tmp_path, 3))["scaler"] == {}


# ----------------------------------------------------------------------------------------------------------------
# SIGTERM during a long evaluation: the snapshot is on disk within a step

@needs_proc
@pytest.mark.slow
def test_sigterm_during_a_long_validation_snapshots_at_once_and_resumes(job, tmp_path):
    # Resume the 1-rank run's snapshot of step 3 on 2 ranks, validating every 3 steps for ~forever: steps 4 and 5
    # train, then step 6's validation would run for many minutes.
    long_eval = [*job.args, "--resume", str(snapshot_path(job.one_rank, 3)), "--val_every", "3", "--val_tokens",
                 "1000000", "--snapshot_every", "100"]
    with launched(long_eval, tmp_path, nproc=2) as proc:
        wait_until(lambda: by_step(records_so_far(tmp_path), "loss").keys() >= {5}, proc, tmp_path, "step 5")
        time.sleep(1.0)  # well into the validation
        os.kill(worker_pids(proc)[1], signal.SIGTERM)  # rank 1: rank 0 learns of it by agreeing, mid-validation
        signalled = time.monotonic()
        assert proc.wait(timeout=60) == 0, (tmp_path / "output.txt").read_text()[-4000:]
        seconds = time.monotonic() - signalled
    output = (tmp_path / "output.txt").read_text()
    print(f"SIGTERM to exit: {seconds:.1f} s")
    assert list_snapshots(tmp_path) == [snapshot_path(tmp_path, 5)]
    assert "stopping during the evaluation before step 6 on SIGTERM" in output
    assert not by_step(read_metrics(tmp_path), "val_loss")  # the cut-short validation logs nothing

    run = run_train([*job.args, "--val_every", "4"], tmp_path, nproc=2)
    event, after = after_resume(run.records)
    assert event["step"] == 6
    assert_continues_exactly(after, job.two_ranks_run, from_step=6, tol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# faults: a stopped rank, a full disk, a failing write, a flipped byte

@needs_proc
@pytest.mark.slow
def test_a_stopped_rank_times_out_the_others_and_the_restarted_job_has_the_uninterrupted_losses(job, tmp_path):
    """SIGSTOP (as a stuck filesystem or a swapped-out process): rank 0 gives up after --dist_timeout naming the
    step, torchrun SIGKILLs the stopped rank (after its 30 s SIGTERM grace) and restarts both from the snapshot."""
    args = [*job.args, "--snapshot_every", "2", "--dist_timeout", "5"]
    with launched(args, tmp_path, nproc=2, launcher_args=["--max-restarts", "1"]) as proc:
        wait_until(lambda: by_step(records_so_far(tmp_path), "loss").keys() >= {4}, proc, tmp_path, "step 4")
        os.kill(worker_pids(proc)[1], signal.SIGSTOP)
        assert proc.wait(timeout=150) == 0, (tmp_path / "output.txt").read_text()[-4000:]
    output = (tmp_path / "output.txt").read_text()
    assert re.search(r"error: rank 0 waited 5 s at step \d+ for the other ranks in a collective in \w+ "
                     r"\(\w+\.py:\d+: `.+`\) and gave up \(.*Timed out", output), output[-4000:]
    event, _ = after_resume(read_metrics(tmp_path))
    assert 4 <= event["step"] <= 6  # the snapshot of step 3 or 5
    assert_continues_exactly(read_metrics(tmp_path), job.two_ranks_run, from_step=0, tol=1e-6)


def small_tmpfs(directory: Path, megabytes: int):
    """A real filesystem of the given size at directory, to fill up (skips where mounting is not allowed)."""
    return mounted_tmpfs(directory, f"size={megabytes}m")


@pytest.mark.slow  # a few seconds: keeps `-m 'not slow'` under 90 s
def test_a_full_snapshot_disk_keeps_the_older_snapshots_and_only_a_lost_last_one_fails_the_run(job, tmp_path,
                                                                                               capsys):
    # Room for 1.5 snapshots: step 3's fits, step 7's does not (a warning; training goes on), nor the last, step 11's.
    ckpt_dir = tmp_path / "small_disk"
    args = [*job.args, "--log_dir", str(tmp_path), "--snapshot_every", "4", "--keep_last", "2"]
    with small_tmpfs(ckpt_dir, int(1.5 * snapshot_path(job.one_rank, 3).stat().st_size / 2**20)):
        with pytest.raises(UserError, match=r"the snapshot of step 11 could not be written to .*small_disk "
                                            r"\(OSError: \[Errno 28\] No space left on device; \d+ MiB free of \d+ "
                                            r"MiB\), and it was the run's last; the older snapshots are intact, "
                                            r"the newest is .*snapshot_0000003.pt"):
            main_in_process([*args, "--snapshot_dir", str(ckpt_dir)])
        warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("WARNING")]
        assert len(warnings) == 1 and "the snapshot of step 7 could not be written" in warnings[0]
        assert by_step(read_metrics(tmp_path), "loss").keys() == set(range(LAST_STEP + 1))  # every step trained
        assert sorted(p.name for p in ckpt_dir.iterdir()) == ["run.json", "run.lock", "snapshot_0000003.json",
                                                              "snapshot_0000003.pt"]  # no temp file
        copy_run(ckpt_dir, tmp_path, 3)
    # Rerun where there is room: it resumes after step 3 and finishes as if nothing had happened.
    main_in_process(args)
    event, after = after_resume(read_metrics(tmp_path))
    assert event["step"] == 4
    assert_continues_exactly(after, job.one_rank_run, from_step=4, tol=1e-6)


def test_a_failing_snapshot_write_is_retried_at_the_next_one_and_the_run_finishes(job, tmp_path, monkeypatch,
                                                                                  capsys):
    writes = eio_the_first_time(monkeypatch)
    main_in_process([*job.args, "--log_dir", str(tmp_path), "--snapshot_every", "4", "--keep_last", "3"])
    assert writes == [3, 7, 11]
    assert "WARNING: the snapshot of step 3 could not be written" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob("snapshot_*.pt*")) == ["snapshot_0000007.pt", "snapshot_0000011.pt"]
    assert_continues_exactly(read_metrics(tmp_path), job.one_rank_run, from_step=0, tol=1e-6)


@pytest.mark.slow  # a few seconds: keeps `-m 'not slow'` under 90 s
def test_a_full_log_disk_warns_once_and_training_goes_on(job, tmp_path, capsys):
    log_dir = tmp_path / "small_disk"
    with small_tmpfs(log_dir, 1):
        fill_up(log_dir)  # but two pages: one for run.lock's holder line, one for ~20 lines of metrics.jsonl
        os.truncate(log_dir / "ballast", (log_dir / "ballast").stat().st_size - 2 * 4096)
        main_in_process([*job.args, "--log_dir", str(log_dir), "--snapshot_dir", str(tmp_path), "--max_steps", "40",
                         "--val_every", "0"])
        records = read_metrics(log_dir)  # whole lines only: json.loads would fail on a cut-off one
        warnings = [line for line in capsys.readouterr().err.splitlines() if "could not write" in line]
    assert len(warnings) == 1 and "metrics.jsonl (OSError: [Errno 28] No space left on device" in warnings[0]
    # The lines from before the disk filled up, whole and in order; a later, shorter line may still fit in the last
    # few bytes (each line is tried again), so lines may be missing after the first failure but none is repeated.
    steps = [r["step"] for r in records if "loss" in r]
    assert 5 < len(steps) < 40 and steps[:6] == list(range(6)) and steps == sorted(set(steps))
    assert load_snapshot(snapshot_path(tmp_path, 39))["step"] == 39  # the run went on to the end


def test_a_flipped_byte_in_the_newest_snapshot_resumes_the_older_one_with_a_warning(job, tmp_path, capsys):
    for step in (3, 7):
        copy_run(job.one_rank, tmp_path, step)
    record = flip_a_byte_in_tensor_data(snapshot_path(tmp_path, 7))
    main_in_process([*job.args, "--log_dir", str(tmp_path)])
    assert f"{snapshot_path(tmp_path, 7)}: the bytes of its record {record} changed" in capsys.readouterr().err
    event, after = after_resume(read_metrics(tmp_path))
    assert event == {"event": "resume", "step": 4, "snapshot": str(snapshot_path(tmp_path, 3))}
    assert_continues_exactly(after, job.one_rank_run, from_step=4, tol=1e-6)


def test_resume_from_a_named_snapshot_whose_bytes_changed_is_refused_naming_it(job, tmp_path):
    shutil.copy(snapshot_path(job.one_rank, 7), tmp_path)
    record = flip_a_byte_in_tensor_data(snapshot_path(tmp_path, 7))
    with pytest.raises(UserError, match=re.escape(f"--resume: {snapshot_path(tmp_path, 7)}: the bytes of its record "
                                                  f"{record} changed since it was written")):
        main_in_process([*job.args, "--log_dir", str(tmp_path / "run"), "--resume", str(snapshot_path(tmp_path, 7))])
    assert not by_step(read_metrics(tmp_path / "run"), "loss")  # nothing trained from it


@pytest.mark.slow  # two runs in this process: about 3 s
def test_align_bos_run_resumes_exactly_from_a_mid_epoch_snapshot(tmp_path):
    make_document_shards(tmp_path / "data", "train", 17, [1000, 800])  # about 13 and 11 steps of rows of 17 tokens
    make_shards(tmp_path / "data", "val", [200], seed=1)
    args = [*JOB, "--data_dir", str(tmp_path / "data"), "--align_bos", "--snapshot_every", "4"]
    main_in_process([*args, "--log_dir", str(tmp_path / "whole")])
    state = load_snapshot(snapshot_path(tmp_path / "whole", 7))
    loader = state["loader"]  # mid-shard: 8 steps of 2 chunks
    assert loader["align_bos"] == 1 and [loader[k] for k in ("epoch", "shard_position", "chunk_position")] == [0, 0, 16]
    main_in_process([*args, "--log_dir", str(tmp_path / "resumed"), "--resume",
                     str(snapshot_path(tmp_path / "whole", 7))])
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "resumed")
    assert after_resume(resumed)[0]["step"] == 8
    assert list(by_step(resumed, "loss")) == [8, 9, 10, 11]
    assert by_step(resumed, "loss") == {s: loss for s, loss in by_step(whole, "loss").items() if s >= 8}


@pytest.mark.slow  # two runs in this process: about 3 s
def test_a_run_resumes_exactly_in_the_middle_of_its_momentum_warmup_and_short_rows(tmp_path, cpu_bf16):
    make_shards(tmp_path / "data", "train", [300, 300], seed=0, vocab=257, tokenizer="bytes")
    make_shards(tmp_path / "data", "val", [200], seed=1, vocab=257, tokenizer="bytes")
    args = [*JOB, "--data_dir", str(tmp_path / "data"), "--optimizer", "muon", "--muon_momentum_warmup", "10",
            "--short_rows", "4:5,8:9", "--adam_beta1", "0.8", "--snapshot_every", "4"]
    main_in_process([*args, "--log_dir", str(tmp_path / "whole")])
    state = load_snapshot(snapshot_path(tmp_path / "whole", 7))
    assert state["optimizer"]["muon"]["param_groups"][0]["momentum"] == pytest.approx(0.92)  # step 7's, of 0.85-0.95
    main_in_process([*args, "--log_dir", str(tmp_path / "resumed"), "--resume",
                     str(snapshot_path(tmp_path / "whole", 7))])
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "resumed")
    resume, after = after_resume(resumed)
    assert resume["step"] == 8 and "optimizer_settings" not in resume  # (the warmup's momentum is no change of flag)
    assert by_step(after, "loss") == {s: loss for s, loss in by_step(whole, "loss").items() if s >= 8}
    # The flags took effect: the same job without them has other losses from the first step.
    main_in_process([*JOB, "--data_dir", str(tmp_path / "data"), "--optimizer", "muon", "--snapshot_every", "4",
                     "--log_dir", str(tmp_path / "plain")])
    plain = by_step(read_metrics(tmp_path / "plain"), "loss")
    assert all(loss != by_step(whole, "loss")[s] for s, loss in plain.items())

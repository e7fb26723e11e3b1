"""Whole training runs on a GPU (train_gpt2.py as a subprocess, metrics.jsonl read back), each against an
independent reference: a torchrun run and a --parallel fsdp run against the plain run, a resumed run against the
uninterrupted one, --deterministic against itself; fp16 keeps a finite loss scale, --micro_batch_size auto picks a
size that trains, and HellaSwag and sampling run inside a compiled run.

Run by gpu_check.py's tests stage on a CUDA GPU (the `small` preset, T=256); skipped without CUDA, except under
GPU_TESTS_DEVICE=cpu (gpu_check.py --cpu-smoke), where the same runs take the tiny preset on the CPU.
"""

import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_shards
from gpu_check import SAMPLE_PROMPT, printed_samples
from helpers_train import TrainRun, run_train
from snapshot import find_latest_snapshot, snapshot_path

pytestmark = pytest.mark.gpu

HELLASWAG_ENV = "GPU_TESTS_HELLASWAG"  # a local hellaswag_val.jsonl (gpu_check.py --hellaswag_path sets it)
LAST_STEP = 7


def size_args(device: torch.device) -> list[str]:
    """8 steps of 2 micro-steps each (accumulation is part of what is checked), on a model the device trains fast."""
    if device.type == "cuda":
        return ["--device", "cuda", "--model", "small", "--seq_len", "256", "--micro_batch_size", "8",
                "--total_batch_size", "4096"]
    return ["--device", "cpu", "--model", "tiny", "--seq_len", "16", "--micro_batch_size", "2",
            "--total_batch_size", "64"]


def by_step(records: list[dict], key: str) -> dict[int, float]:
    """{step: value}; a step logged twice (replayed after a resume) keeps its later line."""
    return {r["step"]: r[key] for r in records if key in r}


def max_rel_diff(run: TrainRun, reference: TrainRun, key: str, steps) -> float:
    got, want = by_step(run.records, key), by_step(reference.records, key)
    assert set(steps) <= set(got) and set(steps) <= set(want), f"{key}: steps missing"
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)


class Job:
    """One 8-step job in fp32 (TF32 matmuls on a GPU, as train_gpt2.py sets) on tokens from a vocabulary of 100, so
    the loss falls fast and a wrong step shows; its plain run, with snapshots after steps 3 and 7, is the reference."""

    def __init__(self, root: Path, device: torch.device):
        self.root, self.device, self.data = root, device, root / "data"
        make_shards(self.data, "train", [40_000], vocab=100)
        make_shards(self.data, "val", [10_000], seed=1, vocab=100)
        self.args = [*size_args(device), "--data_dir", str(self.data), "--max_steps", str(LAST_STEP + 1),
                     "--warmup_steps", "2", "--max_lr", "3e-3", "--dtype", "fp32", "--val_every", "4",
                     "--val_steps", "2"]
        self.plain = run_train([*self.args, "--ckpt_every", "4", "--keep_last", "2"], root / "plain")
        # Runs on a GPU add in another order from run to run (atomic adds, split-K): equal within this, not bitwise.
        self.tolerance = 1e-3 if device.type == "cuda" else 1e-5

    def assert_trains_like_plain(self, run: TrainRun, steps=range(LAST_STEP + 1)) -> None:
        loss, norm = max_rel_diff(run, self.plain, "loss", steps), max_rel_diff(run, self.plain, "grad_norm", steps)
        print(f"max relative difference to the plain run: loss {loss:.2e}, gradient norm {norm:.2e}")
        assert loss <= self.tolerance and norm <= 10 * self.tolerance  # a norm sums many more roundings


@pytest.fixture(scope="module")
def job(tmp_path_factory, gpu_device) -> Job:
    job = Job(tmp_path_factory.mktemp("gpu_job"), gpu_device)
    losses = by_step(job.plain.records, "loss")
    assert sorted(losses) == list(range(LAST_STEP + 1)) and losses[LAST_STEP] < losses[0] - 0.5
    return job


def test_a_torchrun_run_trains_like_the_plain_run(job, tmp_path):
    """torchrun with one rank per GPU, up to two: with two, NCCL DDP end to end; with one GPU torchrun's launch
    (its environment, the cuda:LOCAL_RANK device) and no process group (test_gpu_kernels.py checks DDP over NCCL)."""
    nproc = max(1, min(torch.cuda.device_count(), 2))
    run = run_train([*job.args, "--ckpt_every", "0"], tmp_path, nproc=nproc)
    assert f"× {nproc} ranks" in run.output
    job.assert_trains_like_plain(run)


def test_a_one_gpu_fsdp_run_trains_like_the_plain_ddp_run(job, tmp_path):
    # One process with --parallel fsdp: a process group of one (NCCL on a GPU), every block sharded with
    # fully_shard, gradients reduce-scattered, the norm over the shards' DTensors.
    run = run_train([*job.args, "--parallel", "fsdp", "--ckpt_every", "0"], tmp_path)
    job.assert_trains_like_plain(run)


def test_deterministic_runs_repeat_their_losses_bit_for_bit(job, tmp_path):
    dtype = "bf16" if job.device.type == "cuda" else "fp32"  # bf16: flash attention's backward is in the step
    args = [*job.args, "--dtype", dtype, "--deterministic", "--ckpt_every", "0"]
    first, second = run_train(args, tmp_path / "first"), run_train(args, tmp_path / "second")
    print(f"{dtype} --deterministic, twice: losses {[r['loss'] for r in first.train]}")
    for key in ("loss", "grad_norm", "val_loss"):
        assert by_step(first.records, key) == by_step(second.records, key), key


def test_a_resumed_run_continues_with_the_uninterrupted_losses(job, tmp_path):
    # A crash after step 5 leaves the snapshot of step 3: the rerun takes it and repeats steps 4..7.
    shutil.copy(snapshot_path(job.root / "plain", 3), tmp_path)
    run = run_train([*job.args, "--ckpt_every", "4", "--keep_last", "2"], tmp_path)
    assert "resuming from" in run.output and min(by_step(run.records, "loss")) == 4
    job.assert_trains_like_plain(run, steps=range(4, LAST_STEP + 1))
    assert max_rel_diff(run, job.plain, "val_loss", [4, LAST_STEP]) <= job.tolerance


def test_fp16_trains_with_a_finite_loss_scale_saved_in_the_snapshot(job, tmp_path):
    run = run_train([*job.args, "--dtype", "fp16", "--ckpt_every", "100"], tmp_path)
    losses = by_step(run.records, "loss")
    skipped = [r["step"] for r in run.train if r.get("skipped")]
    print(f"fp16: loss {losses[0]:.4f} -> {losses[LAST_STEP]:.4f}, skipped steps {skipped}")
    # A skipped step's non-finite loss is logged as null.
    assert all(loss is not None and math.isfinite(loss) for loss in losses.values())
    assert losses[LAST_STEP] < losses[0] - 0.5
    assert len(skipped) <= 2  # the GradScaler may lower its first scale of 65,536 once or twice, no more
    _, state = find_latest_snapshot(tmp_path)  # the last step's
    scale = state["scaler"]["scale"]
    print(f"saved loss scale {scale}")
    assert math.isfinite(scale) and scale >= 1.0


def test_micro_batch_size_auto_picks_a_size_that_trains_without_running_out_of_memory(gpu_device, tmp_path):
    # GPU: GPT-2 124M at T=1024 and the recipe's 524,288-token batch, so the choice is the real one; CPU: tiny.
    cuda = gpu_device.type == "cuda"
    seq_len, model, total = (1024, "gpt2", 524_288) if cuda else (32, "tiny", 512)
    make_shards(tmp_path / "data", "train", [2 * total + 1], vocab=100)
    args = ["--device", gpu_device.type, "--model", model, "--seq_len", str(seq_len), "--micro_batch_size", "auto",
            "--total_batch_size", str(total), "--max_steps", "2", "--val_every", "0",
            "--ckpt_every", "0", "--data_dir", str(tmp_path / "data"), "--dtype", "bf16" if cuda else "fp32"]
    run = run_train(args, tmp_path / "logs")
    chosen = re.search(r"--micro_batch_size auto: micro-batch (\d+)", run.output)
    assert chosen, run.output[-2000:]
    print(chosen.group(0))
    assert int(chosen.group(1)) >= (16 if cuda else 1)  # an H100/A100 fits 64 or more sequences of 124M
    assert [r["step"] for r in run.train] == [0, 1] and all(r["loss"] is not None for r in run.train)


@pytest.fixture(scope="module")
def evaluated_run(job, gpu_compile, tmp_path_factory) -> TrainRun:
    """A compiled run (eager on the CPU, unless GPU_TESTS_COMPILE=1) that validates, samples and (given a local
    HellaSwag file) scores HellaSwag between its steps: the uncompiled module inside a compiled run."""
    try:
        import tiktoken
        tiktoken.get_encoding("gpt2")
    except Exception as e:  # no cache and no network: tiktoken's errors vary
        pytest.skip(f"the GPT-2 tokenizer is not available offline ({type(e).__name__}); set TIKTOKEN_CACHE_DIR")
    hellaswag = os.environ.get(HELLASWAG_ENV)
    hellaswag_args = ["--hellaswag_every", "2", "--hellaswag_limit", "40", "--hellaswag_path", hellaswag] \
        if hellaswag else []
    args = [*job.args, "--max_steps", "3", "--val_every", "2", "--sample_every", "2", "--ckpt_every", "0",
            "--dtype", "bf16" if job.device.type == "cuda" else "fp32", *(["--compile"] if gpu_compile else []),
            *hellaswag_args]
    return run_train(args, tmp_path_factory.mktemp("evaluated"), timeout=600)


def test_sampling_inside_a_compiled_run_decodes_text(evaluated_run):
    samples = [line for line in evaluated_run.output.splitlines() if line.startswith("sample 2:")]
    print("\n".join(samples))
    texts = printed_samples("\n".join(samples))  # printed as repr: 'Hello, I\'m ...' where the text holds a "
    assert len(texts) == 4 and all(text.startswith(SAMPLE_PROMPT) for text in texts)
    assert sorted(by_step(evaluated_run.records, "val_loss")) == [0, 2]


def test_hellaswag_inside_a_compiled_run_scores_a_slice(evaluated_run):
    if not os.environ.get(HELLASWAG_ENV):
        pytest.skip(f"no local HellaSwag file: pass gpu_check.py --hellaswag_path (sets {HELLASWAG_ENV})")
    accuracy = by_step(evaluated_run.records, "hellaswag_acc")
    print(f"HellaSwag acc_norm on 40 examples: {accuracy}")
    assert sorted(accuracy) == [0, 2] and all(0.0 <= a <= 1.0 for a in accuracy.values())

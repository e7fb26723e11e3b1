"""Whole training runs on a GPU (train_gpt2.py as a subprocess, metrics.jsonl read back), each against an
independent reference: a torchrun run and a --parallel fsdp run against the plain run, a resumed run against the
uninterrupted one, --deterministic against itself, a --optimizer muon run's update against Muon in float64, a run
rolled back after planted NaNs against a resume past the bad data, and evaluate.py against the val loss the run
logged; fp16 keeps a finite loss scale, --micro_batch_size auto picks a size that trains, and HellaSwag and sampling
run inside a compiled run.

Run by gpu_check.py's tests stage on a CUDA GPU (the `small` preset, T=256); skipped without CUDA, except under
GPU_TESTS_DEVICE=cpu (gpu_check.py --cpu-smoke), where the same runs take the tiny preset on the CPU.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, copy_run, make_shards
from dataloader import DistributedDataLoader
from helpers_train import TrainRun, run_train, train_env
from model import GPT, GPTConfig
from rundir import store
from rundir.snapshot import load_snapshot, snapshot_path
from tools.gpu_check.train import SAMPLE_PROMPT, printed_samples
from training.config import TrainConfig
from training.optim import bf16_matmul_is_slow

pytestmark = pytest.mark.gpu

HELLASWAG_ENV = "GPU_TESTS_HELLASWAG"  # a local HellaSwag file (gpu_check.py --eval_dir sets it)
LAST_STEP = 7


def size_args(device: torch.device) -> list[str]:
    """8 steps of 2 micro-steps each (accumulation is part of what is checked), on a model the device trains fast."""
    if device.type == "cuda":
        return ["--device", "cuda", "--model", "small", "--seq_len", "256", "--micro_batch_size", "8",
                "--total_batch_size", "4096"]
    return ["--device", "cpu", "--model", "tiny", "--seq_len", "16", "--micro_batch_size", "2",
            "--total_batch_size", "64"]


def shards_vocabulary(device: torch.device) -> dict:
    """make_shards' random ids and tokenizer: on a GPU 100 ids as GPT-2's; on the CPU 16 ids as the bytes tokenizer's,
    so that the tiny model is 257 ids wide, not 50,257 (each run several times cheaper), its loss's floor (ln 16) far
    enough under its start (ln 257) to fall by more than 0.5 in 8 steps."""
    return {"vocab": 100} if device.type == "cuda" else {"vocab": 16, "tokenizer": "bytes"}


def by_step(records: list[dict], key: str) -> dict[int, float]:
    """{step: value}; a step logged twice (replayed after a resume) keeps its later line."""
    return {r["step"]: r[key] for r in records if key in r}


def max_rel_diff(run: TrainRun, reference: TrainRun, key: str, steps) -> float:
    got, want = by_step(run.records, key), by_step(reference.records, key)
    assert set(steps) <= set(got) and set(steps) <= set(want), f"{key}: steps missing"
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)


class Job:
    """One 8-step job in fp32 (TF32 matmuls on a GPU, as train_gpt2.py sets) on tokens from a vocabulary of 100 (16
    on the CPU: shards_vocabulary), so the loss falls fast and a wrong step shows; its plain run, with snapshots after
    steps 3 and 7, is the reference."""

    def __init__(self, root: Path, device: torch.device):
        self.root, self.device, self.data = root, device, root / "data"
        make_shards(self.data, "train", [40_000], **shards_vocabulary(device))
        make_shards(self.data, "val", [10_000], seed=1, **shards_vocabulary(device))
        self.args = [*size_args(device), "--data_dir", str(self.data), "--max_steps", str(LAST_STEP + 1),
                     "--warmup_steps", "2", "--max_lr", "3e-3", "--dtype", "fp32", "--val_every", "4",
                     "--val_tokens", str(2 * batch_shape(device)[0] * batch_shape(device)[1])]
        self.plain = run_train([*self.args, "--snapshot_every", "4", "--keep_last", "2"], root / "plain")
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
    run = run_train([*job.args, "--snapshot_every", "0"], tmp_path, nproc=nproc)
    assert f"× {nproc} ranks" in run.output
    job.assert_trains_like_plain(run)


def test_a_one_gpu_fsdp_run_trains_like_the_plain_ddp_run(job, tmp_path):
    # One process with --parallel fsdp: a process group of one (NCCL on a GPU), every block sharded with
    # fully_shard, gradients reduce-scattered, the norm over the shards' DTensors.
    run = run_train([*job.args, "--parallel", "fsdp", "--snapshot_every", "0"], tmp_path)
    job.assert_trains_like_plain(run)


def test_deterministic_runs_repeat_their_losses_bit_for_bit(job, tmp_path):
    dtype = "bf16" if job.device.type == "cuda" else "fp32"  # bf16: flash attention's backward is in the step
    args = [*job.args, "--dtype", dtype, "--deterministic", "--snapshot_every", "0"]
    first, second = run_train(args, tmp_path / "first"), run_train(args, tmp_path / "second")
    print(f"{dtype} --deterministic, twice: losses {[r['loss'] for r in first.train]}")
    for key in ("loss", "grad_norm", "val_loss"):
        assert by_step(first.records, key) == by_step(second.records, key), key


def test_a_resumed_run_continues_with_the_uninterrupted_losses(job, tmp_path):
    # A crash after step 5 leaves the snapshot of step 3: the rerun takes it and repeats steps 4..7.
    copy_run(job.root / "plain", tmp_path, 3)
    run = run_train([*job.args, "--snapshot_every", "4", "--keep_last", "2"], tmp_path)
    assert "resuming from" in run.output and min(by_step(run.records, "loss")) == 4
    job.assert_trains_like_plain(run, steps=range(4, LAST_STEP + 1))
    assert max_rel_diff(run, job.plain, "val_loss", [4, LAST_STEP]) <= job.tolerance


def test_fp16_trains_with_a_finite_loss_scale_saved_in_the_snapshot(job, tmp_path):
    run = run_train([*job.args, "--dtype", "fp16", "--snapshot_every", "100"], tmp_path)
    losses = by_step(run.records, "loss")
    skipped = [r["step"] for r in run.train if r.get("skipped")]
    print(f"fp16: loss {losses[0]:.4f} -> {losses[LAST_STEP]:.4f}, skipped steps {skipped}")
    # A skipped step's non-finite loss is logged as null.
    assert all(loss is not None and math.isfinite(loss) for loss in losses.values())
    assert losses[LAST_STEP] < losses[0] - 0.5
    assert len(skipped) <= 2  # the GradScaler may lower its first scale of 65,536 once or twice, no more
    state = store.first_loadable(store.survey(tmp_path), "here").state  # the last step's
    scale = state["scaler"]["scale"]
    print(f"saved loss scale {scale}")
    assert math.isfinite(scale) and scale >= 1.0


def test_micro_batch_size_auto_picks_a_size_that_trains_without_running_out_of_memory(gpu_device, tmp_path):
    # GPU: GPT-2 124M at T=1024 and the recipe's 524,288-token batch, so the choice is the real one; CPU: tiny.
    cuda = gpu_device.type == "cuda"
    seq_len, model, total = (1024, "gpt2", 524_288) if cuda else (32, "tiny", 512)
    make_shards(tmp_path / "data", "train", [2 * total + 1], **shards_vocabulary(gpu_device))
    args = ["--device", gpu_device.type, "--model", model, "--seq_len", str(seq_len), "--micro_batch_size", "auto",
            "--total_batch_size", str(total), "--max_steps", "2", "--val_every", "0",
            "--snapshot_every", "0", "--data_dir", str(tmp_path / "data"), "--dtype", "bf16" if cuda else "fp32"]
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
    hellaswag, eval_dir = os.environ.get(HELLASWAG_ENV), tmp_path_factory.mktemp("evals")
    if hellaswag:  # --eval_dir finds HellaSwag as hellaswag.jsonl
        (eval_dir / "hellaswag.jsonl").symlink_to(hellaswag)
    hellaswag_args = ["--eval_every", "2", "--eval_limit", "40", "--eval_dir", str(eval_dir)] if hellaswag else []
    # The job's shards as GPT-2's on every device: the samples are GPT-2 text, HellaSwag is scored in its tokens.
    data = tmp_path_factory.mktemp("gpt2_data")
    make_shards(data, "train", [40_000], vocab=100)
    make_shards(data, "val", [10_000], seed=1, vocab=100)
    args = [*job.args, "--data_dir", str(data), "--max_steps", "3", "--val_every", "2", "--sample_every", "2",
            "--snapshot_every", "0", "--dtype", "bf16" if job.device.type == "cuda" else "fp32",
            *(["--compile"] if gpu_compile else []), *hellaswag_args]
    return run_train(args, tmp_path_factory.mktemp("evaluated"), timeout=600)


def test_sampling_inside_a_compiled_run_decodes_text(evaluated_run):
    samples = [line for line in evaluated_run.output.splitlines() if line.startswith("sample 2:")]
    print("\n".join(samples))
    texts = printed_samples("\n".join(samples))  # printed as repr: 'Hello, I\'m ...' where the text holds a "
    assert len(texts) == 4 and all(text.startswith(SAMPLE_PROMPT) for text in texts)
    assert sorted(by_step(evaluated_run.records, "val_loss")) == [0, 2]


def test_hellaswag_inside_a_compiled_run_scores_a_slice(evaluated_run):
    if not os.environ.get(HELLASWAG_ENV):
        pytest.skip(f"no local HellaSwag file: pass gpu_check.py --eval_dir (sets {HELLASWAG_ENV})")
    accuracy = by_step(evaluated_run.records, "hellaswag/acc_norm")
    print(f"HellaSwag acc_norm on 40 examples: {accuracy}")
    assert sorted(accuracy) == [0, 2] and all(0.0 <= a <= 1.0 for a in accuracy.values())


# ----------------------------------------------------------------------------------------------------------------
# Muon, the divergence guards and evaluate.py on the device

NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, 5 iterations: torch.optim.Muon's defaults


def newton_schulz_float64(m: torch.Tensor) -> torch.Tensor:
    """Muon's orthogonalisation of m, written out in float64: X = m / |m|_F, then 5 times X <- aX + (bA + cA²)X with
    A = XXᵀ, on the wide orientation (rows ≤ columns)."""
    a, b, c = NEWTON_SCHULZ
    tall = m.size(0) > m.size(1)
    x = m.double().T if tall else m.double()
    x = x / x.norm()
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def test_a_compiled_modern_muon_run_learns_and_resumes_with_the_uninterrupted_losses(job, gpu_compile, tmp_path):
    """--arch modern (rotary, QK-norm, SwiGLU, untied) with Muon in bf16, compiled on a GPU: the loss falls as the
    plain GPT-2 run's does, and a resume from its step-3 snapshot repeats steps 4-7 (rerun in the same process
    settings, so the compiled kernels are the same)."""
    dtype = "bf16" if job.device.type == "cuda" else "fp32"
    # (--max_lr 1e-2 for the embeddings and output layer: modern, untied and with no bias on its output, needs a
    # higher AdamW LR than the job's 3e-3 to learn the unigram distribution in 8 steps; at 3e-3 its loss fell by
    # 0.12 on the CPU, before attention's biases.)
    args = [*job.args, "--arch", "modern", "--no-align_bos", "--optimizer", "muon", "--max_lr", "1e-2",
            "--dtype", dtype, *(["--compile"] if gpu_compile else [])]
    whole = run_train([*args, "--snapshot_every", "4", "--keep_last", "2"], tmp_path / "whole", timeout=600)
    losses = by_step(whole.records, "loss")
    assert sorted(losses) == list(range(LAST_STEP + 1)) and losses[LAST_STEP] < losses[0] - 0.5
    assert not any(r.get("skipped") for r in whole.train)
    resumed = run_train([*args, "--snapshot_every", "0", "--resume", str(snapshot_path(tmp_path / "whole", 3))],
                        tmp_path / "resumed", timeout=600)
    diff = max_rel_diff(resumed, whole, "loss", range(4, LAST_STEP + 1))
    print(f"modern + Muon, {dtype}{' compiled' if gpu_compile else ''}: loss {losses[0]:.3f} -> "
          f"{losses[LAST_STEP]:.3f}; resumed at step 4: max relative loss difference {diff:.2e}")
    assert diff <= job.tolerance


def test_a_muon_run_learns_and_its_last_update_is_muons_computed_in_float64(job, gpu_compile, tmp_path):
    """--optimizer muon in bf16, compiled (on the CPU: fp32, eager unless GPU_TESTS_COMPILE=1). The block matrices'
    last update, read from the snapshots of steps 6 and 7, against Muon in float64 from the run's own momentum
    buffers: the Nesterov step, Newton-Schulz, the LR schedule's floor, the per-shape scaling."""
    muon_lr = 0.02
    dtype = "bf16" if job.device.type == "cuda" else "fp32"
    run = run_train([*job.args, "--optimizer", "muon", "--muon_lr", str(muon_lr), "--dtype", dtype,
                     "--snapshot_every", str(LAST_STEP), "--keep_last", "2", *(["--compile"] if gpu_compile else [])],
                    tmp_path, timeout=600)
    losses = by_step(run.records, "loss")
    assert sorted(losses) == list(range(LAST_STEP + 1)) and not any(r.get("skipped") for r in run.train)
    before, after = (load_snapshot(snapshot_path(tmp_path, step)) for step in (LAST_STEP - 1, LAST_STEP))

    cfg = TrainConfig()  # the Muon flags the run left at their defaults
    lr = muon_lr * cfg.min_lr_ratio  # the schedule's last step: its floor, Muon's LR scaled by muon_lr / max_lr
    assert [g["lr"] for g in after["optimizer"]["muon"]["param_groups"]] == [pytest.approx(lr, rel=1e-12)]
    with torch.device("meta"):
        model = GPT(GPTConfig(**after["model_config"]))
    names = [name for name, p in model.named_parameters() if ".h." in f".{name}" and p.dim() == 2]  # Muon's, in order
    worst = 0.0
    for i, name in enumerate(names):
        w6, w7 = (state["model"][name].double() for state in (before, after))
        buf6, buf7 = (state["optimizer"]["muon"]["state"][i]["momentum_buffer"].double() for state in (before, after))
        grad = (buf7 - cfg.muon_momentum * buf6) / (1 - cfg.muon_momentum)  # buf <- μ·buf + (1 − μ)·grad
        nesterov = (1 - cfg.muon_momentum) * grad + cfg.muon_momentum * buf7
        rows, cols = w7.shape  # (out, in): "original" scales the step by √max(1, out/in)
        expected = -lr * cfg.muon_weight_decay * w6 - lr * math.sqrt(max(1, rows / cols)) * newton_schulz_float64(
            nesterov)
        worst = max(worst, ((w7 - w6 - expected).norm() / expected.norm()).item())
    # Where bf16 matmuls are fast (GPUs, recent CPUs) torch's Newton-Schulz runs in bf16, and its iteration multiplies
    # rounding in a gradient's weak directions up to 3.4^5 times: 0.02-0.11 of the update measured on this model's
    # gradients, against 0.3-0.45 for a step without Nesterov and ≥ 0.4 for a wrong per-shape scale. fp32: 1e-5.
    tolerance = 1e-3 if bf16_matmul_is_slow(job.device) else 0.2
    print(f"Muon, {dtype}{' compiled' if gpu_compile else ''}: loss {losses[0]:.3f} -> {losses[LAST_STEP]:.3f}; the "
          f"last update of {len(names)} matrices vs float64 Muon: worst relative difference {worst:.3f} (bound "
          f"{tolerance:g})")
    assert losses[LAST_STEP] < losses[0] - 0.5
    assert worst <= tolerance


PLANTED_NAN_SCRIPT = ROOT / "tests" / "train_with_planted_nan.py"


def batch_shape(device: torch.device) -> tuple[int, int, int]:
    """(micro-batch size, sequence length, tokens per step) of size_args."""
    args = size_args(device)
    B, T, total = (int(args[args.index(flag) + 1]) for flag in ("--micro_batch_size", "--seq_len",
                                                                 "--total_batch_size"))
    return B, T, total


def micro_batch_keys(data: Path, device: torch.device, steps: list[int]) -> list[list[int]]:
    """The first 8 tokens of every micro-batch of `steps` as a run with size_args reads them uninterrupted (its
    shuffled order, seed 1337): tests/train_with_planted_nan.py gives those batches a NaN loss."""
    B, T, total = batch_shape(device)
    loader = DistributedDataLoader(data, "train", B, T, grad_accum_steps=total // (B * T), shuffle=True, seed=1337)
    keys = []
    for step in range(max(steps) + 1):
        for _ in range(total // (B * T)):
            x, _ = loader.next_batch()
            if step in steps:
                keys.append(x[0, :8].tolist())
    return keys


def test_a_planted_nan_is_skipped_and_a_divergence_rolls_back_and_goes_on(gpu_device, tmp_path):
    # The data of step 2 gives a NaN loss: that update is skipped. The data of steps 6-8 as well: 3 skips in a row
    # (--max_skips 3), so the run reloads its snapshot of step 4 and goes on at step 5 with the data of step 9.
    data = tmp_path / "data"
    # no epoch boundary: a planted batch is read once
    make_shards(data, "train", [200_000], **shards_vocabulary(gpu_device))
    dtype = "bf16" if gpu_device.type == "cuda" else "fp32"
    args = [*size_args(gpu_device), "--data_dir", str(data), "--max_steps", "14", "--warmup_steps", "2",
            "--max_lr", "3e-3", "--dtype", dtype, "--deterministic", "--val_every", "0", "--snapshot_every", "5",
            "--keep_last", "3", "--max_skips", "3", "--on_divergence", "rollback"]
    keys = micro_batch_keys(data, gpu_device, [2, 6, 7, 8])
    run = run_train(args, tmp_path / "run", env={"PLANTED_NAN_BATCHES": json.dumps(keys)}, script=PLANTED_NAN_SCRIPT)
    skipped = {r["step"]: r["skip_reason"] for r in run.train if r.get("skipped")}
    assert skipped == {step: "non-finite loss" for step in (2, 6, 7, 8)}
    rollbacks = [r for r in run.records if r.get("event") == "rollback"]
    assert [(r["step"], r["to_step"], r["snapshot"]) for r in rollbacks] == [
        (8, 5, str(snapshot_path(tmp_path / "run", 4)))]
    after = by_step(run.records[run.records.index(rollbacks[0]) + 1:], "loss")
    assert list(after) == list(range(5, 14)) and all(math.isfinite(loss) for loss in after.values())

    # Independently: the step-4 snapshot, which the rollback rewrote with its data loader at the data of step 9 (past
    # the bad data), resumed in a fresh process with nothing planted. Both are --deterministic: the same to the bit.
    state = load_snapshot(snapshot_path(tmp_path / "run", 4))
    assert state["loader"]["chunk_position"] == 9 * state["loader"]["chunks_per_step"]
    copy_run(tmp_path / "run", tmp_path / "reference", 4)  # (cp -r: the run's record and the snapshot's)
    reference = by_step(run_train(args, tmp_path / "reference").records, "loss")
    first = by_step(run.records, "loss")[0]
    print(f"{dtype} on {gpu_device.type}: skipped {sorted(skipped)}, rolled back at step 8 to 5; loss {first:.3f} -> "
          f"{after[13]:.3f}; max |difference| to a resume past the bad data "
          f"{max(abs(after[s] - reference[s]) for s in after):.1e} (bound 0: bitwise)")
    assert after == reference
    assert after[13] < first - 0.5  # it still learns


def test_evaluate_py_gets_the_val_loss_the_run_logged_for_its_snapshot(job, tmp_path):
    # snapshot_3 holds the weights after step 3; the run validated them before step 4's update.
    snapshot = snapshot_path(job.root / "plain", 3)
    proc = subprocess.run([sys.executable, "-m", "tools.evaluate", "--snapshot", str(snapshot), "--device",
                           job.device.type, "--json"], cwd=ROOT, env=train_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    val_loss, val_bpb = by_step(job.plain.records, "val_loss"), by_step(job.plain.records, "val_bpb")
    difference = abs(result["val_loss"] - val_loss[4]) / val_loss[4]
    print(f"evaluate.py on snapshot_3: val loss {result['val_loss']:.6f}, the run logged {val_loss[4]:.6f} at step 4 "
          f"(relative difference {difference:.1e}); val bpb {result['val_bpb']}")
    B, T, _ = batch_shape(job.device)
    assert result["step"] == 3 and result["val_tokens"] == 2 * B * T  # the run's --val_tokens, from the snapshot
    # The same code on the same batches with the same weights: bitwise on the CPU. On a GPU another process may pick
    # another cuBLAS kernel (a different order of additions, ~1e-6); a wrong step or batch is off by 1e-2 or more.
    tolerance = 1e-5 if job.device.type == "cuda" else 0.0
    assert difference <= tolerance
    assert abs(val_loss[4] - val_loss[0]) > 1e-2 * val_loss[0]  # the steps are told apart
    if 4 in val_bpb:  # None where the GPT-2 tokenizer is not available
        assert abs(result["val_bpb"] - val_bpb[4]) <= tolerance * val_bpb[4]

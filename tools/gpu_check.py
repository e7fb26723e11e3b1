"""The GPU acceptance run: one command checks every GPU path of this codebase, measures its speed, and gives each
check a verdict.

    python -m tools.gpu_check --out gpu_report                 # all three stages, under 20 minutes on one H100
    python -m tools.gpu_check --out gpu_report --stage bench   # one stage: tests, bench or train
    python -m tools.gpu_check --out gpu_report --data_dir data/fineweb_edu10B --hellaswag_path hellaswag_val.jsonl
    python -m tools.gpu_check --out /tmp/smoke --cpu-smoke     # every stage on the CPU at a tiny size (the CPU suite)

It needs what a cluster node or a container image already has: PyTorch with CUDA, numpy, tiktoken and tqdm (and
pytest for the tests stage). No network, no wandb, no datasets, nothing to install: the data are random tokens
written to OUT/data unless --data_dir names real shards, and the GPT-2 tokenizer (for samples and HellaSwag) comes
from TIKTOKEN_CACHE_DIR. The stages, in the order they run:

  tests  `pytest -m gpu tests/gpu`: every GPU path against an independent reference, a row per test
  train  GPT-2 124M for 300 steps on the 124M recipe's schedule, shortened, with validation, HellaSwag and samples on
         the way: train_gpt2.py itself, read back from its metrics.jsonl
  bench  GPT-2 124M, T=1024, bf16, eager and compiled, at the micro-batch --micro_batch_size auto picks (bench.py's
         own timing): ms/step, tokens/s, MFU against the datasheet peak, peak memory, the loss's trend; ours against
         build-nanogpt's full-logits loss at B=64 and 524,288 tokens a step, compiled, alternating (bench.py
         --vs_full_logits), and the loss's share of the step; generation tokens/s with and without the key/value
         cache; --arch modern's step against gpt2's; then gpt2-medium and -large while the stage has half its budget
         left

OUT/report.md and OUT/report.json (rewritten after every check, so a run cut short still leaves its rows) hold the
machine (GPU, compute capability, memory, driver, torch, CUDA) and a row per check: its figure, its bound, and PASS,
FAIL or SKIP (with the reason). Exit status 0 when nothing failed, 1 when something did, 2 without a CUDA GPU.
"""

import argparse
import ast
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from config import TrainConfig
from dataloader import write_shard
from distributed import Distributed
from errors import UserError, run_entry_point
from memory import GiB, MiB, choose_micro_batch, compiled_loss_bytes_per_sequence
from model import loss_chunk_tokens
from precision import pick_dtype
from tokenizer import gpt2_encoding
from tools import bench

ROOT = Path(__file__).resolve().parent.parent  # the repository root: tests/gpu, train_gpt2.py
STAGES = ("tests", "train", "bench")


@dataclass(frozen=True)
class Scale:
    """The sizes of a check run: GPT-2 on a GPU, or the tiny preset on the CPU (--cpu-smoke)."""
    device: str
    dtype: str
    model: str  # of the bench and train stages
    seq_len: int
    compile: bool  # compiled runs in bench and train (minutes on a CPU, so not in the smoke run)
    stage_seconds: int  # each stage's budget
    # bench
    bench_sequences: int  # the batch --micro_batch_size auto fits a divisor of: the 124M recipe's 512 sequences
    bench_steps: int
    bench_warmup: int
    bench_larger: tuple[str, ...]  # benched too (compiled) while the stage has half its budget left
    mfu_floor: float  # the compiled bench and the train run reach this at least (0: not judged, as on a CPU)
    # ours against the full-logits loss: micro-batch, micro-steps, timed steps after warm-up steps, rounds
    vs_full_logits: tuple[int, int, int, int, int]
    # issue 30's goal for that comparison: at least this speed ratio, at most this memory ratio, at least this MFU;
    # None: not judged (a CPU)
    vs_full_logits_goal: tuple[float, float, float] | None
    generation_floor: float  # tokens/s of cached generation (124M, batch 1) at least
    # train
    train_steps: int
    train_batch: int  # tokens per optimizer step
    max_lr: float
    eval_every: int  # validation, HellaSwag and samples
    val_tokens: int
    hellaswag_limit: int
    hellaswag_range: tuple[float, float]  # acc_norm of an early model: about chance (0.25), on this many examples
    loss_drop: float  # the last 10 steps' mean loss lies this far below step 0's at least


GPU = Scale(device="cuda", dtype="bf16", model="gpt2", seq_len=1024, compile=True, stage_seconds=480,
            bench_sequences=512, bench_steps=10, bench_warmup=3, bench_larger=("gpt2-medium", "gpt2-large"),
            mfu_floor=0.30, vs_full_logits=(64, 8, 5, 2, 2), vs_full_logits_goal=(1.15, 0.75, 0.45),
            generation_floor=5 * 168, train_steps=300, train_batch=131_072, max_lr=TrainConfig.max_lr, eval_every=100,
            val_tokens=1_048_576, hellaswag_limit=500, hellaswag_range=(0.15, 0.60), loss_drop=3.0)
CPU_SMOKE = Scale(device="cpu", dtype="fp32", model="tiny", seq_len=32, compile=False, stage_seconds=600,
                  bench_sequences=8, bench_steps=2, bench_warmup=1, bench_larger=(), mfu_floor=0.0,
                  vs_full_logits=(2, 2, 2, 1, 1), vs_full_logits_goal=None, generation_floor=0.0,
                  train_steps=30, train_batch=256, max_lr=3e-3, eval_every=10, val_tokens=1024, hellaswag_limit=20,
                  hellaswag_range=(0.0, 1.0), loss_drop=1.0)

# A check's result: (figure, bound, passed); passed None is a SKIP, and the figure then says why.
Result = tuple[str, str, bool | None]


# ----------------------------------------------------------------------------------------------------------------
# the report

@dataclass
class Row:
    stage: str
    name: str
    figure: str
    bound: str
    verdict: str  # PASS, FAIL or SKIP


class Report:
    def __init__(self, out: Path, machine: dict, scale: Scale):
        self.out, self.machine, self.scale = out, machine, scale
        self.rows: list[Row] = []
        self.details: dict = {}  # the stages' raw numbers, for report.json

    def check(self, stage: str, name: str, check: Callable[..., Result], *args) -> Row:
        """Run one check and record its row; an exception in it is that check's FAIL, not the end of the run."""
        try:
            figure, bound, passed = check(*args)
        except Exception as e:  # any error is this check's verdict
            figure, bound, passed = f"{type(e).__name__}: {first_line(str(e))}", "no error", False
        row = Row(stage, name, figure, bound, "SKIP" if passed is None else "PASS" if passed else "FAIL")
        self.rows.append(row)
        print(f"{row.verdict:4s} | {stage}: {name} | {figure} | {bound}", flush=True)
        self.write()
        return row

    @property
    def failed(self) -> bool:
        return any(row.verdict == "FAIL" for row in self.rows)

    def write(self) -> None:
        (self.out / "report.json").write_text(json.dumps(
            {"machine": self.machine, "scale": asdict(self.scale), "rows": [asdict(r) for r in self.rows],
             "details": self.details}, indent=1) + "\n")
        counts = {v: sum(r.verdict == v for r in self.rows) for v in ("PASS", "FAIL", "SKIP")}
        lines = ["# GPU acceptance report", "", "| machine | |", "|---|---|"]
        lines += [f"| {key} | {value} |" for key, value in self.machine.items()]
        lines += ["", f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped", "",
                  "| stage | check | figure | bound | verdict |", "|---|---|---|---|---|"]
        lines += [f"| {r.stage} | {r.name} | {md(r.figure)} | {md(r.bound)} | **{r.verdict}** |" for r in self.rows]
        (self.out / "report.md").write_text("\n".join(lines) + "\n")


def md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def machine_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "CUDA (torch build)": torch.version.cuda, "python": platform.python_version()}
    if device.type != "cuda":
        return {"device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"} | info
    properties = torch.cuda.get_device_properties(device)
    try:
        nccl = torch.cuda.nccl.version()  # (2, 21, 5) in current torch
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception as e:  # a build without NCCL
        nccl = f"unknown ({type(e).__name__})"
    return {"device": properties.name, "GPUs": torch.cuda.device_count(),
            "compute capability": f"{properties.major}.{properties.minor}",
            "memory": f"{properties.total_memory / GiB:.1f} GiB", "driver": nvidia_driver()} | info | {
            "cuDNN": torch.backends.cudnn.version(), "NCCL": nccl}


def nvidia_driver() -> str:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        return first_line(proc.stdout) or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"


def run_logged(command: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int, str]:
    """Run command in the repository, its output (stdout, then stderr) also written to log; returns (exit status,
    output). Past timeout its whole process group is killed (pytest's and torchrun's children too): status -9."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\nstopped after {timeout:.0f} s"
    log.write_text(stdout + stderr)
    return proc.returncode, stdout + stderr


def within_budget(seconds: float, budget: int) -> Result:
    return f"{seconds:,.0f} s", f"< {budget} s", seconds < budget


def tokenizer_problem() -> str | None:
    """Why the GPT-2 tokenizer cannot be loaded here (samples and HellaSwag need it), or None if it can."""
    try:
        gpt2_encoding()
        return None
    except Exception as e:  # no cache and no network: tiktoken's errors vary
        return (f"the GPT-2 tokenizer could not be loaded ({type(e).__name__}); point TIKTOKEN_CACHE_DIR at a copy "
                "of tiktoken's cache (README, GPU acceptance)")


# ----------------------------------------------------------------------------------------------------------------
# stage tests: pytest -m gpu tests/gpu, a row per test

def tests_stage(report: Report, scale: Scale, args: argparse.Namespace) -> None:
    if importlib.util.find_spec("pytest") is None:
        report.check("tests", "pytest -m gpu tests/gpu", lambda: (
            "pytest is not installed", "installed", False))
        return
    junit = report.out / "tests_junit.xml"
    junit.unlink(missing_ok=True)
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    if scale.device == "cpu":
        env["GPU_TESTS_DEVICE"] = "cpu"  # tests/conftest.py: the GPU tests' bodies on the CPU, at a tiny size
    if args.hellaswag_path:
        env["GPU_TESTS_HELLASWAG"] = str(Path(args.hellaswag_path).resolve())
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "-o", "junit_logging=system-out"]
    _, output = run_logged(command, env, 2 * scale.stage_seconds, report.out / "tests_output.txt")
    if not junit.exists():
        report.check("tests", "pytest -m gpu tests/gpu", lambda: (
            first_line(output.strip().splitlines()[-1] if output.strip() else "no output"), "runs", False))
        return
    cases = ET.parse(junit).getroot().iter("testcase")
    for case in cases:
        report.check("tests", case.get("name"), junit_row, case)


def junit_row(case: ET.Element) -> Result:
    """A test's verdict, and as its figure the last line it printed (tests/gpu print what they measured)."""
    seconds = float(case.get("time", 0))
    for tag in ("failure", "error"):
        problem = case.find(tag)
        if problem is not None:
            return f"{tag}: {first_line(problem.get('message') or problem.text or '')}", "passes", False
    skipped = case.find("skipped")
    if skipped is not None:
        return f"skipped: {first_line(skipped.get('message') or '')}", "passes", None
    printed = [line for line in (case.findtext("system-out") or "").splitlines() if line.strip()
               and not line.startswith(("-----", "USDT"))]
    return (f"{first_line(printed[-1], 200)}; " if printed else "") + f"{seconds:.1f} s", "passes", True


# ----------------------------------------------------------------------------------------------------------------
# stage train: train_gpt2.py for a few hundred steps, read back from metrics.jsonl

def write_synthetic_shards(directory: Path, train_tokens: int, val_tokens: int, seed: int = 0) -> None:
    """Random tokens a model can learn: 1,024 random phrases of 64 tokens over 4,096 token ids, in random order.
    A model learns first which ids occur (the loss falls from ln 50257 = 10.8 to ln 4096 = 8.3), then the phrases."""
    rng = np.random.default_rng(seed)
    phrases = rng.integers(0, 4096, size=(1024, 64))
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        tokens = phrases[rng.integers(0, len(phrases), size=-(-n // 64))].ravel()[:n]
        write_shard(directory / f"synthetic_{split}_000000.bin", tokens)


@dataclass
class TrainRun:
    returncode: int
    records: list[dict]  # metrics.jsonl
    output: str  # stdout and stderr
    hellaswag: bool  # asked for
    samples: bool  # asked for
    skip_reason: str  # why HellaSwag or samples were not asked for

    @property
    def train(self) -> list[dict]:
        return [r for r in self.records if "loss" in r]


def train_stage(report: Report, scale: Scale, args: argparse.Namespace) -> None:
    data_dir = args.data_dir
    if data_dir is None:
        data_dir = report.out / "data"
        write_synthetic_shards(data_dir, min(scale.train_steps * scale.train_batch, 10_000_000) + 1,
                               scale.val_tokens + scale.train_batch + 1)
    log_dir = report.out / "train"
    shutil.rmtree(log_dir, ignore_errors=True)  # metrics.jsonl is appended to: start from nothing
    log_dir.mkdir(parents=True)
    no_tokenizer = tokenizer_problem()
    hellaswag = args.hellaswag_path is not None and no_tokenizer is None
    samples = no_tokenizer is None
    skip_reason = no_tokenizer or "no --hellaswag_path given (the machine has no network to download it)"
    # The 124M recipe's schedule (TrainConfig's defaults: 715 warmup steps of 19,073), shortened to train_steps.
    warmup = max(1, round(TrainConfig.warmup_steps * scale.train_steps / TrainConfig.max_steps))
    every = str(scale.eval_every)
    command = [sys.executable, str(ROOT / "train_gpt2.py"), "--device", scale.device, "--dtype", scale.dtype,
               "--model", scale.model, "--seq_len", str(scale.seq_len), "--micro_batch_size", "auto",
               "--total_batch_size", str(scale.train_batch), "--max_steps", str(scale.train_steps),
               "--warmup_steps", str(warmup), "--max_lr", str(scale.max_lr), "--data_dir", str(data_dir),
               "--val_every", every, "--val_tokens", str(scale.val_tokens), "--sample_every", every if samples else "0",
               "--hellaswag_every", every if hellaswag else "0", "--hellaswag_limit", str(scale.hellaswag_limit),
               "--snapshot_every", "0", "--log_dir", str(log_dir), *(["--compile"] if scale.compile else []),
               *(["--hellaswag_path", str(args.hellaswag_path)] if hellaswag else [])]
    print("train:", " ".join(command[1:]), flush=True)
    returncode, output = run_logged(command, os.environ | {"PYTHONUNBUFFERED": "1"}, 2 * scale.stage_seconds,
                                    log_dir / "output.txt")
    metrics = log_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.exists() else []
    run = TrainRun(returncode, records, output, hellaswag, samples, skip_reason)
    report.details["train"] = {"command": command[1:], "steps_logged": len(run.train)} | {
        key: {r["step"]: r[key] for r in records if key in r} for key in ("val_loss", "hellaswag/acc_norm")}
    for name, check in TRAIN_CHECKS:
        report.check("train", name, check, run, scale)


def finite(loss: float | None) -> bool:
    return loss is not None and math.isfinite(loss)  # metrics.jsonl logs a skipped step's non-finite loss as null


def train_finished(run: TrainRun, scale: Scale) -> Result:
    tail = "" if run.returncode == 0 else f": {first_line(run.output.strip().splitlines()[-1])}" if run.output else ""
    return f"exit status {run.returncode}{tail}", "0", run.returncode == 0


def train_every_step(run: TrainRun, scale: Scale) -> Result:
    steps = [r["step"] for r in run.train]
    skipped = sum(bool(r.get("skipped")) for r in run.train)
    not_finite = sum(not finite(r["loss"]) for r in run.train)
    return (f"{len(steps)} steps logged, {skipped} skipped, {not_finite} losses not finite",
            f"steps 0..{scale.train_steps - 1}, none skipped, all finite",
            steps == list(range(scale.train_steps)) and skipped == 0 and not_finite == 0)


def train_first_loss(run: TrainRun, scale: Scale) -> Result:
    first = run.train[0]["loss"]
    return f"{first:.4f}", "10.5 to 11.3 (ln 50257 = 10.82: a uniform guess)", 10.5 <= first <= 11.3


def train_loss_falls(run: TrainRun, scale: Scale) -> Result:
    first, last = run.train[0]["loss"], statistics.mean(r["loss"] for r in run.train[-10:] if finite(r["loss"]))
    return (f"{first:.3f} at step 0, {last:.3f} over the last 10 steps", f"≤ step 0's − {scale.loss_drop:g}",
            last <= first - scale.loss_drop)


def train_validation(run: TrainRun, scale: Scale) -> Result:
    val = [(r["step"], r["val_loss"]) for r in run.records if "val_loss" in r]
    figure = ", ".join(f"{loss:.3f} (step {step})" for step, loss in val)
    return (figure or "none logged", "≥ 2 logged, all finite, the last below the first",
            len(val) >= 2 and all(math.isfinite(v) for _, v in val) and val[-1][1] < val[0][1])


def train_hellaswag(run: TrainRun, scale: Scale) -> Result:
    if not run.hellaswag:
        return f"not run: {run.skip_reason}", "", None
    accuracy = [(r["step"], r["hellaswag/acc_norm"]) for r in run.records if "hellaswag/acc_norm" in r]
    low, high = scale.hellaswag_range
    return (", ".join(f"{acc:.3f} (step {step})" for step, acc in accuracy) or "none logged",
            f"logged, acc_norm on {scale.hellaswag_limit} examples in {low:g}..{high:g} (chance: 0.25)",
            bool(accuracy) and all(low <= acc <= high for _, acc in accuracy))


SAMPLE_PROMPT = "Hello, I'm a language model,"  # train_gpt2.py's (Evaluations.run_due)


def printed_samples(output: str) -> list[str]:
    """The texts of a run's `sample {step}: {text!r}` lines. Read back from their repr, not searched as printed:
    a text holding both ' and " is printed in single quotes with its ' escaped, as 'Hello, I\\'m a ...'."""
    return [ast.literal_eval(match.group(1)) for match in re.finditer(r"^sample \d+: (.*)$", output, re.MULTILINE)]


def train_samples(run: TrainRun, scale: Scale) -> Result:
    if not run.samples:
        return f"not run: {run.skip_reason}", "", None
    samples = printed_samples(run.output)
    return (f"{len(samples)} decoded" + (f", e.g. {first_line(repr(samples[-1]), 120)}" if samples else ""),
            "≥ 4, each starting with the prompt", len(samples) >= 4 and all(s.startswith(SAMPLE_PROMPT)
                                                                            for s in samples))


def train_speed(run: TrainRun, scale: Scale) -> Result:
    steady = run.train[len(run.train) // 10:]  # past compilation and warm-up
    tokens_per_sec = statistics.median(r["tokens_per_sec"] for r in steady)
    mfu = statistics.median(r["mfu"] for r in steady)
    return (f"{tokens_per_sec:,.0f} tokens/s, MFU {mfu:.1%} (medians, steps {steady[0]['step']} on)",
            f"MFU ≥ {scale.mfu_floor:.0%}", mfu >= scale.mfu_floor)


TRAIN_CHECKS = [("the run finishes", train_finished), ("every step trains", train_every_step),
                ("step-0 loss", train_first_loss), ("the loss falls", train_loss_falls),
                ("validation", train_validation), ("HellaSwag slice", train_hellaswag), ("samples", train_samples),
                ("speed", train_speed)]


# ----------------------------------------------------------------------------------------------------------------
# stage bench: bench.py's timing of the real training step

def bench_stage(report: Report, scale: Scale, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    dist_env = Distributed(0, 0, 1, torch.device(scale.device, 0) if scale.device == "cuda" else torch.device("cpu"))
    runs, micro_batches = {}, {}
    report.details["bench"] = runs
    data_dir = args.data_dir
    if data_dir is None:  # learnable tokens, so that each run's loss can be seen to fall
        data_dir = str(report.out / "bench_data")
        write_synthetic_shards(Path(data_dir), 4 * 524_288 + 1, 1025)
    for compile in (False, True):
        name = f"{scale.model} {scale.dtype} {'compiled' if compile else 'eager'}"
        if compile and not scale.compile:
            report.check("bench", name, lambda: ("not run: torch.compile takes minutes on a CPU", "", None))
            continue
        if scale.model not in micro_batches:
            report.check("bench", f"{scale.model}: --micro_batch_size auto", bench_micro_batch, scale.model, scale,
                         dist_env, micro_batches)
        if scale.model not in micro_batches:  # not even one sequence fits: the row above says so
            break
        runs[name] = time_training_step(scale.model, micro_batches[scale.model], compile, scale, dist_env, data_dir)
        report.check("bench", name, bench_speed, runs[name], scale, compile)
    eager, compiled = (runs.get(f"{scale.model} {scale.dtype} {kind}") for kind in ("eager", "compiled"))
    report.check("bench", f"{scale.model}: compiled against eager", bench_compiled_vs_eager, eager, compiled, scale)
    gpt2 = compiled or eager
    if gpt2 is not None and "skipped" not in gpt2:  # --arch modern at the same size, batch and compile mode
        runs[f"{scale.model} modern"] = time_training_step(scale.model, gpt2["micro_batch_size"], compiled is not None,
                                                           scale, dist_env, data_dir, arch="modern")
        report.check("bench", f"{scale.model}: --arch modern against gpt2", bench_modern_vs_gpt2,
                     runs[f"{scale.model} modern"], gpt2, scale)
    comparison = compare_with_full_logits(scale, dist_env, data_dir)
    report.details["bench_vs_full_logits"] = comparison
    report.check("bench", f"{scale.model}: ours against the full-logits loss", bench_vs_full_logits, comparison,
                 scale)
    report.check("bench", f"{scale.model}: the loss's share of the step", bench_loss_share, comparison, scale)
    config = bench.PRESETS[scale.model]
    generation = bench.time_generation(config, dist_env.device, min(256, config.block_size - 16), compile=scale.compile)
    report.details["generation"] = generation
    report.check("bench", f"{scale.model}: generation with the key/value cache", bench_generation, generation, scale)
    for model in scale.bench_larger:
        name = f"{model} {scale.dtype} compiled"
        if time.perf_counter() - started > scale.stage_seconds / 2:
            report.check("bench", name, lambda: ("not run: past half the stage's time budget", "", None))
            continue
        report.check("bench", f"{model}: --micro_batch_size auto", bench_micro_batch, model, scale, dist_env,
                     micro_batches)
        if model in micro_batches:
            runs[name] = time_training_step(model, micro_batches[model], True, scale, dist_env, data_dir)
            report.check("bench", name, bench_speed, runs[name], scale, True)


def bench_micro_batch(model: str, scale: Scale, dist_env: Distributed, chosen: dict[str, int]) -> Result:
    """train_gpt2.py's own --micro_batch_size auto for the 124M recipe's batch of 512 sequences; into chosen[model]."""
    cfg = TrainConfig(model=model, seq_len=scale.seq_len, micro_batch_size="auto", val_every=0, device=scale.device,
                      dtype=scale.dtype, total_batch_size=scale.bench_sequences * scale.seq_len)
    chosen[model] = choose_micro_batch(cfg, dist_env, pick_dtype(scale.dtype, dist_env.device), print)
    return f"micro-batch {chosen[model]} of T={scale.seq_len}", "≥ 1 sequence fits", chosen[model] >= 1


# GPT-3's learning rates for these sizes (Brown et al. 2020, table 2.1): at 124M's 6e-4, gpt2-large's loss went from
# 11.0 to 25.5 in the bench's 13 steps on an H100.
BENCH_MAX_LR = {"gpt2-medium": 3e-4, "gpt2-large": 2.5e-4, "gpt2-xl": 2e-4}


def bench_workload(model: str, micro_batch: int, scale: Scale, dist_env: Distributed, data_dir: str | None,
                   steps: int, warmup: int, grad_accum_steps: int = 1, compile: bool = False,
                   arch: str = "gpt2") -> bench.Workload:
    return bench.make_workload(bench.parse_args(
        ["--arch", arch, "--model", model, "--max_lr", str(BENCH_MAX_LR.get(model, scale.max_lr)), "--seq_len",
         str(scale.seq_len), "--micro_batch_size", str(micro_batch), "--dtype", scale.dtype, "--device", scale.device,
         "--steps", str(steps), "--warmup", str(warmup), "--grad_accum_steps", str(grad_accum_steps)]
        + (["--compile"] if compile else []) + (["--data_dir", data_dir] if data_dir else [])),
        dist_env)


def time_training_step(model: str, micro_batch: int, compile: bool, scale: Scale, dist_env: Distributed,
                       data_dir: str, arch: str = "gpt2") -> dict:
    work = bench_workload(model, micro_batch, scale, dist_env, data_dir, scale.bench_steps, scale.bench_warmup,
                          arch=arch)
    result = bench.time_config_or_skip(work, data_dir, pick_dtype(scale.dtype, dist_env.device), compile, False,
                                       scale.bench_steps, scale.bench_warmup)
    return result | {"micro_batch_size": micro_batch, "seq_len": scale.seq_len}


def compare_with_full_logits(scale: Scale, dist_env: Distributed, data_dir: str) -> dict:
    """bench.py --vs_full_logits at the issue's shape: 124M, B=64, T=1024, 8 micro-steps (524,288 tokens a step)."""
    micro_batch, grad_accum_steps, steps, warmup, rounds = scale.vs_full_logits
    work = bench_workload(scale.model, micro_batch, scale, dist_env, data_dir, steps, warmup, grad_accum_steps,
                          scale.compile)
    comparison = bench.compare_with_full_logits(work, data_dir, pick_dtype(scale.dtype, dist_env.device),
                                                scale.compile, steps, warmup, rounds)
    return comparison | {"micro_batch_size": micro_batch, "grad_accum_steps": grad_accum_steps}


def bench_speed(run: dict, scale: Scale, compile: bool) -> Result:
    if "skipped" in run:
        return run["skipped"], "fits and runs", False
    floor = scale.mfu_floor if compile else scale.mfu_floor / 2
    losses = run["losses"]
    return (f"B={run['micro_batch_size']}: {run['ms_per_step']:,.1f} ms/step, {run['tokens_per_sec']:,.0f} tokens/s, "
            f"MFU {run['mfu']:.1%} ({run['peak_source']}), peak memory {run['peak_memory_mib'] / 1024:,.1f} GiB "
            f"({run['warmup_peak_memory_mib'] / 1024:,.1f} in the warm-up steps), "
            f"loss {losses[0]:.3f} → {losses[-1]:.3f}", f"MFU ≥ {floor:.0%}, the loss falls",
            run["mfu"] >= floor and loss_falls(losses))


def bench_modern_vs_gpt2(modern: dict, gpt2: dict, scale: Scale) -> Result:
    """Issue 26's bound: --arch modern's step within 1.15× GPT-2's at the same size (rotary and the norms cost a
    little; SwiGLU holds as many weights as GPT-2's MLP, and the untied output layer adds no matmul)."""
    if "skipped" in modern:
        return modern["skipped"], "fits and runs", False
    ratio = modern["ms_per_step"] / gpt2["ms_per_step"]
    losses = modern["losses"]
    # Finite, not falling: without biases, modern learns the unigram distribution later than GPT-2 at the same AdamW
    # LR, so a few steps at the bench's LR need not lower its loss yet.
    figure = (f"{modern['ms_per_step']:,.1f} against {gpt2['ms_per_step']:,.1f} ms/step: {ratio:.3f}×, MFU "
              f"{modern['mfu']:.1%}, peak memory {modern['peak_memory_mib'] / 1024:,.1f} GiB, loss {losses[0]:.3f} → "
              f"{losses[-1]:.3f}")
    finite = all(math.isfinite(loss) for loss in losses)
    if scale.vs_full_logits_goal is None:  # one timing each of a tiny model on a shared CPU: no verdict on speed
        return figure, "finite losses (the speed not judged on a CPU)", finite
    return figure, "≤ 1.15× gpt2's step, finite losses", ratio <= 1.15 and finite


def loss_falls(losses: list[float]) -> bool:
    """Finite, and the last step's below the first's: a diverged step (loss 51 where ln 50257 = 10.8) is no pass."""
    return all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


def bench_vs_full_logits(comparison: dict, scale: Scale) -> Result:
    pairs = [(theirs, ours) for theirs, ours in comparison["rounds"] if "skipped" not in theirs | ours]
    if not pairs:
        return "; ".join(run["skipped"] for run in comparison["rounds"][0] if "skipped" in run), "runs", False
    mfu = statistics.median(ours["mfu"] for _, ours in pairs)
    memory = comparison["memory_ratio"]
    figure = (f"{comparison['speed_ratio']:.3f}× the tokens/s (" + ", ".join(
        f"{ours['tokens_per_sec']:,.0f} vs {theirs['tokens_per_sec']:,.0f}" for theirs, ours in pairs) + ")"
              + (f", {memory:.2f}× the peak memory ({pairs[0][1]['peak_memory_mib'] / 1024:,.1f} vs "
                 f"{pairs[0][0]['peak_memory_mib'] / 1024:,.1f} GiB)" if memory is not None else "")
              + f", MFU {mfu:.1%}, B={comparison['micro_batch_size']} × {comparison['grad_accum_steps']} micro-steps")
    trends = all(loss_falls(run["losses"]) for pair in pairs for run in pair)
    if scale.vs_full_logits_goal is None:
        return figure, "runs, the loss falls (not judged on a CPU)", trends
    speed, memory_bound, mfu_floor = scale.vs_full_logits_goal
    return (figure, f"≥ {speed}× the tokens/s, ≤ {memory_bound}× the peak memory, MFU ≥ {mfu_floor:.0%}, the loss "
            "falls", comparison["speed_ratio"] >= speed and memory <= memory_bound and mfu >= mfu_floor and trends)


def bench_loss_share(comparison: dict, scale: Scale) -> Result:
    ms, share = comparison["loss_ms"], comparison["loss_share"]
    figure = (f"forward + backward of one micro-batch: {ms['ours']:.1f} ms ours, {ms['full_logits']:.1f} ms full "
              "logits" + (f"; {share:.1%} of our step" if share is not None else ""))
    if scale.vs_full_logits_goal is None:  # a tiny model's loss on a CPU says nothing about a GPU's
        return figure, "runs (not judged on a CPU)", True
    return figure, "ours ≤ the full-logits loss's time", ms["ours"] <= ms["full_logits"]


def bench_generation(generation: dict, scale: Scale) -> Result:
    speed = generation["tokens_per_sec"]
    return (bench.format_generation(generation),
            f"the faster cached run ≥ {scale.generation_floor:,.0f} tokens/s, each ≥ without the cache",
            speed[generation["best_cached"]] >= scale.generation_floor
            and min(speed[name] for name in generation["decode_tokens_per_sec"]) >= speed["without_cache"])


# Compiled against eager. Speed: each figure is the median of bench_steps steps, and two measurements of the same step
# on one GPU still differ by a few percent (clocks, heat, what ran before), so a compiled step is judged slower only
# below 0.95× eager's tokens/s. Memory: two runs of the same step differ by cuBLAS's workspaces, the allocator's
# rounding and, in the compiled run's first step, Inductor's autotuning copies, which 1.05× covers; on top of that a
# compiled step holds every chunk of the loss at once (memory.compiled_loss_bytes_per_sequence, measured on an H200),
# while it saves no more for backward than eager. A compiled step that kept more activations would exceed the sum.
COMPILED_MIN_SPEEDUP = 0.95
COMPILED_MAX_MEMORY = 1.05


def bench_compiled_vs_eager(eager: dict | None, compiled: dict | None, scale: Scale) -> Result:
    if not eager or not compiled or "skipped" in eager or "skipped" in compiled:
        return "not run: needs both an eager and a compiled measurement", "", None
    speedup = compiled["tokens_per_sec"] / eager["tokens_per_sec"]
    memory = compiled["peak_memory_mib"] / eager["peak_memory_mib"]  # of the timed steps, after compilation
    warmup = compiled["warmup_peak_memory_mib"] / eager["warmup_peak_memory_mib"]
    device = torch.device(scale.device)
    loss_chunks = compiled["micro_batch_size"] * compiled_loss_bytes_per_sequence(
        bench.PRESETS[scale.model], scale.seq_len, pick_dtype(scale.dtype, device), loss_chunk_tokens(device)) / MiB
    bound = COMPILED_MAX_MEMORY * eager["peak_memory_mib"] + loss_chunks
    return (f"{speedup:.2f}× the tokens/s, {memory:.2f}× the peak memory ({warmup:.2f}× in the warm-up steps, where "
            f"compiling and autotuning allocate too): {compiled['peak_memory_mib'] / 1024:,.1f} GiB against "
            f"{bound / 1024:,.1f}",
            f"≥ {COMPILED_MIN_SPEEDUP:g}× as fast; peak ≤ {COMPILED_MAX_MEMORY:g}× eager's + the loss's chunks held "
            f"at once ({loss_chunks / 1024:,.1f} GiB at B={compiled['micro_batch_size']})",
            speedup >= COMPILED_MIN_SPEEDUP and compiled["peak_memory_mib"] <= bound)


STAGE_RUNNERS = {"tests": tests_stage, "train": train_stage, "bench": bench_stage}


# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for report.md, report.json and the runs' output")
    parser.add_argument("--stage", choices=("all", *STAGES), default="all", help="run one stage, or all three")
    parser.add_argument("--data_dir", help="real *_train_* / *_val_* shards (default: learnable random tokens)")
    parser.add_argument("--hellaswag_path", help="a local hellaswag_val.jsonl (without it HellaSwag is skipped)")
    parser.add_argument("--cpu-smoke", dest="cpu_smoke", action="store_true",
                        help="every stage on the CPU at a tiny size, in about a minute: checks the command itself")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        raise UserError(f"no CUDA GPU here (torch {torch.__version__}, {build}): "
                        "gpu_check.py measures GPUs. Run it on a machine with one, or check the command itself on the "
                        "CPU with --cpu-smoke.")
    scale = CPU_SMOKE if args.cpu_smoke else GPU
    if args.cpu_smoke:  # tiny models: a second thread per process only spin-waits (and the subprocesses inherit it)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = torch.device("cuda", 0) if scale.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, machine_info(device), scale)
    for stage in STAGES if args.stage == "all" else (args.stage,):
        print(f"--- stage {stage}", flush=True)
        started = time.perf_counter()
        STAGE_RUNNERS[stage](report, scale, args)
        report.check(stage, "wall time", within_budget, time.perf_counter() - started, scale.stage_seconds)
    counts = {v: sum(r.verdict == v for r in report.rows) for v in ("PASS", "FAIL", "SKIP")}
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped: {out / 'report.md'}")
    if report.failed:
        sys.exit(1)


if __name__ == "__main__":
    run_entry_point(lambda: main(sys.argv[1:]))

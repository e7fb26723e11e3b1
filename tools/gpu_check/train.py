"""gpu_check.py's train stage (not a command): train_gpt2.py for a few hundred steps on the 124M recipe's schedule,
shortened, with validation, HellaSwag and samples on the way, read back from its metrics.jsonl."""

import argparse
import ast
import json
import math
import os
import re
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dataloader import write_shard
from tools.gpu_check.report import ROOT, Report, Result, first_line, run_logged
from tools.gpu_check.scale import Scale
from training.config import TrainConfig
from training.tokenizer import gpt2_encoding


def tokenizer_problem() -> str | None:
    """Why the GPT-2 tokenizer cannot be loaded here (samples and HellaSwag need it), or None if it can."""
    try:
        gpt2_encoding()
        return None
    except Exception as e:  # no cache and no network: tiktoken's errors vary
        return (f"the GPT-2 tokenizer could not be loaded ({type(e).__name__}); point TIKTOKEN_CACHE_DIR at a copy "
                "of tiktoken's cache (README, GPU acceptance)")


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
    hellaswag = args.eval_dir is not None and no_tokenizer is None
    samples = no_tokenizer is None
    skip_reason = no_tokenizer or "no --eval_dir given (the machine has no network to download HellaSwag)"
    # The 124M recipe's schedule (TrainConfig's defaults: 715 warmup steps of 19,073), shortened to train_steps.
    warmup = max(1, round(TrainConfig.warmup_steps * scale.train_steps / TrainConfig.max_steps))
    every = str(scale.eval_every)
    command = [sys.executable, str(ROOT / "train_gpt2.py"), "--device", scale.device, "--dtype", scale.dtype,
               "--model", scale.model, "--seq_len", str(scale.seq_len), "--micro_batch_size", "auto",
               "--total_batch_size", str(scale.train_batch), "--max_steps", str(scale.train_steps),
               "--warmup_steps", str(warmup), "--max_lr", str(scale.max_lr), "--data_dir", str(data_dir),
               "--val_every", every, "--val_tokens", str(scale.val_tokens), "--sample_every", every if samples else "0",
               "--eval_every", every if hellaswag else "0", "--eval_limit", str(scale.hellaswag_limit),
               "--snapshot_every", "0", "--log_dir", str(log_dir), *(["--compile"] if scale.compile else []),
               *(["--eval_dir", args.eval_dir] if hellaswag else [])]
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

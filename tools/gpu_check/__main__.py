"""The GPU acceptance run: one command checks every GPU path of this codebase, measures its speed, and gives each
check a verdict.

    python -m tools.gpu_check --out gpu_report                 # all three stages, under 20 minutes on one H100
    python -m tools.gpu_check --out gpu_report --stage bench   # one stage: tests, bench or train
    python -m tools.gpu_check --out gpu_report --data_dir data/fineweb_edu10B --eval_dir data/evals
    python -m tools.gpu_check --out /tmp/smoke --cpu-smoke     # every stage on the CPU at a tiny size (the CPU suite)
    python -m tools.gpu_check --out perf_report --stage perf --data_dir data/enwiki   # issue 52's lease, 9 minutes

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
  perf   only when named: issue 52's goal table in one process, every row against the full-logits baseline measured
         in it (tools/gpu_check_perf.py): ours, --fp8_head's speed and a short run's val loss with and without it, the
         attention kernel the compiled step runs and cuDNN's, the compiled loss's memory, Muon against AdamW,
         --arch modern's step, a compile mode; a row that would not fit the stage's 9 minutes is reported as not run

OUT/report.md and OUT/report.json (rewritten after every check, so a run cut short still leaves its rows) hold the
machine (GPU, compute capability, memory, driver, torch, CUDA) and a row per check: its figure, its bound, and PASS,
FAIL or SKIP (with the reason). Exit status 0 when nothing failed, 1 when something did, 2 without a CUDA GPU.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from tools.gpu_check.bench import bench_stage
from tools.gpu_check.perf import perf_stage
from tools.gpu_check.report import Report, machine_info, within_budget
from tools.gpu_check.scale import CPU_SMOKE, GPU
from tools.gpu_check.tests import tests_stage
from tools.gpu_check.train import train_stage
from training.errors import UserError, run_entry_point

STAGE_RUNNERS = {"tests": tests_stage, "train": train_stage, "bench": bench_stage, "perf": perf_stage}
STAGES = ("tests", "train", "bench")  # --stage all, in this order; perf (issue 52's lease) runs on its own


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for report.md, report.json and the runs' output")
    parser.add_argument("--stage", choices=("all", *STAGE_RUNNERS), default="all",
                        help="run one stage, or all three (tests, train, bench; perf runs only when named)")
    parser.add_argument("--data_dir", help="real *_train_* / *_val_* shards (default: learnable random tokens)")
    parser.add_argument("--eval_dir", help="a directory holding hellaswag.jsonl, as train_gpt2.py's --eval_dir "
                                           "(without it HellaSwag is skipped)")
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
        budget = scale.perf.seconds if stage == "perf" else scale.stage_seconds
        report.check(stage, "wall time", within_budget, time.perf_counter() - started,
                     budget if scale.device == "cuda" else None)
    counts = {v: sum(r.verdict == v for r in report.rows) for v in ("PASS", "FAIL", "SKIP")}
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped: {out / 'report.md'}")
    if report.failed:
        sys.exit(1)


if __name__ == "__main__":
    run_entry_point(lambda: main(sys.argv[1:]))

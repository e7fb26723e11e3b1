"""What the zero-shot tasks cost a training run: evals.Suite (tokenizing, once per run) and evals.evaluate (scoring,
every --eval_every steps) for a model preset on this device, in the run's autocast dtype, against the time of
bench.py's real training step of the same model: the README's "share of training time" figures.

    python -m dev.eval_cost --tasks hellaswag --eval_dir DIR   # DIR holding hellaswag.jsonl; the quickstart model

The weights are random: scoring takes as long for trained ones. Defaults: the quickstart recipe's model and step
(small, 8 × 256 tokens, 2 micro-steps) and TrainConfig's --eval_every.
"""

import argparse
import tempfile
import time

from evaluation import tasks as evals
from model import GPT, PRESETS
from tools.bench.step import make_workload, time_config, write_random_shard
from training.config import TrainConfig
from training.distributed import setup_distributed
from training.precision import dtype_name, pick_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", choices=list(PRESETS))
    parser.add_argument("--tasks", default="hellaswag", help="as --eval_tasks")
    parser.add_argument("--eval_dir")
    parser.add_argument("--limit", type=int, help="the first N documents of each task")
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--grad_accum_steps", type=int, default=2)
    parser.add_argument("--eval_every", type=int, default=TrainConfig.eval_every)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    dist_env = setup_distributed(args.device)
    device, dtype = dist_env.device, pick_dtype("auto", dist_env.device)

    work = make_workload(dist_env, args.grad_accum_steps, model=args.model, micro_batch_size=args.micro_batch_size,
                         seq_len=args.seq_len, device=args.device)
    with tempfile.TemporaryDirectory() as data_dir:
        write_random_shard(data_dir, work, work.plan.model_config.vocab_size)
        step = time_config(work, data_dir, dtype, compile=False, plain=False, steps=5, warmup=1)
    step_seconds = step["ms_per_step"] / 1000

    names = evals.parse_task_names(args.tasks, "--tasks")
    docs = evals.load_tasks(names, args.eval_dir, args.limit)
    model = GPT(work.plan.model_config).to(device)
    start = time.perf_counter()
    suite = evals.Suite(docs, model.config.block_size, args.micro_batch_size * args.seq_len)
    tokenize_seconds = time.perf_counter() - start
    start = time.perf_counter()
    evals.evaluate(model, suite, device, dtype, progress=True)
    score_seconds = time.perf_counter() - start

    documents = sum(len(task_docs) for task_docs in docs.values())
    print(f"{args.model} on {device} ({dtype_name(dtype)}), tasks {', '.join(names)}: {documents:,} documents, "
          f"{len(suite.requests):,} requests, {sum(len(r.tokens) for r in suite.requests):,} tokens, "
          f"{sum(len(r.targets) for r in suite.requests):,} scored, {len(suite.batches)} batches of ≤ "
          f"{args.micro_batch_size * args.seq_len:,} tokens")
    print(f"tokenizing (once per run): {tokenize_seconds:.1f} s; scoring: {score_seconds:.1f} s "
          f"({1000 * score_seconds / documents:.1f} ms a document)")
    print(f"training step: {step['ms_per_step']:.0f} ms ({work.tokens_per_step:,} tokens); every {args.eval_every} "
          f"steps the tasks add {score_seconds / (args.eval_every * step_seconds):.1%} to the training time")


if __name__ == "__main__":
    main()

"""Evaluate a model: the validation loss on any shard directory, and zero-shot tasks scored as lm-evaluation-harness
0.4 scores them (evals.py: hellaswag, lambada_openai, piqa, winogrande, arc_easy, arc_challenge, openbookqa, sciq,
copa, boolq), for a snapshot of ours (a snapshot_*.pt file or an fsdp run's snapshot directory) or for OpenAI's GPT-2
(a hub name or a Hugging Face directory; an export of ours is read with its tokenizer).

    python -m tools.evaluate --snapshot logs/snapshot_0019072.pt           # what the run logged, from its own flags
    python -m tools.evaluate --model gpt2 --tasks all --no-val --json      # the harness's zero-shot table
    torchrun --standalone --nproc_per_node=8 -m tools.evaluate --snapshot logs/snapshot_0019072 --tasks hellaswag,piqa

For a snapshot, --data_dir, --micro_batch_size, --seq_len, --val_tokens, --dtype, --eval_dir and --limit default to
the training run's own (saved in the snapshot), so the numbers are the ones that run logged: the validation loss of
snapshot_<k> (the weights after step k) is the val_loss logged at step k + 1, since a run validates before each
step's update. The validation is train_gpt2.py's own code (validation.py), with the batches split over the ranks as
in training: with --val_tokens the same tokens, and the same loss, for any number of ranks. The tasks' batches are
split over the ranks too, and give the one-process numbers bit for bit.
"""

import argparse
import json
import sys
from dataclasses import fields

import torch

from dataloader import DistributedDataLoader, read_data_tokenizer
from evaluation import tasks as evals
from evaluation.validation import validation_loss
from model import GPT
from rundir.snapshot import load_model_snapshot, read_model
from training import hf
from training.config import HelpFormatter, TrainConfig, add_flags, check_flag_ranges, validation_steps
from training.distributed import Distributed, checked_device, setup_distributed, teardown_distributed
from training.errors import UserError, run_entry_point
from training.inputs import val_shard_tokens
from training.precision import pick_dtype
from training.tokenizer import TokenizerSpec, check_tokenizer, load_tokenizer_of, read_tokenizer, tokenizer_of

# The training flags that decide the numbers; a snapshot's own values are their defaults.
RUN_FLAGS = ["data_dir", "micro_batch_size", "seq_len", "val_tokens", "dtype", "eval_dir"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--snapshot", help="a snapshot of train_gpt2.py: a snapshot_*.pt file or an fsdp "
                                                   "snapshot directory (or a file with just its model)")
    source.add_argument("--model", help="OpenAI's weights from Hugging Face: gpt2, gpt2-medium, gpt2-large, "
                                        "gpt2-xl, or a local save_pretrained directory (tools.export_hf's: with its "
                                        "tokenizer)")
    add_flags(parser, RUN_FLAGS + ["device"])
    parser.add_argument("--val", action=argparse.BooleanOptionalAction, default=True,
                        help="the validation loss (--no-val: the tasks only)")
    parser.add_argument("--tasks", help="zero-shot tasks, scored as lm-evaluation-harness 0.4 does: a comma-separated "
                                        f"list of {', '.join(evals.TASKS)}, or all")
    parser.add_argument("--limit", type=int, default=None, help="only the first N documents of each task")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line on stdout")
    source_args = parser.parse_known_args(argv)[0]
    task_names(source_args)  # a bad name, or a device this machine lacks, fails before the model loads
    checked_device(source_args.device)
    model, tokenizer, run_config, step = load_model(source_args.snapshot, source_args.model)
    # A snapshot's run decides the defaults (flags given on the command line still win).
    parser.set_defaults(**{k: v for k, v in run_config.items() if k in RUN_FLAGS}, limit=run_config.get("eval_limit"))
    args = parser.parse_args(argv)

    dist_env = setup_distributed(args.device)
    try:
        results = evaluate(model, tokenizer, args, dist_env)
    finally:
        teardown_distributed()
    if dist_env.is_master:
        results = {"model": args.snapshot or args.model, "step": step} | results
        if args.json:
            print(json.dumps(results))
        else:
            print("\n".join(f"{key}: {value}" for key, value in results.items()))


def task_names(args: argparse.Namespace) -> list[str]:
    return evals.parse_task_names(args.tasks, "--tasks") if args.tasks else []


def load_model(snapshot: str | None, hf_name: str | None) -> tuple[GPT, TokenizerSpec, dict, int | None]:
    """The model on the CPU, with the tokenizer it was trained with (read_tokenizer), and the flags and the last
    trained step of the run that wrote it ({} and None for Hugging Face weights)."""
    try:
        if hf_name is not None:
            return hf.from_pretrained(hf_name), read_tokenizer(hf_name), {}, None
        model = read_model(snapshot)
        saved = load_model_snapshot(snapshot)
        tokenizer = tokenizer_of(saved, snapshot)
    except (FileNotFoundError, ValueError) as e:  # the message names the file and what to pass instead
        hint = "" if hf_name else " (For OpenAI's weights use --model gpt2.)"
        raise UserError(f"{'--model' if hf_name else '--snapshot'}: {e}{hint}") from e
    return model, tokenizer, saved.get("config", {}), saved.get("step")


def evaluate(model: GPT, tokenizer: TokenizerSpec, args: argparse.Namespace, dist_env: Distributed) -> dict:
    """The validation loss and the tasks' metrics, each rank doing its share; every rank returns the same. tokenizer:
    the model's, which the val data must have been written with and the tasks are read with."""
    device, results = dist_env.device, {}
    torch.set_float32_matmul_precision("high")  # as in training (TF32 on GPUs that have it)
    dtype = pick_dtype(args.dtype, device)
    model.to(device)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if f.name in RUN_FLAGS})
    check_flag_ranges(cfg)
    if not isinstance(cfg.micro_batch_size, int):
        raise UserError("--micro_batch_size auto is for training; pass a number of sequences (a snapshot passes the "
                        "one its run used).")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: the number of documents of each task to score, 1 or more (leave it "
                        "out for all of them).")
    seq_len = cfg.seq_len or model.config.block_size
    if args.val:
        if seq_len > model.config.block_size:
            raise UserError(f"--seq_len {seq_len} exceeds the model's block_size {model.config.block_size}; pass "
                            f"--seq_len {model.config.block_size} or less.")
        val_steps = validation_steps(cfg, seq_len, dist_env.world_size, val_shard_tokens(cfg.data_dir))
        check_tokenizer(args.snapshot or args.model, tokenizer, cfg.data_dir, read_data_tokenizer(cfg.data_dir),
                        "Pass the --data_dir of data written with its tokenizer, or --no-val for the tasks only.")
        loader = DistributedDataLoader(cfg.data_dir, "val", cfg.micro_batch_size, seq_len, dist_env.rank,
                                       dist_env.world_size, vocab_size=model.config.vocab_size)
        val = validation_loss(model, loader, val_steps, device, dtype)
        results |= {"val_loss": val.loss, "val_bpb": val.bpb}
        results["val_tokens"] = val_steps * cfg.micro_batch_size * seq_len * dist_env.world_size
    names = task_names(args)
    if names:
        docs = evals.load_tasks(names, cfg.eval_dir, args.limit, dist_env.local_rank, device)
        # Batches of --micro_batch_size × --seq_len tokens: what a training micro-step holds, with its backward.
        suite = evals.Suite(docs, model.config.block_size, cfg.micro_batch_size * seq_len,
                            load_tokenizer_of(args.snapshot or args.model))
        results |= evals.evaluate(model, suite, device, dtype, dist_env.rank, dist_env.world_size,
                                  progress=dist_env.is_master and not args.json)
        results |= {f"{name}/docs": len(task_docs) for name, task_docs in docs.items()}
    return results


if __name__ == "__main__":
    run_entry_point(lambda: main(sys.argv[1:]))

"""A short training run's val loss (not a command: tools/gpu_check.py --stage perf runs it with and without
--fp8_head): train_gpt2.py's step and LR schedule for a few hundred steps from the same seed on the same tokens, then
validation, in one process."""

import time

import torch

from dataloader import DistributedDataLoader
from evaluation.validation import validation_loss
from model import GPT
from tools.bench.step import Workload, release_memory
from training.config import validation_steps
from training.inputs import val_shard_tokens
from training.optim import get_lr
from training.parallel import build_training_model
from training.step import train_step


def short_run(work: Workload, data_dir: str, dtype: torch.dtype, compile: bool) -> dict:
    """Train a fresh model for work.cfg.max_steps steps on its warmup and schedule, then validate it on
    work.cfg.val_tokens (at most the val shards'): every step's loss, the val loss, and the seconds of each part.
    Validation runs the uncompiled model (a compiled one would compile again, without gradients), in the autocast
    dtype (as linear_cross_entropy does with --fp8_head: the val loss measures the weights)."""
    try:
        return train_and_validate(work, data_dir, dtype, compile)
    finally:
        release_memory(work.dist_env.device)


def train_and_validate(work: Workload, data_dir: str, dtype: torch.dtype, compile: bool) -> dict:
    device, dist_env, cfg, plan = work.dist_env.device, work.dist_env, work.cfg, work.plan
    torch.set_float32_matmul_precision("high")
    torch.manual_seed(cfg.seed)
    trainee = build_training_model(GPT(plan.model_config), dist_env, dtype, cfg, compile)
    loader = DistributedDataLoader(data_dir, "train", cfg.micro_batch_size, plan.seq_len, dist_env.rank,
                                   dist_env.world_size, plan.grad_accum_steps)
    started = time.perf_counter()
    losses = [train_step(trainee.model, trainee.optimizer, trainee.scaler, loader, plan.grad_accum_steps,
                         get_lr(step, cfg), cfg.grad_clip, device, dtype).loss for step in range(cfg.max_steps)]
    trained = time.perf_counter()
    val_loader = DistributedDataLoader(data_dir, "val", cfg.micro_batch_size, plan.seq_len, dist_env.rank,
                                       dist_env.world_size)
    val_steps = validation_steps(cfg, plan.seq_len, dist_env.world_size, val_shard_tokens(data_dir))
    val = validation_loss(trainee.raw, val_loader, val_steps, device, dtype)
    return {"losses": losses, "val_loss": val.loss, "train_seconds": trained - started,
            "val_seconds": time.perf_counter() - trained, "tokens": cfg.max_steps * work.tokens_per_step}

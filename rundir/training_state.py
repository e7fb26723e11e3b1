"""What a snapshot holds: everything a run needs to continue exactly after a step, captured and restored."""

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from dataloader import DistributedDataLoader
from rundir import snapshot
from training.distributed import Distributed, any_rank, from_all_ranks, is_dtensor
from training.errors import UserError
from training.parallel import TrainingModel
from training.tokenizer import check_tokenizer, tokenizer_of


class TrainingState:
    """A run's state on this rank; stateful: {name: object with state_dict() and load_state_dict()} (the guard)."""

    def __init__(self, trainee: TrainingModel, train_loader: DistributedDataLoader, run_config: dict,
                 dist_env: Distributed, print0: Callable[[str], None], stateful: dict | None = None):
        self.trainee, self.train_loader, self.run_config = trainee, train_loader, run_config
        self.dist_env, self.print0, self.stateful = dist_env, print0, stateful or {}

    def finite(self) -> bool:
        """Whether every weight and optimizer tensor is finite on every rank: a sum is NaN or inf if any value is."""
        optimizer_state = (v for optimizer in self.trainee.optimizer for s in optimizer.state.values()
                           for v in s.values() if torch.is_tensor(v))
        tensors = [t.to_local() if is_dtensor(t) else t for t in (*self.trainee.raw.parameters(), *optimizer_state)]
        finite = bool(torch.stack([t.sum() for t in tensors]).isfinite().all())
        return not any_rank(not finite, self.dist_env.device)

    def capture(self, step: int, healthy: bool, run: str) -> dict | None:
        """Everything to continue exactly after `step` (fsdp: but the sharded model and optimizer); rank 0 gets it."""
        rng_states = from_all_ranks(capture_rng_state(self.dist_env.device))
        if not self.dist_env.is_master:
            return None
        t = self.trainee
        state = {"format": snapshot.FORMAT, "model_config": asdict(t.raw.config), "scaler": t.scaler.state_dict(),
                 "step": step, "loader": self.train_loader.state_dict(), "rng": rng_states, "config": self.run_config,
                 "wandb_id": run, "healthy": healthy, "tokenizer": self.train_loader.tokenizer.to_dict()}
        state |= {name: each.state_dict() for name, each in self.stateful.items()}
        return state | ({} if t.sharded else {"model": t.raw.state_dict(), "optimizer": t.optimizer.state_dict()})

    def restore(self, path: str, state: dict, data_position: bool = True) -> None:
        """Restore everything `state` holds (the data loader's position only if data_position)."""
        t, dist_env = self.trainee, self.dist_env
        # First: another tokenizer's data usually means another vocabulary too, and the model's shape is not the cause
        data = self.run_config["data_mix"] or self.run_config["data_dir"]
        check_tokenizer(path, tokenizer_of(state, path), data, self.train_loader.tokenizer, "Resume it on data written "
                        "with its tokenizer (--data_dir or --data_mix), or start a new run on this data with --resume "
                        "never.")
        kind, written = "fsdp" if Path(path).is_dir() else "ddp", asdict(snapshot.model_config_of(state, path))
        differ = [f"{what} {theirs} (this run: {ours})" for what, theirs, ours in (
            ("a model", written, asdict(t.raw.config)), ("--parallel", kind, t.parallel),
            ("--optimizer", state["config"]["optimizer"], self.run_config["optimizer"])) if theirs != ours]
        if differ:  # (the optimizer states of another optimizer, or of another layout, do not convert)
            raise UserError(f"{path} was written with {'; '.join(differ)}. Resume it with the flags of the run that "
                            "wrote it (--arch/--model/--n_layer/--n_head/--n_embd/--block_size/--[no-]attention_bias, "
                            "--optimizer; --parallel on any number of ranks), or start a new run from its weights "
                            f"with --init_from {path} (a fresh optimizer, schedule and data order).")
        if t.sharded:  # each rank reads its own shards, resharded if the number of ranks changed
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # (fsdp's: lazily)

            from training.safe_load_shards import load_shards

            model_state, optimizer_state = get_state_dict(t.raw, list(t.optimizer))
            loaded = {"model": model_state, "optimizer": optimizer_state}
            load_shards(loaded, Path(path))
            set_state_dict(t.raw, list(t.optimizer), model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optimizer"])
        else:
            t.raw.load_state_dict(state["model"])
            t.optimizer.load_state_dict(state["optimizer"])
        if t.scaler.is_enabled() and not state["scaler"]:  # a bf16 or fp32 run continued in fp16: no scale to carry
            self.print0(f"{path} was written without fp16, so it has no GradScaler state: the fp16 loss scale starts "
                        "fresh.")
        else:  # (a disabled scaler ignores the state of an fp16 snapshot continued in bf16 or fp32)
            t.scaler.load_state_dict(state["scaler"])
        if data_position:
            self.train_loader.load_state_dict(state["loader"])
        for name, each in self.stateful.items():
            each.load_state_dict(state[name])
        if len(state["rng"]) == dist_env.world_size:
            restore_rng_state(state["rng"][dist_env.rank], dist_env.device)
        else:  # a different number of ranks: the data position carries over exactly (see dataloader.py)
            torch.manual_seed(self.run_config["seed"] + state["step"] + dist_env.rank)


def capture_rng_state(device: torch.device) -> dict:
    """Torch's CPU generator and the training device's (only that one: asking CUDA on a --device cpu run would open a
    CUDA context on GPU 0). Nothing draws from Python's or numpy's global ones (dataloader.py seeds its own)."""
    return {"torch": torch.get_rng_state()} | (
        {"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else
        {"mps": torch.mps.get_rng_state()} if device.type == "mps" else {})


def restore_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    elif device.type == "mps" and "mps" in state:
        torch.mps.set_rng_state(state["mps"])

"""The model as a run trains it (build_training_model, for train_gpt2.py and bench.py): on its device, sharded (fsdp)
or replicated (ddp), compiled, with its optimizer and GradScaler."""

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT
from training.config import TrainConfig
from training.distributed import Distributed, is_loaded_instance
from training.errors import UserError
from training.fp8 import check_fp8_head
from training.optim import Optimizers, build_optimizers
from training.recompute import set_activation_checkpointing


@dataclass
class TrainingModel:
    raw: torch.nn.Module  # the GPT itself (with fsdp: its parameters are shards): state_dict, validation
    model: torch.nn.Module  # what the training step calls: compiled and/or DDP-wrapped
    optimizer: Optimizers
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    parallel: str = "ddp"  # or "fsdp"

    @property
    def sharded(self) -> bool:
        return self.parallel == "fsdp"

    def full_model(self) -> torch.nn.Module:
        """A GPT with all of its weights, for the zero-shot tasks and sampling (with fsdp a collective: every rank
        gets its own unsharded copy)."""
        if not self.sharded:
            return self.raw
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # (fsdp's: lazily)

        # The gathered tensors become the parameters of a copy built on the meta device: no random init.
        full = get_model_state_dict(self.raw, options=StateDictOptions(full_state_dict=True))
        with torch.device("meta"):
            copy = GPT(self.raw.config)
        copy.load_state_dict(full, assign=True)
        copy.tie_weights()  # assigning replaced GPT-2's tied parameter by two tensors
        return copy


def build_training_model(raw_model: torch.nn.Module, dist_env: Distributed, dtype: torch.dtype, cfg: TrainConfig,
                         compile: bool, plain: bool = False, parallel: str = "ddp",
                         compile_mode: str | None = None) -> TrainingModel:
    """The model on its device (ddp) or sharded onto it (fsdp), with cfg's --activation_checkpointing, --fp8_head and
    optimizers, compiled, DDP-wrapped on several ranks. plain: bench.py's baseline, the for-loop AdamW, not fused."""
    device = dist_env.device
    if compile and device.type == "mps":
        raise UserError("--compile is not supported on MPS (torch.compile's MPS backend is experimental and fails "
                        "on this model); leave --compile out.")
    if cfg.fp8_head:
        check_fp8_head(device, dtype, cfg.micro_batch_size * (cfg.seq_len or raw_model.config.block_size),
                       raw_model.config.n_embd)
        raw_model.fp8_head = True
    if parallel == "fsdp" and dtype == torch.float16:
        raise UserError("--parallel fsdp with fp16 is not supported (its loss scaling would need a sharded "
                        "GradScaler): use --dtype bf16 on GPUs that have it, --dtype fp32, or --parallel ddp.")
    if parallel == "fsdp":
        # From the CPU: fully_shard moves one unit at a time and keeps this rank's shard, so no GPU holds it whole.
        shard(raw_model, dtype, init_device_mesh(device.type, (dist_env.world_size,)))
    else:
        raw_model = raw_model.to(device)
    set_activation_checkpointing(raw_model, cfg.activation_checkpointing)
    optimizer = build_optimizers(raw_model, cfg, device.type, fused=not plain,
                                 shared=dist_env.world_size > 1 or parallel == "fsdp")
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    model = torch.compile(raw_model, mode=compile_mode) if compile else raw_model
    if dist_env.world_size > 1 and parallel == "ddp":
        # (The only buffers, modern's rotation tables, are the same constants everywhere: none to send every step.)
        model = DDP(model, device_ids=[dist_env.local_rank] if device.type == "cuda" else None,
                    broadcast_buffers=False)
    return TrainingModel(raw_model, model, optimizer, scaler, parallel)


def shard(model: torch.nn.Module, dtype: torch.dtype, mesh: DeviceMesh) -> None:
    """FSDP2, in place: each Block a shard group (gathered just before it runs, freed after), the rest the root's;
    under bf16, weights gathered in bf16 and gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # (imported by fsdp runs alone: a second)

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if dtype == torch.bfloat16 else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """Whether this backward pass reduces gradients across ranks (DDP: all-reduce; FSDP: reduce-scatter)."""
    inner = getattr(model, "_orig_mod", model)  # under torch.compile
    if isinstance(model, DDP):
        model.require_backward_grad_sync = sync
    elif is_loaded_instance(inner, "torch.distributed.fsdp", "FSDPModule"):
        inner.set_requires_gradient_sync(sync)

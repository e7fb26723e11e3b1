"""--activation_checkpointing (docs/memory.md): what each Block keeps for backward and recomputes instead, as
Block.recompute (model.py knows no modes), a function that runs its residual branches under torch's checkpoint."""

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from model import GPT

ACTIVATION_CHECKPOINTING = ("none", "blocks", "selective")

# "selective" keeps these ops' outputs (most of a block's time); the cheap ops between them are run again.
KEPT_BY_SELECTIVE_CHECKPOINTING = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                                   torch.ops.aten._scaled_dot_product_flash_attention.default,
                                   torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                                   torch.ops.aten._scaled_dot_product_efficient_attention.default,
                                   torch.ops.aten._scaled_dot_product_cudnn_attention.default}


def keep_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_BY_SELECTIVE_CHECKPOINTING else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_the_block(residual_branches, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # (the positions too: modern's rotation reads them)
    return checkpoint(residual_branches, x, None, positions, use_reentrant=False)


def recompute_cheap_ops(residual_branches, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # (The partial made here, in the traced code: torch.compile follows no other kind of context_fn.)
    return checkpoint(residual_branches, x, None, positions, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, keep_matmuls_and_attention))


RECOMPUTE = {"none": None, "blocks": recompute_the_block, "selective": recompute_cheap_ops}


def set_activation_checkpointing(model: GPT, mode: str) -> None:
    for block in model.transformer.h:
        block.recompute = RECOMPUTE[mode]

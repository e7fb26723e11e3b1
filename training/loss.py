"""The training loss of GPT.forward: the output layer and cross-entropy in one, a chunk of tokens at a time, never
holding the (tokens × vocab) logits whole; with --fp8_head, its matmuls in FP8 (fp8.py)."""

from typing import NamedTuple

import torch

from training import fp8


class HeadOperands(NamedTuple):
    """x (n, C) and w (padded_vocab, C) as the chunks' matmuls read them: in the autocast dtype, or (--fp8_head) in
    e4m3 with their scales and the gradient's."""
    x: torch.Tensor
    w: torch.Tensor
    w_columns: torch.Tensor  # w column-major, as torch._scaled_mm takes its second operand (not FP8: w itself)
    x_scale: torch.Tensor | None = None  # None: not FP8
    w_scale: torch.Tensor | None = None
    grad_scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.x_scale is not None


def head_operands(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, use_fp8: bool) -> HeadOperands:
    """Cast once to dtype, or quantised once to FP8, for every chunk."""
    if not use_fp8:
        w = weight.to(dtype)
        return HeadOperands(x.to(dtype), w, w)
    (x8, x_scale), (w8, w_scale) = fp8.to_e4m3(x), fp8.to_e4m3(weight)
    grad_scale = torch.tensor(1 / fp8.E5M2_MAX, dtype=torch.float32, device=x.device)  # gradient_to_e5m2's
    return HeadOperands(x8, w8, fp8.column_major(w8), x_scale, w_scale, grad_scale)


def head_grad_w(grad_logits: torch.Tensor, x: torch.Tensor, grad_scale: torch.Tensor | None,
                x_scale: torch.Tensor | None) -> torch.Tensor:
    """grad_logitsᵀ @ x (padded_vocab, C): in the autocast dtype, or in fp32 under FP8."""
    if x_scale is None:
        return grad_logits.t() @ x
    return fp8.scaled_mm(grad_logits.t().contiguous(), fp8.column_major(x), grad_scale, x_scale, torch.float32)


def add_weight_gradient(grad_w: torch.Tensor, grad_logits: torch.Tensor, ops: HeadOperands) -> None:
    """grad_w (fp32) += the chunk's gradient of the weight, the product added as it is, without a cast copy."""
    grad_w += head_grad_w(grad_logits, ops.x, ops.grad_scale, ops.x_scale)


def cross_entropy_chunk(ops: HeadOperands, targets: torch.Tensor, vocab_size: int,
                        grads: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Summed cross-entropy of a chunk (ops.x, n rows) against w's first vocab_size rows; grads = (grad_x (n, C),
    grad_w (fp32)): writes the chunk's gradient of x and adds w's, unscaled. A function: its logits die with it."""
    # The matmul runs at the padded width, a multiple of 128, where GPUs have their fastest kernels (at 50,257 an
    # H100 falls back to an older, slower one); the padding columns get no probability, so neither loss nor gradient.
    columns = torch.arange(ops.w.size(0), device=ops.x.device)
    logits = (fp8.scaled_mm(ops.x, ops.w.t(), ops.x_scale, ops.w_scale, torch.bfloat16, fast_accum=True) if ops.fp8
              else ops.x @ ops.w.t())  # (n, padded_vocab); under FP8 in bf16, with Hopper's fast accumulation
    logits = logits.float().masked_fill_(columns >= vocab_size, float("-inf"))
    lse = torch.logsumexp(logits, dim=1)  # (n,)
    loss_sum = (lse - logits.gather(1, targets[:, None]).squeeze(1)).sum()
    if grads is not None:
        grad_x, grad_w = grads
        # d loss / d logits = softmax − one_hot(target). The mean's 1/N and grad_output are applied in fp32 in
        # backward: divided by N first, small probabilities would underflow in fp16 before the GradScaler's scale.
        if torch.compiler.is_compiling():
            # One expression, which Inductor fuses with the log-sum-exp into two passes over the logits in the
            # matmul's dtype, with no fp32 copy of them in memory (a scatter of the −1s would break the fusion).
            grad_logits = torch.exp(logits - lse[:, None]) - (columns == targets[:, None]).float()
        else:
            # In place: eager runs that expression as five ops, each a new fp32 tensor of the chunk's logits' size
            # (on a CPU the chunk took 3× as long).
            grad_logits = logits.sub_(lse[:, None]).exp_()
            grad_logits[torch.arange(len(targets), device=ops.x.device), targets] -= 1.0
        grad_logits = fp8.gradient_to_e5m2(grad_logits) if ops.fp8 else grad_logits.to(ops.x.dtype)
        grad_x.copy_(fp8.scaled_mm(grad_logits, ops.w_columns, ops.grad_scale, ops.w_scale, grad_x.dtype) if ops.fp8
                     else grad_logits @ ops.w)
        add_weight_gradient(grad_w, grad_logits, ops)
    return loss_sum


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of x @ weight[:vocab_size]ᵀ against targets, never holding all logits (with their fp32 copy
    most of a step's activations): forward turns each chunk's logits into the gradients of x and weight, backward
    only scales them by grad_output. The price: weight's fp32 gradient, held from forward on, whatever the batch."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                chunk_tokens: int, compute_grads: bool, use_fp8: bool) -> torch.Tensor:
        # x (N, C); weight (padded_vocab, C); targets (N,), every one a real token (no ignore_index): the loader checks
        # shards for ids outside the vocabulary before training starts.
        device_type = x.device.type
        # Under autocast, run the matmuls in its dtype as nn.Linear would; softmax and the sums stay in fp32.
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        n_tokens = x.size(0)
        with torch.autocast(device_type, enabled=False):  # every cast below is explicit
            ops = head_operands(x, weight, dtype, use_fp8)  # the weight cast once, for every chunk
            loss_sum = torch.zeros((), dtype=torch.float32, device=x.device)
            if compute_grads:
                grad_x = torch.empty(x.shape, dtype=dtype, device=x.device)  # (N, C)
                grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for start in range(0, n_tokens, chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                chunk_grads = (grad_x[rows], grad_w) if compute_grads else None
                loss_sum += cross_entropy_chunk(ops._replace(x=ops.x[rows]), targets[rows], vocab_size, chunk_grads)
        if compute_grads:
            ctx.save_for_backward(grad_x, grad_w)
        ctx.n_tokens, ctx.x_dtype, ctx.w_dtype = n_tokens, x.dtype, weight.dtype
        return loss_sum / n_tokens

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        scale = grad_loss.float() / ctx.n_tokens  # d mean / d sum, times whatever the loss was scaled by
        return (grad_x.float() * scale).to(ctx.x_dtype), (grad_w * scale).to(ctx.w_dtype), *[None] * 5


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                         chunk_tokens: int, fp8: bool = False) -> torch.Tensor:
    """F.cross_entropy(x @ weight[:vocab_size]ᵀ, targets), chunk_tokens rows at a time. fp8: the training step's
    matmuls in FP8 (validation, without gradients, stays in the autocast dtype: its loss measures the weights)."""
    # Decided here: inside forward, autograd has switched grad mode off (validation, under no_grad, wants none).
    compute_grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return ChunkedLinearCrossEntropy.apply(x, weight, targets, vocab_size, chunk_tokens, compute_grads,
                                           fp8 and compute_grads)


def loss_chunk_tokens(device: torch.device) -> int:
    """Tokens per chunk of the loss: on a GPU 4,096, a full-speed matmul whose logits (0.8 GiB in bf16) stay small
    beside the activations; on a CPU 1,024, measured fastest there."""
    return 4096 if device.type == "cuda" else 1024

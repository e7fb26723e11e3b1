"""FP8 operands for the chunked loss's three matmuls (--fp8_head, training/loss.py), by torch._scaled_mm: x and the
weight in e4m3 at per-tensor dynamic scales, the logits' gradient (softmax − one_hot) in e5m2, whose wider exponent
keeps more of its orders of magnitude, at the fixed scale its [−1, 1] range allows (docs/gpus.md)."""

import torch

from training.errors import UserError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3_MAX, E5M2_MAX = torch.finfo(E4M3).max, torch.finfo(E5M2).max  # 448, 57,344
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89), Hopper (sm90) and later
MULTIPLE = 16  # torch._scaled_mm on CUDA: every dimension of both operands a multiple of this


def fp8_head_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why --fp8_head cannot run on this device in this dtype, or None if it can."""
    if device.type != "cuda":
        return (f"it needs a CUDA GPU with FP8 tensor cores (sm89+: Ada, Hopper or later), and this run is on "
                f"{device.type}")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (f"it needs FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper), and this "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    if dtype != torch.bfloat16:
        return f"it runs beside bf16 autocast, and this run's --dtype is {str(dtype).removeprefix('torch.')}"
    return None


def check_fp8_head(device: torch.device, dtype: torch.dtype, tokens_per_micro_step: int, n_embd: int) -> None:
    """UserError naming --fp8_head unless the device, the dtype and the shapes suit torch._scaled_mm."""
    problem = fp8_head_problem(device, dtype)
    if problem is None and (tokens_per_micro_step % MULTIPLE or n_embd % MULTIPLE):
        problem = (f"its FP8 matmuls need the tokens of a micro-step ({tokens_per_micro_step}) and --n_embd "
                   f"({n_embd}) to be multiples of {MULTIPLE}")
    if problem:
        raise UserError(f"--fp8_head: {problem}. Leave --fp8_head out (the output layer then runs in bf16).")


def to_e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t in e4m3 and its per-tensor scale (t ≈ fp8 · scale; 1 for an all-zero t)."""
    amax = t.detach().abs().amax().float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (t.float() / scale).to(E4M3), scale


def gradient_to_e5m2(grad_logits: torch.Tensor) -> torch.Tensor:
    """softmax − one_hot in e5m2 at the fixed scale 1 / E5M2_MAX (the matmuls' grad_scale undoes it)."""
    return (grad_logits * E5M2_MAX).to(E5M2)


def column_major(t: torch.Tensor) -> torch.Tensor:
    """t laid out column by column, as torch._scaled_mm's second operand must be on CUDA (its first: row by row)."""
    return t.t().contiguous().t()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
              fast_accum: bool = False) -> torch.Tensor:
    """(a · scale_a) @ (b · scale_b) in out_dtype. fast_accum: Hopper's lower-precision accumulation (the loss, as
    modded-nanogpt, takes it for the forward's logits only)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)

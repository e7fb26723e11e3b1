"""FP8 operands for the output layer's three matmuls (--fp8_head): the logits, and the gradients of the hidden states
and of the weight, inside the chunked loss (training/loss.py), through torch._scaled_mm.

The formats are the usual pair (Micikevicius et al. 2022, "FP8 formats for deep learning"; modded-nanogpt's FP8 head
uses the same): e4m3 (3 mantissa bits, up to 448) for the hidden states and the weight, whose values sit in a known
range, and e5m2 (2 mantissa bits, up to 57,344, down to 2^-16) for the gradient of the logits, softmax − one_hot,
whose entries span many orders of magnitude (a token's probability can be 1e-9) and lose less to underflow with
e5m2's wider exponent. torch._scaled_mm multiplies the FP8 operands with fp32 accumulation and writes the product
in the dtype asked for; each operand comes with the scale that undoes its quantisation.

The scales. The gradient's is fixed: every entry of softmax − one_hot lies in [−1, 1], so 1 ↦ e5m2's largest value
uses all of its range and cannot overflow. The hidden states' and the weight's are per-tensor and dynamic (the
absolute maximum of this forward's tensor ↦ 448): modded-nanogpt fixes them (its hidden states ≤ 100, weights ≤ 1.6)
for its own model, whose output layer reads an RMSNorm without gain; ours reads a LayerNorm with a learned gain and
bias, and GPT-2's output weight is also its input embedding, so neither has a bound to fix a scale by. A maximum costs
one pass over each tensor per forward, little beside the matmuls that read them.
"""

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
    """--fp8_head's requirements, as a UserError naming the flag: the device and dtype, and shapes torch._scaled_mm
    takes."""
    problem = fp8_head_problem(device, dtype)
    if problem is None and (tokens_per_micro_step % MULTIPLE or n_embd % MULTIPLE):
        problem = (f"its FP8 matmuls need the tokens of a micro-step ({tokens_per_micro_step}) and --n_embd "
                   f"({n_embd}) to be multiples of {MULTIPLE}")
    if problem:
        raise UserError(f"--fp8_head: {problem}. Leave --fp8_head out (the output layer then runs in bf16).")


def tensor_scale(t: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """The per-tensor scale that maps t's largest magnitude to fp8_max: a 0-d fp32 tensor (1 for an all-zero t)."""
    amax = t.detach().abs().amax().float()
    return torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))


def to_e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t in e4m3 at its per-tensor scale, and the scale (t ≈ fp8 · scale)."""
    scale = tensor_scale(t, E4M3_MAX)
    return (t.float() / scale).to(E4M3), scale


def gradient_to_e5m2(grad_logits: torch.Tensor) -> torch.Tensor:
    """softmax − one_hot (every entry in [−1, 1]) in e5m2 at the fixed scale 1 / E5M2_MAX (see the module doc)."""
    return (grad_logits * E5M2_MAX).to(E5M2)


def gradient_scale(device: torch.device) -> torch.Tensor:
    """The scale that undoes gradient_to_e5m2, for torch._scaled_mm."""
    return torch.tensor(1 / E5M2_MAX, dtype=torch.float32, device=device)


def column_major(t: torch.Tensor) -> torch.Tensor:
    """t with the same shape and values, laid out column by column: what torch._scaled_mm's second operand must be
    on CUDA (its first must be row by row)."""
    return t.t().contiguous().t()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
              fast_accum: bool = False) -> torch.Tensor:
    """(a · scale_a) @ (b · scale_b) in out_dtype, a row-major and b column-major FP8. fast_accum: Hopper's faster
    accumulation, which adds the products in lower precision; modded-nanogpt takes it for the forward's logits only,
    and so does the loss."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)

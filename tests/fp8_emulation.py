"""The FP8 output layer (--fp8_head) by emulation, for tests/test_loss.py (torch._scaled_mm on the CPU) and
tests/gpu (on the device): written from the formats' definitions, not from fp8.py."""

import torch
import torch.nn.functional as F


def quantised(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t rounded to the FP8 dtype at this scale, and back, in fp32."""
    return (t.float() / scale).to(dtype).float() * scale


def emulated_fp8_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 head's mean loss and its gradients of x and weight: the operands quantised with the same scales (each
    tensor's largest magnitude at e4m3's 448; the gradient of the logits, in [−1, 1], with 1 at e5m2's 57,344) and
    back, the matmuls in fp32, the logits and the gradient of x rounded to bf16 as torch._scaled_mm writes them."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    x_scale, w_scale = x.abs().max() / 448, weight.abs().max() / 448
    xq, wq = quantised(x, x_scale, e4m3), quantised(weight, w_scale, e4m3)
    logits = (xq @ wq.t()).bfloat16().float()
    logits[:, vocab_size:] = float("-inf")
    loss = F.cross_entropy(logits, targets, reduction="sum") / len(targets)
    grad_logits = torch.softmax(logits, dim=1) - F.one_hot(targets, logits.size(1)).float()
    gq = quantised(grad_logits, torch.tensor(1 / 57344, device=x.device), e5m2)
    return loss, (gq @ wq).bfloat16().float() / len(targets), (gq.t() @ xq) / len(targets)


def fp8_case(tokens: int = 96, n_embd: int = 64, padded_vocab: int = 1024, vocab_size: int = 1000, seed: int = 0,
             device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states as a LayerNorm with a learned gain gives them, a weight at GPT-2's init scale, and targets
    (by default 96 tokens over a vocabulary of 1,000 padded to 1,024: multiples of 16, as torch._scaled_mm needs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n_embd, generator=g) * (1 + torch.rand(n_embd, generator=g))
    weight = 0.02 * torch.randn(padded_vocab, n_embd, generator=g)
    targets = torch.randint(0, vocab_size, (tokens,), generator=g)
    return x.to(device).requires_grad_(), weight.to(device).requires_grad_(), targets.to(device)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference, relative to expected's largest magnitude."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def reference_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                        out_dtype: torch.dtype | None = None, use_fast_accum: bool = False, **_) -> torch.Tensor:
    """torch._scaled_mm in plain fp32 arithmetic: the FP8 operands times their scales, multiplied, written in
    out_dtype. Where a CPU's own kernel is missing (oneDNN has FP8 matmuls only from AVX-512 on), tests stand it in."""
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype or torch.float32)


def cpu_scaled_mm_problem() -> str | None:
    """Why this CPU's torch._scaled_mm cannot run (an AVX2-only CPU's oneDNN has no FP8 matmul), or None."""
    one, a = torch.ones(()), torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except RuntimeError as e:
        return f"this CPU's torch._scaled_mm does not run: {str(e).splitlines()[0]}"
    return None

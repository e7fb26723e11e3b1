"""The chunked loss's memory under torch.compile (not a command: `python -m tools.gpu_check --stage perf` and
dev/loss_schedules.py share it): the peak of one micro-batch's loss, forward and backward, eager and compiled, with the
same loss and gradients; and what Inductor's code holds at once, read from the code itself (buffers_alive), so that
the CUDA code's schedule can be read where the CPU's differs.

On a CPU (torch 2.13), the compiled loop frees each chunk's logits before the next chunk's exist, but keeps every
chunk's product grad_logitsᵀ @ x (the weight's gradient, in the matmul dtype) until one fused kernel adds them all
into the fp32 sum after the last chunk: Inductor fuses the chain of adds. An H200 showed the compiled step holding
every chunk's logits too (dev/notes/gpu_h200_2026-11-28.md).
"""

import re
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tools.bench.step import time_ms
from training.distributed import synchronize
from training.loss import linear_cross_entropy
from training.precision import autocast

# Inductor's wrapper code: an allocation, a reuse of a freed buffer (under a new name, maybe reshaped), a free.
ALLOCATION = re.compile(r"^\s*(buf\d+) = empty_strided_\w+\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)")
REUSE = re.compile(r"^\s*(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)\b.*; del (buf\d+)\s+# reuse")
FREE = re.compile(r"^\s*del ((?:buf\d+)(?:, buf\d+)*)\s*$")


@dataclass
class Liveness:
    peak_bytes: int  # the most bytes the code's own buffers hold at once
    most_alive: Counter  # (shape, dtype): the most buffers of that shape alive at once


def buffers_alive(code: str) -> Liveness:
    """Walk Inductor's generated wrapper code (its call function) allocation by allocation and free by free, and
    count what is alive: the buffers it allocates, by shape and dtype (inputs and outputs that escape are not its
    own frees, so an output stays alive to the end)."""
    alive: dict[str, tuple[tuple[int, ...], str]] = {}  # buffer name -> (shape, dtype)
    peak_bytes, most_alive = 0, Counter()
    for line in code.splitlines():
        if match := ALLOCATION.match(line):
            name, shape, dtype = match.groups()
            alive[name] = (tuple(int(d) for d in shape.replace(" ", "").split(",") if d), dtype)
        elif match := REUSE.match(line):
            new, old, _ = match.groups()
            if old in alive:
                alive[new] = alive.pop(old)
        elif match := FREE.match(line):
            for name in match.group(1).split(", "):
                alive.pop(name, None)
        else:
            continue
        by_shape = Counter(alive.values())
        most_alive |= by_shape  # the elementwise maximum
        peak_bytes = max(peak_bytes, sum(_nbytes(shape, dtype) for shape, dtype in alive.values()))
    return Liveness(peak_bytes, most_alive)


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return torch.Size(shape).numel() * getattr(torch, dtype).itemsize


def loss_inputs(tokens: int, n_embd: int, padded_vocab: int, vocab_size: int, device: torch.device,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Final hidden states (tokens, n_embd) and a weight (padded_vocab, n_embd) that want gradients, and targets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n_embd, generator=g).to(device).requires_grad_()
    weight = (0.02 * torch.randn(padded_vocab, n_embd, generator=g)).to(device).requires_grad_()
    targets = torch.randint(0, vocab_size, (tokens,), generator=g).to(device)
    return x, weight, targets


def loss_function(vocab_size: int, chunk_tokens: int, compile: bool) -> Callable:
    """The loss of (x, weight, targets), compiled or not."""

    def loss_fn(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(x, weight, targets, vocab_size, chunk_tokens)
    return torch.compile(loss_fn) if compile else loss_fn


def loss_step(loss_fn: Callable, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
              dtype: torch.dtype) -> tuple[float, torch.Tensor, torch.Tensor]:
    """One forward + backward of the loss under autocast: the loss and the two gradients (which are then cleared)."""
    with autocast(x.device, dtype):
        loss = loss_fn(x, weight, targets)
    loss.backward()
    grads = x.grad, weight.grad
    x.grad = weight.grad = None
    return loss.item(), *grads


def measure_loss(loss_fn: Callable, inputs: tuple, dtype: torch.dtype, repeats: int = 3) -> dict:
    """The loss and gradients of one call (after one that compiles), the peak bytes above the inputs (CUDA), and the
    median milliseconds of repeats calls."""
    device = inputs[0].device
    loss_step(loss_fn, *inputs, dtype)
    loss, grad_x, grad_w = loss_step(loss_fn, *inputs, dtype)
    peak = peak_bytes(lambda: loss_step(loss_fn, *inputs, dtype), device) if device.type == "cuda" else None
    ms = statistics.median(time_ms(lambda: loss_step(loss_fn, *inputs, dtype), device) for _ in range(repeats))
    return {"loss": loss, "grads": (grad_x, grad_w), "peak_bytes": peak, "ms": ms}


def peak_bytes(run: Callable[[], object], device: torch.device) -> int:
    """The allocator's peak above what was allocated before, while run() runs (CUDA only)."""
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def generated_code(loss_fn: Callable, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   dtype: torch.dtype) -> list[str]:
    """The wrapper code Inductor generates for a compiled loss_fn's forward and backward (compiling it here)."""
    from torch._inductor.utils import run_and_get_code  # (Inductor's own test helper: imported only when asked)

    _, codes = run_and_get_code(lambda: loss_step(loss_fn, x, weight, targets, dtype))
    return codes

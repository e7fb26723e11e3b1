"""Which kernel runs attention (F.scaled_dot_product_attention): naming the ones a step ran, from its profile, and
choosing one for a device, with a fallback where it is missing. torch.compile keeps the kernel in force when it traced
the step, so `attention_kernel` is held around the step's first call. Default: torch's own order (flash first on CUDA),
until a GPU lease measures the others end to end (tools/gpu_check.py --stage perf).
"""

from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
KERNELS = tuple(BACKENDS)
# What --attention may ask for: torch's order as it is, the preferred kernel of the device, or one.
CHOICES = ("default", "auto", *KERNELS)
# Where a kernel cannot run (cuDNN's needs cuDNN 9 and sm80+, flash sm80+), the next of these that can.
FALLBACKS = {"cudnn": ("flash", "efficient", "math"), "flash": ("efficient", "math"), "efficient": ("math",),
             "math": ()}
# The names of the aten ops each kernel runs as, forward and backward, eager or compiled (Inductor calls the fused ones
# as extern kernels). The math kernel Inductor writes out as its own matmuls and softmax: no kernel's op.
OP_MARKERS = {"cudnn": "_cudnn_attention", "flash": "_flash_attention", "efficient": "_efficient_attention",
              "math": "_attention_math"}
# --attention auto: cuDNN's from Hopper on; on an H200, dev.speed_levers timed one layer's causal forward + backward at
# B=64, T=1024, bf16 in 1.72 ms with cuDNN's kernel against flash's 2.53 (dev/notes/gpu_h200_2026-11-28.md).
CUDNN_PREFERRED_FROM = (9, 0)


def kernels_in_profile(op_names: Iterable[str]) -> list[str]:
    """The attention kernels that ran, in KERNELS' order, from the names of a profile's events."""
    found = {kernel for name in op_names if name.startswith("aten::")
             for kernel, marker in OP_MARKERS.items() if marker in name}
    return [kernel for kernel in KERNELS if kernel in found]


def resolve_kernel(requested: str, capability: tuple[int, int] | None,
                   available: Collection[str]) -> tuple[str | None, str]:
    """The kernel to put first for --attention `requested` on a device of this CUDA capability (None off CUDA) where
    the `available` kernels run, and a line that says why: (None, ...) leaves torch's order as it is."""
    if requested not in CHOICES:
        raise ValueError(f"attention kernel {requested!r} is none of {', '.join(CHOICES)}")
    if requested == "default":
        return None, "torch's own order"
    if requested == "auto":
        if capability is not None and capability >= CUDNN_PREFERRED_FROM and "cudnn" in available:
            return "cudnn", "auto: cudnn"
        return None, "auto: torch's own order (no kernel preferred on this device)"
    if requested in available:
        return requested, requested
    fallback = next((kernel for kernel in FALLBACKS[requested] if kernel in available), None)
    instead = fallback or "torch's own order"
    return fallback, f"{requested} does not run here: {instead} instead"


def available_kernels(device: torch.device, dtype: torch.dtype, head_size: int) -> set[str]:
    """The kernels that run one causal forward + backward at this head size and dtype on the device (a kernel that
    cannot raises, as sdpa does when the only kernel allowed cannot run)."""
    q, k, v = (torch.randn(1, 2, 128, head_size, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    available = set()
    for kernel, backend in BACKENDS.items():
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
            available.add(kernel)
        except RuntimeError:
            pass
    return available


def choose_kernel(requested: str, device: torch.device, dtype: torch.dtype, head_size: int) -> tuple[str | None, str]:
    """resolve_kernel on this device, with the kernels that run there (probed, unless torch's order is asked for)."""
    if requested == "default":
        return resolve_kernel(requested, None, ())
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return resolve_kernel(requested, capability, available_kernels(device, dtype, head_size))


@contextmanager
def attention_kernel(kernel: str | None) -> Iterator[None]:
    """Attention runs `kernel` where it can, and its FALLBACKS in order where not (None: torch's order, untouched)."""
    if kernel is None:
        yield
        return
    with sdpa_kernel([BACKENDS[name] for name in (kernel, *FALLBACKS[kernel])], set_priority=True):
        yield

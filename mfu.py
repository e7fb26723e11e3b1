"""Model FLOPs utilisation: the FLOPs a step needs (model.GPT.flops_per_token) over what the hardware can do.

The hardware peak comes from a table of datasheet dense bf16/fp16 tensor-core numbers for known GPUs, and
otherwise (CPU, MPS, unknown GPUs) from timing a large matmul at start-up, so MFU there is relative to what
this machine's matmul actually reaches, not to a datasheet.
"""

import time

import torch

# Datasheet dense (no sparsity) bf16 FLOP/s. Matched in order against torch.cuda.get_device_name(), so the
# more specific names come first.
GPU_PEAK_FLOPS = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
    ("A10G", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16: V100 has no bf16
    ("T4", 65e12),  # fp16
]


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.3) -> float:
    """FLOP/s of a size×size matmul in dtype on device, timed for about `seconds`."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up: the first call pays for kernel selection and allocation
    synchronize(device)
    iterations, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iterations += 1
        if iterations % 8 == 0:
            synchronize(device)
    synchronize(device)
    return 2 * size**3 * iterations / (time.perf_counter() - start)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Peak FLOP/s of one device: from the table for known GPUs, else measured in `dtype`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS:
            if key in name:
                return flops
    return measure_matmul_flops(device, dtype)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()

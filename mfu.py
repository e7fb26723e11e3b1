"""Model FLOPs utilisation: the FLOPs a step needs (model.GPT.flops_per_token) over what the hardware can do.

The hardware peak comes from a table of datasheet dense bf16/fp16 tensor-core numbers for known GPUs, and
otherwise (CPU, MPS, unknown GPUs) from timing matmuls at start-up in the training dtype, so MFU there is relative
to what this machine's matmul actually reaches, not to a datasheet.
"""

import math
import time

import torch

# Datasheet dense (no sparsity) bf16 FLOP/s. Matched in order against torch.cuda.get_device_name(), so the
# more specific names come first ("H100 PCIe" before "H100", "L40S" and "L40" before "L4").
GPU_PEAK_FLOPS = [
    ("B200", 2250e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
    ("A10G", 125e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16: V100 has no bf16
    ("T4", 65e12),  # fp16
]


def table_peak_flops(device_name: str) -> float | None:
    """The datasheet peak of a GPU named like torch.cuda.get_device_name() returns, or None if not in the table."""
    for key, flops in GPU_PEAK_FLOPS:
        if key in device_name:
            return flops
    return None


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """The best FLOP/s of a square matmul in dtype on device, over about `seconds` of repeats.

    The fastest repeat, not the mean: on a shared machine the slow ones measure the neighbours, not the hardware.
    On a CPU, 512 already reaches a core's peak (on the AMD EPYC this was tuned on, larger sizes are 5-10% slower)
    and takes ~3 ms, short enough for some repeats to run between other processes' time slices; GPUs need 4096
    to fill their cores.
    """
    size = 512 if device.type == "cpu" else 4096
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):  # warm-up: the first calls pay for kernel selection and allocation
        a @ b
    synchronize(device)
    best, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Peak FLOP/s of one device (for a CPU: of the threads torch uses), from the table for known GPUs, else
    measured in `dtype`."""
    if device.type == "cuda":
        flops = table_peak_flops(torch.cuda.get_device_name(device))
        if flops is not None:
            return flops
    if device.type != "cpu":
        return measure_matmul_flops(device, dtype)
    # One thread's peak times the threads: a single thread finds a free core between its neighbours' work far
    # more often than all threads at once do, and matmuls scale about linearly in cores (bf16 on the 2-core
    # machine this was tuned on: 210 GFLOP/s on 1 thread, 420 on 2).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_matmul_flops(device, dtype) * threads
    finally:
        torch.set_num_threads(threads)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock time covers it (GPUs run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()

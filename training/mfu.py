"""Model FLOPs utilisation's denominator: one device's peak FLOP/s in the run's dtype, from the datasheet for known
GPUs, else measured by timing matmuls at start-up (docs/gpus.md). `Peak.source` says which; the run prints it."""

import math
import time
from dataclasses import dataclass

import torch

from training.distributed import synchronize
from training.precision import dtype_name

# Datasheet dense FLOP/s: (name, bf16/fp16, TF32), matched in order against torch.cuda.get_device_name(), so the
# more specific names come first ("H100 NVL" before "H100", "A100" before "A10"). V100 and T4: plain fp32, no TF32.
GPU_PEAK_FLOPS = [
    ("B200", 2250e12, 1100e12),
    ("GH200", 989e12, 494e12),
    ("H200 NVL", 835e12, 418e12),
    ("H200", 989e12, 494e12),  # SXM
    ("H100 NVL", 835e12, 418e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100", 989e12, 494e12),  # SXM
    ("A100", 312e12, 156e12),
    ("A10G", 125e12, 62.5e12),
    ("A10", 125e12, 62.5e12),
    ("L40S", 362e12, 183e12),
    ("L40", 181e12, 90.5e12),
    ("L4", 121e12, 60e12),
    ("RTX 4090", 165e12, 82.6e12),
    ("RTX 3090", 71e12, 35.6e12),
    ("V100", 125e12, 15.7e12),  # 16-bit: fp16 (V100 has no bf16)
    ("T4", 65e12, 8.1e12),  # 16-bit: fp16
]


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s of one device
    source: str  # where the number comes from, for the start-up log line


def table_peak_flops(device_name: str, dtype: torch.dtype) -> tuple[str, float] | None:
    """(table name, datasheet peak in dtype) of a GPU named as torch.cuda.get_device_name() returns, or None."""
    for key, half_flops, tf32_flops in GPU_PEAK_FLOPS:
        if key in device_name:
            return key, tf32_flops if dtype == torch.float32 else half_flops
    return None


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """The best FLOP/s of a square matmul over `seconds` of repeats (on a shared machine the slow ones measure the
    neighbours): 512 on a CPU, a core's peak in ~3 ms, between others' time slices; 4096 on GPUs."""
    size = 512 if device.type == "cpu" else 4096
    generator = torch.Generator(device=device).manual_seed(0)  # (the run's random stream untouched)
    a, b = (torch.randn(size, size, device=device, dtype=dtype, generator=generator) for _ in range(2))
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


def peak_flops(device: torch.device, dtype: torch.dtype) -> Peak:
    """Peak FLOP/s of one device (a CPU: of the threads torch uses) in dtype."""
    tf32_on = torch.get_float32_matmul_precision() != "highest"
    found = table_peak_flops(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None
    if found is not None and (dtype != torch.float32 or tf32_on):
        name, flops = found
        return Peak(flops, f"datasheet, {name} {'tf32' if dtype == torch.float32 else dtype_name(dtype)} dense")
    if device.type == "cpu":
        # One thread's peak times the threads (about linear): one finds a free core far more often than all at once.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            flops = measure_matmul_flops(device, dtype) * threads
        finally:
            torch.set_num_threads(threads)
    else:
        flops = measure_matmul_flops(device, dtype)
    return Peak(flops, f"measured, {dtype_name(dtype)} matmul on this {device.type}")

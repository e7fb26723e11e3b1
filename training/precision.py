"""The autocast dtype a run trains in (fp32 is the one "off" value everywhere; docs/gpus.md), and determinism."""

import os

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cpu_has_bf16_arithmetic() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls 2-3x faster than fp32. Other CPUs, even AVX-512 ones that mkldnn's own check
    accepts, emulate bf16, slower than fp32 (an AVX2-only one 60 times). The tests force both answers (cpu_host)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype; 'auto' is the fastest that is safe on the device."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        # bf16 tensor cores from Ampere (8.0) on, and on ROCm; torch.cuda.is_bf16_supported() counts emulated bf16 too
        native_bf16 = torch.version.hip is not None or torch.cuda.get_device_capability(device) >= (8, 0)
        return torch.bfloat16 if native_bf16 else torch.float16
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_bf16_arithmetic() else torch.float32
    return torch.float32  # MPS: fp32 is the one dtype every macOS version runs correctly


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def autocast(device: torch.device | str, dtype: torch.dtype) -> torch.autocast:
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32)


def set_deterministic() -> None:
    """Bitwise-repeatable GPU runs (--deterministic, docs/gpus.md). Strict, not warn_only: only then does torch pick
    flash and memory-efficient attention's deterministic backward (no op of a step raises: tests/test_gpu_paths.py)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts, so before any GPU work
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False

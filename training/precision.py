"""The autocast dtype a run trains in (fp32 is the one "off" value everywhere), and bitwise determinism."""

import contextlib
import os

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def has_native_bf16(device: torch.device) -> bool:
    """bf16 tensor cores: compute capability 8.0 (Ampere) and later, or any ROCm GPU that torch runs on.

    torch.cuda.is_bf16_supported() also says yes on V100 and T4, where bf16 is emulated: matmuls skip the tensor
    cores, flash attention is unavailable and torch.compile skips bf16, so fp16 with a GradScaler is far faster.
    """
    return torch.version.hip is not None or torch.cuda.get_device_capability(device) >= (8, 0)


def cpu_has_bf16_arithmetic() -> bool:
    """AVX512-BF16 or AMX: such CPUs run bf16 matmuls 2-3x faster than fp32 (and a bf16 step ~2x faster). Others,
    even plain AVX-512 ones, which mkldnn's own bf16 check accepts, have no bf16 arithmetic to gain from: they
    emulate it, slower than fp32 (an AVX2-only one 60 times: 0.9 GFLOP/s a thread against 58). The one question the
    code asks of the CPU; the tests force both answers (tests/conftest.py's cpu_bf16)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype; 'auto' is the fastest that is safe on the device. torch.float32 means no autocast."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if has_native_bf16(device) else torch.float16
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_bf16_arithmetic() else torch.float32
    return torch.float32  # MPS: fp32 is the one dtype every macOS version runs correctly (see README)


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def autocast(device: torch.device | str, dtype: torch.dtype):
    """Mixed precision in dtype on the device; torch.float32 (the one "off" value everywhere) is plain fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def set_deterministic() -> None:
    """Bitwise-repeatable GPU runs, at some speed: deterministic kernels and a fixed cuBLAS workspace.

    Strict, not warn_only: torch picks the deterministic backward of flash and memory-efficient attention only when
    warnings are off (attention_backward.cu); with warn_only every step would keep the atomic-add kernel after one
    warning. Strict also means an op with no deterministic version raises. A training step uses none: the embedding
    backward, index_put_ and gather have deterministic CUDA versions, and the loss (training/loss.py) is matmuls,
    logsumexp and gather, with no atomic adds (the ops that raise are listed in torch's docstring of
    use_deterministic_algorithms; tests/test_gpu_paths.py trains with it on)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts, so before any GPU work
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False

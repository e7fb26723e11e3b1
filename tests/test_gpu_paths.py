"""The CUDA, fp16 and MPS code paths, proven on a CPU: device properties faked with monkeypatch, calls spied on.

Each test here failed on the code before these paths were fixed (the review of issue 9), and names what it proves.
"""

import os
import types

import pytest
import torch
import torch.distributed as dist

import distributed
import mfu
import parallel
import precision
import snapshot
import train_gpt2
from config import TrainConfig, parse_args
from distributed import Distributed
from errors import UserError
from model import GPT, PRESETS

CUDA = torch.device("cuda", 0)
MPS = torch.device("mps")
CPU = torch.device("cpu")


def fake_gpu(monkeypatch, capability: tuple[int, int], name: str = "NVIDIA A100-SXM4-80GB") -> None:
    """A CUDA GPU as torch.cuda describes it, without initialising CUDA (this torch build has none)."""
    properties = types.SimpleNamespace(major=capability[0], minor=capability[1], name=name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # What torch says on a V100 or T4: bf16 "supported", by emulation. The choice must not believe it.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.version, "hip", None)


# ----------------------------------------------------------------------------------------------------------------
# 1. --dtype auto

@pytest.mark.parametrize("capability, expected", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                                  ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_auto_dtype_is_fp16_before_ampere_and_bf16_from_ampere_on(monkeypatch, capability, expected):
    fake_gpu(monkeypatch, capability)
    assert precision.pick_dtype("auto", CUDA) == expected
    assert precision.pick_dtype("bf16", CUDA) == torch.bfloat16  # asked for by name: the user's choice stands


# ----------------------------------------------------------------------------------------------------------------
# 5. snapshots are memory-mapped on load

def test_snapshots_are_loaded_memory_mapped_and_weights_only(tmp_path, monkeypatch):
    path = snapshot.snapshot_path(tmp_path, 1)
    snapshot.save_snapshot({key: {} for key in snapshot.REQUIRED_KEYS} | {"model": {"w": torch.ones(3)}}, path)
    calls, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: (calls.append(kwargs), real_load(*args, **kwargs))[1])
    assert torch.equal(snapshot.load_snapshot(path)["model"]["w"], torch.ones(3))
    assert calls == [{"map_location": "cpu", "weights_only": True, "mmap": True}]


# ----------------------------------------------------------------------------------------------------------------
# 6. RNG state: the training device's, and nothing draws from the global generators after a restore

def test_a_cpu_run_on_a_gpu_machine_never_touches_cuda_rng(monkeypatch):
    def cuda_rng(*args, **kwargs):
        raise AssertionError("the CUDA RNG was touched: that opens a CUDA context on GPU 0 in every rank")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", cuda_rng)
    monkeypatch.setattr(torch.cuda, "set_rng_state", cuda_rng)
    state = snapshot.capture_rng_state(CPU)
    assert "cuda" not in state
    snapshot.restore_rng_state(state | {"cuda": torch.zeros(8, dtype=torch.uint8)}, CPU)


def test_mps_rng_state_is_saved_and_restored(monkeypatch):
    mps_state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: mps_state.clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state: restored.append(state))
    state = snapshot.capture_rng_state(MPS)
    assert torch.equal(state["mps"], mps_state)
    snapshot.restore_rng_state(state, MPS)
    assert len(restored) == 1 and torch.equal(restored[0], mps_state)


def test_measuring_the_peak_after_a_restore_leaves_the_random_stream_as_saved():
    saved = snapshot.capture_rng_state(CPU)
    expected = torch.rand(3)  # the draw an uninterrupted run makes next
    snapshot.restore_rng_state(saved, CPU)
    mfu.peak_flops(CPU, torch.float32)  # train_gpt2.run measures after resuming
    assert torch.equal(torch.rand(3), expected)


# ----------------------------------------------------------------------------------------------------------------
# 7. NCCL is bound to the rank's GPU

@pytest.mark.parametrize("device, backend, device_id", [("cuda", "nccl", torch.device("cuda", 1)),
                                                        ("cpu", "gloo", None)])
def test_the_process_group_is_bound_to_the_ranks_gpu(monkeypatch, device, backend, device_id):
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    calls = []
    monkeypatch.setattr(dist, "rendezvous", lambda *args, **kwargs: iter([("store", 1, 2)]))
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    dist_env = distributed.setup_distributed(device)
    [(args, kwargs)] = calls
    assert args == (backend,) and kwargs["device_id"] == device_id and kwargs["world_size"] == 2
    assert dist_env.device == (device_id or CPU)


# ----------------------------------------------------------------------------------------------------------------
# 8. MFU: the right datasheet line, in the run's dtype, and where the peak came from

@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 NVL", torch.bfloat16, 835e12),  # not the SXM's 989
    ("NVIDIA H200 NVL", torch.bfloat16, 835e12),
    ("NVIDIA GH200 480GB", torch.bfloat16, 989e12),  # an H100-class chip, not an H200 NVL
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
    ("NVIDIA H100 PCIe", torch.float16, 756e12),
    ("NVIDIA A10", torch.bfloat16, 125e12),  # not the A100's 312
    ("NVIDIA A100-SXM4-80GB", torch.float32, 156e12),  # TF32, not the bf16 figure
    ("Tesla V100-SXM2-16GB", torch.float32, 15.7e12),  # no TF32: plain fp32
])
def test_the_datasheet_peak_is_the_gpus_own_in_the_runs_dtype(name, dtype, peak):
    assert mfu.table_peak_flops(name, dtype)[1] == peak


def test_the_peak_says_where_it_came_from(monkeypatch):
    monkeypatch.setattr(mfu, "measure_matmul_flops", lambda device, dtype: 42e12)
    fake_gpu(monkeypatch, (8, 0), name="NVIDIA A100-SXM4-40GB")
    known = mfu.peak_flops(CUDA, torch.bfloat16)
    assert known.flops == 312e12 and "datasheet" in known.source and "A100" in known.source
    fake_gpu(monkeypatch, (6, 1), name="NVIDIA GeForce GTX 1080")
    unknown = mfu.peak_flops(CUDA, torch.float16)
    assert unknown.flops == 42e12 and "measured" in unknown.source
    fake_gpu(monkeypatch, (8, 0))
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")  # fp32 without TF32: the TF32 line would overstate the peak
        assert "measured" in mfu.peak_flops(CUDA, torch.float32).source
    finally:
        torch.set_float32_matmul_precision(precision)


# ----------------------------------------------------------------------------------------------------------------
# 9. MPS: one process, no compile

def test_several_processes_on_mps_are_refused_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: pytest.fail("reached the rendezvous"))
    with pytest.raises(UserError, match="--device mps with 2 processes"):
        distributed.setup_distributed("mps")


def test_compile_on_mps_is_refused_before_the_model_moves(monkeypatch):
    model = GPT(PRESETS["tiny"])
    monkeypatch.setattr(model, "to", lambda *a, **k: pytest.fail("moved the model to MPS"))
    with pytest.raises(UserError, match="--compile is not supported on MPS"):
        parallel.build_model(model, Distributed(0, 0, 1, MPS), torch.float32, TrainConfig(), compile=True)


# ----------------------------------------------------------------------------------------------------------------
# 10. --deterministic

def test_deterministic_turns_on_deterministic_kernels_and_a_fixed_cublas_workspace(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        precision.set_deterministic()
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
    assert parse_args(["--deterministic"]).deterministic and not parse_args([]).deterministic


@pytest.mark.parametrize("flag, expected", [(["--deterministic"], 1), ([], 0)])
def test_main_makes_runs_deterministic_only_when_asked(monkeypatch, tmp_path, flag, expected):
    calls = []
    monkeypatch.setattr(train_gpt2, "set_deterministic", lambda: calls.append(1))
    monkeypatch.setattr(train_gpt2, "run", lambda *args, **kwargs: None)
    monkeypatch.setattr(train_gpt2.signal, "signal", lambda *args: None)
    monkeypatch.setattr(train_gpt2, "keep_freed_memory", lambda: None)
    precision = torch.get_float32_matmul_precision()
    try:
        train_gpt2.main(["--device", "cpu", *flag])
    finally:
        torch.set_float32_matmul_precision(precision)
    assert len(calls) == expected

"""The CUDA, fp16 and MPS code paths, proven on a CPU: device properties faked with monkeypatch, calls spied on.

Each test here failed on the code before these paths were fixed (the review of issue 9), and names what it proves.
"""

import os
import types

import pytest
import torch
import torch.distributed as dist

import train_gpt2
from model import GPT, PRESETS
from rundir import snapshot, training_state
from training import distributed, memory, mfu, parallel, precision
from training.config import TrainConfig, parse_args
from training.distributed import Distributed, teardown_distributed
from training.errors import UserError

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
    state = {key: kind() for key, kind in snapshot.KEY_TYPES.items()}
    snapshot.save_snapshot(state | {"model": {"w": torch.ones(3)}, "format": snapshot.FORMAT}, path)
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
    state = training_state.capture_rng_state(CPU)
    assert "cuda" not in state
    training_state.restore_rng_state(state | {"cuda": torch.zeros(8, dtype=torch.uint8)}, CPU)


def test_mps_rng_state_is_saved_and_restored(monkeypatch):
    mps_state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: mps_state.clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state: restored.append(state))
    state = training_state.capture_rng_state(MPS)
    assert torch.equal(state["mps"], mps_state)
    training_state.restore_rng_state(state, MPS)
    assert len(restored) == 1 and torch.equal(restored[0], mps_state)


def test_measuring_the_peak_after_a_restore_leaves_the_random_stream_as_saved():
    saved = training_state.capture_rng_state(CPU)
    expected = torch.rand(3)  # the draw an uninterrupted run makes next
    training_state.restore_rng_state(saved, CPU)
    mfu.peak_flops(CPU, torch.float32)  # train_gpt2.run measures after resuming
    assert torch.equal(torch.rand(3), expected)


# ----------------------------------------------------------------------------------------------------------------
# 7. NCCL is bound to the rank's GPU

@pytest.mark.parametrize("device, backend, device_id", [("cuda", "nccl", torch.device("cuda", 1)),
                                                        ("cpu", "gloo", None)])
def test_the_process_group_is_bound_to_the_ranks_gpu(monkeypatch, device, backend, device_id):
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
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
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: pytest.fail("reached the rendezvous"))
    with pytest.raises(UserError, match="--device mps with 2 processes"):
        distributed.setup_distributed("mps")


def test_compile_on_mps_is_refused_before_the_model_moves(monkeypatch):
    model = GPT(PRESETS["tiny"])
    monkeypatch.setattr(model, "to", lambda *a, **k: pytest.fail("moved the model to MPS"))
    with pytest.raises(UserError, match="--compile is not supported on MPS"):
        parallel.build_training_model(model, Distributed(0, 0, 1, MPS), torch.float32, TrainConfig(), compile=True)


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
    monkeypatch.setattr(train_gpt2, "check_inputs", lambda cfg: None)
    monkeypatch.setattr(train_gpt2.signal, "signal", lambda *args: None)
    monkeypatch.setattr(train_gpt2, "keep_freed_memory", lambda: None)
    precision = torch.get_float32_matmul_precision()
    try:
        train_gpt2.main(["--device", "cpu", *flag])
    finally:
        torch.set_float32_matmul_precision(precision)
    assert len(calls) == expected


# ----------------------------------------------------------------------------------------------------------------
# 11. The review of issue 18: --deterministic, --micro_batch_size auto, and fsdp on a GPU

@pytest.fixture
def deterministic_off_afterwards(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # restored (to unset) after the test
    yield
    torch.use_deterministic_algorithms(False)


def test_deterministic_mode_is_strict_so_cuda_attention_takes_its_deterministic_backward(deterministic_off_afterwards):
    # torch's attention_backward.cu switches flash and memory-efficient attention to their deterministic backward
    # only when deterministic mode is on and warn_only is off.
    precision.set_deterministic()
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()


@pytest.mark.slow  # over 3 s on two busy cores: keeps `-m 'not slow'` within a minute
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_deterministic_run_trains_validates_and_samples_in_strict_mode(tmp_path, monkeypatch, gpt2_encoding,
                                                                         deterministic_off_afterwards, parallel):
    from conftest import make_shards
    from helpers_train import main_in_process, read_metrics

    make_shards(tmp_path / "data", "train", [3000], vocab=100)
    make_shards(tmp_path / "data", "val", [500], seed=1, vocab=100)
    strict_steps, train_step = [], train_gpt2.train_step

    def spied_train_step(*args, **kwargs):
        strict_steps.append(torch.are_deterministic_algorithms_enabled()
                            and not torch.is_deterministic_algorithms_warn_only_enabled())
        return train_step(*args, **kwargs)

    monkeypatch.setattr(train_gpt2, "train_step", spied_train_step)
    main_in_process(["--deterministic", "--parallel", parallel, "--data_dir", str(tmp_path / "data"), "--log_dir",
                     str(tmp_path / "logs"), "--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64",
                     "--max_steps", "2", "--val_every", "1", "--val_tokens", "32", "--sample_every", "1",
                     "--snapshot_every", "0", "--dtype", "fp32"])
    records = read_metrics(tmp_path / "logs")
    assert strict_steps == [True, True]
    assert [r["step"] for r in records if "loss" in r] == [0, 1] and len([r for r in records if "val_loss" in r]) == 2


def test_auto_micro_batch_counts_the_compiled_losss_chunks_on_a_gpu(monkeypatch):
    """Compiled on a GPU a sequence costs eager's activations plus its share of the loss's chunks, which the compiled
    step holds at once (117 MiB at 124M, T=1024, bf16): on a card with 100 GiB free, 256 sequences fit eager's count
    but not compiled's, where the H200's compiled step at B=256 peaked at 113 GiB."""
    from training.memory import GiB, MiB, auto_micro_batch
    monkeypatch.setattr(memory, "available_bytes", lambda device, ranks_on_node: 100 * GiB)
    monkeypatch.setattr(memory, "measure_activation_bytes_per_sequence", lambda *args, **kwargs: 320 * MiB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    sizes = {compile: auto_micro_batch(PRESETS["gpt2"], 1024, 524_288, 1, torch.device("cuda", 0), torch.bfloat16, 1,
                                       compile=compile) for compile in (False, True)}
    assert sizes[False].size == 256 and sizes[True].size == 128, sizes
    assert "× 437 MiB" in sizes[True].reason, sizes[True].reason
    cpu = auto_micro_batch(PRESETS["tiny"], 64, 64 * 64, 1, torch.device("cpu"), torch.float32, 1, compile=True)
    assert "× 320 MiB" in cpu.reason  # on a CPU, where no compiled step was measured to hold more: eager's count


def test_auto_micro_batch_counts_a_ranks_shard_under_fsdp_gpt2_xl_fits_8_24gb_gpus(monkeypatch):
    from training.memory import GiB, MiB, auto_micro_batch, fixed_bytes
    config, cuda, world_size = PRESETS["gpt2-xl"], torch.device("cuda", 0), 8
    # What a 24 GB card has free, and gpt2-xl's activations per sequence of 1,024 tokens in bf16 (from the 774M
    # figure in the README, per layer and width: ≈ 2.4 GiB).
    monkeypatch.setattr(memory, "available_bytes", lambda device, ranks_on_node: 22 * GiB)
    monkeypatch.setattr(memory, "measure_activation_bytes_per_sequence", lambda *args, **kwargs: 2458 * MiB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    batch = 524_288
    with pytest.raises(ValueError, match="one sequence does not fit"):  # ddp: the whole 23 GiB state per rank
        auto_micro_batch(config, 1024, batch, world_size, cuda, torch.bfloat16, 8, parallel="ddp")
    choice = auto_micro_batch(config, 1024, batch, world_size, cuda, torch.bfloat16, 8, parallel="fsdp")
    assert choice.size == 4, choice.reason
    # The fixed part: an eighth of the 16 bytes/parameter, the fp32 gradients FSDP2 keeps unsharded between
    # micro-steps (4 bytes/parameter), and the root and two Blocks gathered in bf16 with their gradients.
    with torch.device("meta"):
        model = GPT(config)
    params = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    root = params - 48 * block
    expected = 16 * params // 8 + 4 * params + 2 * 2 * (root + 2 * block)
    assert fixed_bytes(config, world_size, "fsdp", torch.bfloat16) == expected
    assert 8.5 * GiB < expected < 9.5 * GiB


def test_an_out_of_memory_error_in_the_auto_probe_is_the_clean_does_not_fit_error(monkeypatch):
    def probe(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(memory, "auto_micro_batch", probe)
    cfg = parse_args(["--model", "tiny", "--micro_batch_size", "auto", "--seq_len", "16", "--total_batch_size", "64",
                      "--val_every", "0"])
    with pytest.raises(UserError, match=r"--micro_batch_size auto: one sequence does not fit: .* ran out of memory "
                                        r"\(CUDA out of memory\. Tried to allocate 2\.00 GiB\)\. Lower --seq_len"):
        memory.choose_micro_batch(cfg, Distributed(0, 0, 1, CPU), torch.float32, print)


def oom_on_rank_1_worker(rank: int, store: str, out_dir: str) -> None:
    """One of 2 gloo ranks choosing a micro-batch, the probe of rank 1 running out of memory."""
    from datetime import timedelta
    from pathlib import Path

    from training.memory import MicroBatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        def probe(*args, **kwargs):
            if rank == 1:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return MicroBatch(4, "fits")
        memory.auto_micro_batch = probe
        cfg = parse_args(["--model", "tiny", "--micro_batch_size", "auto", "--seq_len", "16", "--total_batch_size",
                          "128", "--val_every", "0"])
        try:
            size = memory.choose_micro_batch(cfg, Distributed(rank, rank, 2, CPU), torch.float32, print)
            outcome = f"chose {size}"
        except UserError as e:
            outcome = f"UserError: {e}"
        dist.barrier()  # both ranks are still there: neither hung in the all-reduce
        (Path(out_dir) / f"rank{rank}.txt").write_text(outcome)
    finally:
        teardown_distributed()


@pytest.mark.slow  # two spawned processes
def test_an_out_of_memory_probe_on_one_rank_stops_every_rank_with_the_error_and_none_hangs(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(oom_on_rank_1_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    outcomes = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert outcomes[1].startswith("UserError: --micro_batch_size auto: one sequence does not fit: measuring")
    assert outcomes[0].startswith("UserError: --micro_batch_size auto: one sequence does not fit on another rank")


def test_the_auto_probe_warms_up_before_its_measured_passes(monkeypatch):
    from training import memory
    # The first pass of a process pays for cuBLAS's workspaces: here 900 bytes that must not enter the slope.
    peaks, calls = iter([1000, 100, 300]), []

    def spied_peak(model, batch_size, seq_len, dtype):
        calls.append(batch_size)
        return next(peaks)
    monkeypatch.setattr(memory, "_peak_activation_bytes", spied_peak)
    per_sequence = memory.measure_activation_bytes_per_sequence(PRESETS["tiny"], 16, torch.float32, batch_size=2)
    assert calls == [1, 1, 2] and per_sequence == 300 - 100


@pytest.fixture
def fsdp_group_of_one():
    """The process group a 1-process `--parallel fsdp` run makes (distributed.setup_distributed)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield Distributed(0, 0, 1, CPU)
    teardown_distributed()


def test_fsdp_full_model_is_the_gathered_weights_without_a_random_init(fsdp_group_of_one, monkeypatch):
    from conftest import perturb_
    torch.manual_seed(0)
    trainee = parallel.build_training_model(perturb_(GPT(PRESETS["tiny"]), 0.1), fsdp_group_of_one, torch.float32,
                                            TrainConfig(max_lr=1e-3), compile=False, parallel="fsdp")
    initialised, normal = [], torch.nn.init.normal_

    def spied_normal(tensor, *args, **kwargs):
        initialised.append(tensor.device.type)
        return normal(tensor, *args, **kwargs)
    monkeypatch.setattr(torch.nn.init, "normal_", spied_normal)
    full = trainee.full_model()
    assert set(initialised) <= {"meta"}  # no weights drawn in real memory, only the meta device's no-ops
    sharded = {name: p.full_tensor() for name, p in trainee.raw.named_parameters()}
    assert sharded.keys() == dict(full.named_parameters()).keys()
    for name, p in full.named_parameters():
        assert p.device == CPU and not isinstance(p, torch.distributed.tensor.DTensor)
        assert torch.equal(p, sharded[name]), name
    assert full.lm_head.weight is full.transformer.wte.weight  # still tied: one matrix, not two
    idx = torch.randint(0, 100, (1, 8))
    assert torch.allclose(full(idx)[0], trainee.raw(idx)[0], atol=1e-6)


def test_fsdp_shards_the_model_before_it_reaches_the_device_never_moving_the_whole_of_it(fsdp_group_of_one,
                                                                                          monkeypatch):
    from torch.distributed.fsdp._fully_shard import _fsdp_init
    model = GPT(PRESETS["tiny"])
    total = sum(p.numel() for p in model.parameters())
    largest_unit = total - PRESETS["tiny"].n_layer * sum(p.numel() for p in model.transformer.h[0].parameters())
    monkeypatch.setattr(model, "to", lambda *a, **k: pytest.fail("moved the whole unsharded model to the device"))
    moved, move = [], _fsdp_init._move_states_to_device
    monkeypatch.setattr(_fsdp_init, "_move_states_to_device", lambda params, buffers, device: (
        moved.append(sum(p.numel() for p in params)), move(params, buffers, device))[1])
    parallel.build_training_model(model, fsdp_group_of_one, torch.float32, TrainConfig(max_lr=1e-3), compile=False,
                                  parallel="fsdp")
    # FSDP moves one unit at a time (each Block, then the root's embeddings and last LayerNorm), each once.
    assert sum(moved) == total and max(moved) == largest_unit < total

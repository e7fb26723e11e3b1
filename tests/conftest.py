"""Shared test fixtures and helpers: the offline data beside the project (../shared/data), tiny shard
directories, tiny saved models, perturbed weights and free ports. (Launching train_gpt2.py: helpers_train.py.)"""

import errno
import json
import os
import socket
import subprocess
import sys
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path

# The CPU the tests run as, in this process and in every Python the tests start (cpu_host/cpu_host.py says how):
# set up before torch is imported, which reads TESTS_CPU=avx2's settings as it starts.
CPU_HOST = Path(__file__).resolve().parent / "cpu_host"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CPU_HOST), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(CPU_HOST))
import cpu_host  # noqa: E402

# isort: split
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("SHARED_DATA", ROOT.parent / "shared" / "data"))
TIKTOKEN_CACHE = SHARED_DATA / "gpt2_tokenizer" / "tiktoken_cache"
sys.path.insert(0, str(ROOT))

# Test models are tiny: a second intra-op thread only adds spin-waiting on the 2 shared cores, never speed.
torch.set_num_threads(1)

# tiktoken reads the GPT-2 tokenizer from this cache instead of downloading it (tests never touch the network).
if TIKTOKEN_CACHE.is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))


def pytest_report_header() -> str | None:
    if os.environ.get("TESTS_CPU") == "avx2":
        return (f"TESTS_CPU=avx2: as on an AVX2-only x86 CPU (torch's kernels: "
                f"{torch.backends.cpu.get_cpu_capability()}; AMX: {torch.cpu._is_amx_tile_supported()})")
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under mutmut (docs/reliability.md, "Mutation testing"), the quickest tests first, a module at a time (its
    fixtures are built once): pytest stops at a mutant's first failing test, so a killed mutant costs the quick
    tests before its killer, not every slow one mutmut happened to list first."""
    stats = Path("mutmut-stats.json")  # mutmut runs the tests in mutants/, beside its timings
    if os.environ.get("MUTANT_UNDER_TEST", "stats") == "stats" or not stats.is_file():
        return
    seconds = json.loads(stats.read_text())["duration_by_test"]
    per_module: dict[str, float] = {}
    for item in items:
        per_module[item.module.__name__] = per_module.get(item.module.__name__, 0) + seconds.get(item.nodeid, 0)
    items.sort(key=lambda item: (per_module[item.module.__name__], seconds.get(item.nodeid, 0)))


@pytest.fixture(params=[pytest.param(True, id="bf16_cpu", marks=pytest.mark.slow), pytest.param(False, id="fp32_cpu")])
def cpu_bf16(request, monkeypatch) -> bool:
    """The test twice, whatever this machine is: as on a CPU with bf16 arithmetic (AVX512-BF16 or AMX: --dtype auto
    is bf16, and so is Muon's Newton–Schulz) and as on one without (AVX2: fp32 for both), in the processes it starts
    too. Every test whose path asks precision.cpu_has_bf16_arithmetic needs it (cpu_host/cpu_host.py). The inner loop
    (-m 'not slow') runs the second only: the one that is fast on every CPU."""
    monkeypatch.setenv(cpu_host.FORCED, "1" if request.param else "0")
    return request.param


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data, or skip: the tests that need real data say so instead of passing without checking."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"needs the offline data in {SHARED_DATA} (set SHARED_DATA to its location)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def gpt2_encoding(shared_data):
    import tiktoken
    if not TIKTOKEN_CACHE.is_dir():
        pytest.skip(f"needs the GPT-2 tokenizer cache in {TIKTOKEN_CACHE}")
    return tiktoken.get_encoding("gpt2")


def make_shards(directory: Path, split: str, sizes: list[int], seed: int = 0, vocab: int = 50257,
                tokenizer: str = "gpt2") -> list[np.ndarray]:
    """Write random-token shards of the given sizes; returns their token arrays (for checking what was read).
    tokenizer="bytes" records them as the bytes tokenizer's (vocab ≤ 257): the model is then 257 ids wide, not
    50,257, and a test's every step and snapshot several times cheaper."""
    from data.tokenize_shards import record_shards
    from data.tokenizer_flag import load_tokenizer
    from dataloader import write_shard
    directory.mkdir(parents=True, exist_ok=True)
    names = [f"test_{split}_{i:06d}.bin" for i in range(len(sizes))]
    if tokenizer != "gpt2":  # (GPT-2's shards need no manifest)
        record_shards(directory, load_tokenizer(tokenizer).spec, names)
    rng = np.random.default_rng(seed)
    arrays = []
    for name, n in zip(names, sizes):
        tokens = rng.integers(0, vocab, size=n, dtype=np.int64)
        write_shard(directory / name, tokens)
        arrays.append(tokens)
    return arrays


def make_document_shards(directory: Path, split: str, row: int, sizes: list[int], seed: int = 0,
                         vocab: int | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Shards of documents of 1 to 3·row text tokens, each preceded by EOT (as data/prepare.py writes them), every
    other token its own position plus 10,000·shard, so a batch tells where it came from; or, with vocab, that modulo
    vocab (each token then predicts the next: a run's loss falls fast). Returns (tokens, document starts) by shard;
    a shard opens with a document."""
    from dataloader import EOT, write_shard
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays, starts = [], []
    for i, n in enumerate(sizes):
        tokens = np.arange(n) + 10_000 * i
        if vocab is not None:
            tokens %= vocab
        eots = np.cumsum(rng.integers(2, 3 * row + 2, size=n))
        tokens[eots[eots < n]] = EOT
        write_shard(directory / f"docs_{split}_{i:06d}.bin", tokens)
        arrays.append(tokens)
        starts.append(np.concatenate([[0], eots[eots < n - 1] + 1]))
    return arrays, starts


def perturb_(model: torch.nn.Module, scale: float, seed: int = 0) -> torch.nn.Module:
    """Add noise to every parameter, so LayerNorm gains and biases are no longer 1 and 0 and a mix-up between
    weights (a missed transpose, a swapped or dropped tensor) shows in the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


def save_tiny_model(path: Path, block_size: int = 64, perturb: float = 0.0, arch: str = "gpt2") -> Path:
    """A random `tiny` GPT (of the architecture arch, modern as train_gpt2.py builds it) saved as just a snapshot's
    {"model", "model_config"}, as snapshot.read_model reads it; perturb > 0 moves every weight away from its init."""
    from dataclasses import replace

    from model import GPT, PRESETS, with_arch

    torch.manual_seed(0)
    model = perturb_(GPT(with_arch(replace(PRESETS["tiny"], block_size=block_size), arch)), perturb)
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config)}, path)
    return path


def tiny_snapshots(data: Path, snapshot_dir: Path, log=print, guard=None, every: int = 1, keep_last: int = 2):
    """The Snapshots of a one-process CPU run of the tiny model (fp32, AdamW), its train loader reading data's shards
    2 × 16 tokens at a time: to test writing, pruning and rolling back without training."""
    from dataloader import DistributedDataLoader
    from model import GPT
    from rundir.store import Snapshots
    from training.config import TrainConfig
    from training.distributed import Distributed
    from training.inputs import resolve_plan
    from training.parallel import build_training_model

    cfg = TrainConfig(data_dir=str(data), model="tiny", micro_batch_size=2, seq_len=16, total_batch_size=32,
                      dtype="fp32", device="cpu", val_every=0)
    dist_env = Distributed(0, 0, 1, torch.device("cpu"))
    trainee = build_training_model(GPT(resolve_plan(cfg, 1).model_config), dist_env, torch.float32, cfg, compile=False)
    loader = DistributedDataLoader(data, "train", 2, 16)
    stateful = {"guard": guard} if guard is not None else {}
    return Snapshots(str(snapshot_dir), every, keep_last, "never", trainee, loader, asdict(cfg), dist_env, log,
                     stateful)


def copy_run(source: Path, destination: Path, *steps: int) -> None:
    """Copy a run's directory as a user would (cp -r): its run.json and the snapshots of `steps` with their .json
    files (all of them without steps), the snapshots being files (ddp) or directories (fsdp)."""
    import shutil
    destination.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "run.json", destination)
    for path in source.glob("snapshot_*"):
        if not steps or int(path.name[9:16]) in steps:
            (shutil.copytree if path.is_dir() else shutil.copy)(path, destination / path.name)


def failing(error_number: int):
    """A stand-in for a system call (os.open, fcntl.flock, ...) that fails with error_number, as the kernel's does."""
    def fail(*args, **kwargs):
        raise OSError(error_number, os.strerror(error_number))
    return fail


def eio_the_first_time(monkeypatch) -> list[int]:
    """snapshot.torch_save failing with EIO (half a file written) the first time; returns the steps it was given."""
    from rundir import snapshot

    writes, real_torch_save = [], snapshot.torch_save

    def save(obj, f):
        writes.append(obj["step"])
        if len(writes) == 1:
            f.write(b"half a snapshot")
            raise OSError(errno.EIO, "Input/output error")
        real_torch_save(obj, f)

    monkeypatch.setattr(snapshot, "torch_save", save)
    return writes


@contextmanager
def mounted_tmpfs(directory: Path, options: str):
    """A real filesystem at `directory`: a tmpfs with mount options, e.g. size=1m (a disk to fill) or ro (a
    read-only one, which stops root too, where permission bits do not); skips the test where mounting is not
    allowed (not root, no CAP_SYS_ADMIN)."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"needs to mount a tmpfs (as root): {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def fill_up(directory: Path) -> None:
    """Fill the filesystem of `directory` (a small tmpfs) with a ballast file, to the last byte."""
    with open(directory / "ballast", "wb", buffering=0) as ballast, suppress(OSError):
        while ballast.write(b"x" * 4096):
            pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flip_a_byte_in_tensor_data(path: Path) -> str:
    """Flip one byte in the middle of the largest tensor of a torch file (not in its pickle or zip directory, where
    loading would fail anyway): the silent corruption a bad disk or copy causes. Returns the record's name."""
    import zipfile
    with zipfile.ZipFile(path) as archive:
        record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(record.header_offset + 26)  # the local header: name and extra-field lengths, then they, then the data
        name_length, extra_length = (int.from_bytes(f.read(2), "little") for _ in range(2))
        f.seek(record.header_offset + 30 + name_length + extra_length + record.file_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    return record.filename


# ----------------------------------------------------------------------------------------------------------------
# tests/gpu: the GPU acceptance tests (marker `gpu`, run by gpu_check.py). On a CUDA GPU they run at GPU size; with
# GPU_TESTS_DEVICE=cpu (gpu_check.py --cpu-smoke) on the CPU at a tiny size, so that they cannot rot; else they skip.
GPU_TESTS_DEVICE = "GPU_TESTS_DEVICE"
GPU_TESTS_COMPILE = "GPU_TESTS_COMPILE"  # =1: the torch.compile ones on the CPU too (minutes on 2 cores)


@pytest.fixture(scope="session")
def gpu_device() -> torch.device:
    if os.environ.get(GPU_TESTS_DEVICE) == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("needs a CUDA GPU (`python -m tools.gpu_check --out DIR` runs these; `--cpu-smoke` on the CPU)")


@pytest.fixture(scope="session")
def gpu_compile(gpu_device) -> bool:
    """Whether the GPU tests compile: always on CUDA; on the CPU only with GPU_TESTS_COMPILE=1."""
    return gpu_device.type == "cuda" or os.environ.get(GPU_TESTS_COMPILE) == "1"

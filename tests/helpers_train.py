"""Helpers for tests that run train_gpt2.py end to end: tiny datasets and a launcher that returns metrics.jsonl.

    args = ["--data_dir", str(data), "--max_steps", "5"]
    run = run_train(args, tmp_path / "logs", nproc=2)  # 2 ranks under torchrun; waits for the end
    losses = [r["loss"] for r in run.train]

    proc = start_train(args, tmp_path / "logs")  # or start it, signal it mid-run, then wait
    os.killpg(proc.pid, signal.SIGTERM)
    run = wait_train(proc, tmp_path / "logs", check=False)

Each launch starts a fresh Python that imports torch (a few seconds; torchrun with 2 ranks, 10-20 s on 2 cores),
so tests should share runs through module-scoped fixtures.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train_gpt2
from conftest import ROOT
from training.distributed import teardown_distributed

TRAIN_SCRIPT = ROOT / "train_gpt2.py"
PAUSING = ROOT / "tests" / "train_with_pauses.py"  # train_gpt2.py, held before chosen calls (PAUSES)

# A 2-layer, 64-wide model on the CPU, with the slow or networked extras off. Later flags in a command win, so
# a test can override any of these by passing the flag again.
TINY_ARGS = ["--model", "tiny", "--device", "cpu", "--eval_every", "0", "--sample_every", "0"]


def write_text_shards(directory: Path, text: str, encoding, val_fraction: float = 0.1) -> tuple[int, int]:
    """Tokenise text (GPT-2 BPE, no special tokens) into one train and one val shard, split by characters as
    nanoGPT splits Tiny Shakespeare. Returns the number of (train, val) tokens."""
    from dataloader import write_shard

    directory.mkdir(parents=True, exist_ok=True)
    cut = int(len(text) * (1 - val_fraction))
    sizes = []
    for split, part in (("train", text[:cut]), ("val", text[cut:])):
        tokens = np.array(encoding.encode_ordinary(part), dtype=np.int64)
        write_shard(directory / f"text_{split}_000000.bin", tokens)
        sizes.append(tokens.size)
    return sizes[0], sizes[1]


def train_command(args: Sequence[str], nproc: int | None = None, launcher_args: Sequence[str] = (),
                  script: Path = TRAIN_SCRIPT) -> list[str]:
    """The command line: plain `python train_gpt2.py` when nproc is None, else torchrun with nproc CPU processes
    (torchrun's --standalone picks a free port itself). launcher_args go to torchrun, e.g. ["--max-restarts", "1"];
    script replaces train_gpt2.py (e.g. tests/train_with_planted_nan.py)."""
    if nproc is None:
        return [sys.executable, str(script), *TINY_ARGS, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            *launcher_args, str(script), *TINY_ARGS, *args]


def train_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a training subprocess: ours, one thread per process (2 cores are shared by every rank
    and every test), unbuffered output, plus `env`."""
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | (env or {})


def read_metrics(log_dir: Path) -> list[dict]:
    """Every record of log_dir/metrics.jsonl in order (empty if the run never wrote one)."""
    path = Path(log_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class TrainRun:
    proc: subprocess.CompletedProcess
    records: list[dict]  # metrics.jsonl, every line

    @property
    def train(self) -> list[dict]:
        return [r for r in self.records if "loss" in r]

    @property
    def val(self) -> list[dict]:
        return [r for r in self.records if "val_loss" in r]

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr


def start_train(args: Sequence[str], log_dir: Path, nproc: int | None = None, env: dict[str, str] | None = None,
                launcher_args: Sequence[str] = (), script: Path = TRAIN_SCRIPT) -> subprocess.Popen:
    """Start train_gpt2.py with TINY_ARGS + args + --log_dir log_dir, in log_dir, without waiting (to signal or kill
    it mid-run): one plain process when nproc is None, else torchrun with nproc ranks (see train_command). env adds
    to train_env(). It runs in a session of its own, so os.killpg(proc.pid, ...) reaches torchrun's workers too."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    command = train_command([*args, "--log_dir", str(log_dir)], nproc, launcher_args, script)
    return subprocess.Popen(command, cwd=log_dir, env=train_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def run_train(args: Sequence[str], log_dir: Path, nproc: int | None = None, env: dict[str, str] | None = None,
              timeout: float = 300, check: bool = True, launcher_args: Sequence[str] = (),
              script: Path = TRAIN_SCRIPT) -> TrainRun:
    """start_train, then wait for the run and read its metrics.jsonl.

    check: fail the test, showing the output, if the run exits non-zero (pass False to test failures). On timeout
    the whole process group (torchrun and its workers) is killed and the test fails with the output so far.
    """
    proc = start_train(args, log_dir, nproc, env, launcher_args, script)
    return wait_train(proc, log_dir, timeout, check)


def wait_train(proc: subprocess.Popen, log_dir: Path, timeout: float = 300, check: bool = True) -> TrainRun:
    """Wait for a run from start_train and read its metrics.jsonl (check and timeout as in run_train)."""
    command = " ".join(proc.args)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{command} ran past {timeout} s and was killed.\n{_tail(stdout, stderr)}") from None
    if check and proc.returncode != 0:
        raise AssertionError(f"{command} exited with {proc.returncode}.\n{_tail(stdout, stderr)}")
    return TrainRun(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), read_metrics(log_dir))


def _tail(stdout: str, stderr: str, chars: int = 4000) -> str:
    return f"--- stdout (end) ---\n{stdout[-chars:]}\n--- stderr (end) ---\n{stderr[-chars:]}"


# ----------------------------------------------------------------------------------------------------------------
# runs in the background, for tests that interrupt them

@contextmanager
def launched(args: list[str], log_dir: Path, nproc: int, launcher_args: list[str] = (), script: Path = TRAIN_SCRIPT):
    """Start train_gpt2.py (or script) under torchrun without waiting; kill it and its workers if the test fails."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "output.txt", "w") as output:
        proc = subprocess.Popen(train_command([*args, "--log_dir", str(log_dir)], nproc, launcher_args, script),
                                cwd=log_dir, env=train_env(), stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_until(condition, proc: subprocess.Popen, log_dir: Path, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            state = f"exited with {proc.returncode}" if proc.poll() is not None else f"ran {timeout} s"
            raise AssertionError(f"the run {state} before {what}:\n{(log_dir / 'output.txt').read_text()[-4000:]}")
        time.sleep(0.05)


def records_so_far(log_dir: Path) -> list[dict]:
    """metrics.jsonl of a run that is still writing it: a line caught half-written waits for the next look."""
    path = log_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("\n")]


def worker_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """torchrun's worker processes, its children, by RANK (read from their environment in /proc)."""
    workers = {}
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            parent = int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc_dir / "environ").read_bytes().split(b"\0") if parent == launcher.pid else []
        except (OSError, ValueError, IndexError):  # the process ended while we looked
            continue
        rank = [int(v[5:]) for v in environ if v.startswith(b"RANK=")]
        if rank:
            workers[rank[0]] = int(proc_dir.name)
    return workers


def main_in_process(argv: list[str]) -> None:
    """train_gpt2.main in this process (no interpreter to start), undoing the process-wide settings it makes."""
    handler, precision = signal.getsignal(signal.SIGTERM), torch.get_float32_matmul_precision()
    try:
        train_gpt2.main([*TINY_ARGS, *argv])
    finally:  # what the run sets for its process must not outlive it in ours
        signal.signal(signal.SIGTERM, handler)
        torch.set_float32_matmul_precision(precision)


# ----------------------------------------------------------------------------------------------------------------
# spawned process groups, for tests of what ranks do together without a whole run

class RandomBatches:
    """A rank's own micro-batches of random tokens, handed to training.train_step as a data loader would."""

    def __init__(self, seed: int, vocab_size: int, batch_size: int = 2, seq_len: int = 16):
        self.generator = torch.Generator().manual_seed(seed)
        self.shape, self.vocab_size = (batch_size, seq_len + 1), vocab_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, self.vocab_size, self.shape, generator=self.generator)
        return tokens[:, :-1], tokens[:, 1:]


def _rank_main(rank: int, world_size: int, directory: str, worker, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=2))
    try:
        (Path(directory) / f"rank{rank}.json").write_text(json.dumps(worker(rank, *args)))
        if dist.is_initialized():  # (unless the worker tore the group down itself)
            dist.barrier()  # leave together: a rank tearing gloo down while its peer still talks can abort the peer
    finally:
        teardown_distributed()


def on_ranks(worker, directory: Path, *args, world_size: int = 2) -> list:
    """worker(rank, *args) in world_size spawned processes joined in a gloo process group (seconds, where torchrun
    and train_gpt2.py take tens of them); what each rank's call returned (through JSON), by rank. worker must be a
    module-level function, so that the spawned processes can import it."""
    directory.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank_main, args=(world_size, str(directory), worker, args), nprocs=world_size)
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(world_size)]


# ----------------------------------------------------------------------------------------------------------------
# runs held at a chosen call (tests/train_with_pauses.py), to change something under them at a known point

def start_paused(args: list[str], log_dir: Path, pauses: list[tuple[str, int]], nproc: int | None = None):
    """start_train of train_with_pauses.py, held before the call-th call of each (name, call) in pauses."""
    return start_train(args, log_dir, nproc, env={"PAUSES": json.dumps(pauses)}, script=PAUSING)


def wait_for_pause(proc, log_dir: Path, name: str, call: int, ranks: int = 1) -> list[Path]:
    """Wait until every rank waits before the call-th call of `name`; their markers, to delete to go on."""
    markers = [log_dir / f"paused_{name}_{call}_rank{rank}" for rank in range(ranks)]
    deadline = time.monotonic() + 300
    while not all(marker.exists() for marker in markers):
        assert proc.poll() is None and time.monotonic() < deadline, (name, call, proc.communicate()[1][-4000:])
        time.sleep(0.05)
    return markers


def go_on(markers: list[Path]) -> None:
    for marker in markers:
        marker.unlink()

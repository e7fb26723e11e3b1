"""Multi-node training: two torchrun launchers ("nodes") that meet through the c10d rendezvous train exactly like
one launcher with two processes.

Both nodes run on this machine, on 127.0.0.1, and share one --log_dir as real nodes share a filesystem.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import free_port, make_shards
from helpers_train import TINY_ARGS, TRAIN_SCRIPT, TrainRun, read_metrics, run_train, train_env

pytestmark = pytest.mark.slow  # two torchrun launchers

JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--max_steps", "4",
       "--warmup_steps", "1", "--val_every", "2", "--val_tokens", "64", "--dtype", "fp32", "--snapshot_every", "0"]


def node_command(node_rank: int, port: int, run_id: str, args: list[str]) -> list[str]:
    """One node's launcher, as the README shows it: one process on this node, 2 nodes in all."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
            "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={run_id}",
            "--local_addr=127.0.0.1", str(TRAIN_SCRIPT), *TINY_ARGS, *args]


def run_two_nodes(args: list[str], log_dir: Path, timeout: float = 180) -> TrainRun:
    """Launch both nodes' torchrun and wait for both; on timeout kill both whole process groups and fail.
    (helpers_train.run_train launches one torchrun with --standalone, which cannot span nodes.)"""
    log_dir.mkdir(parents=True, exist_ok=True)
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    commands = [node_command(rank, port, run_id, [*args, "--log_dir", str(log_dir)]) for rank in (0, 1)]
    procs = [subprocess.Popen(c, cwd=log_dir, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for c in commands]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        tails = "\n".join(f"--- node {r} ---\n{p.communicate()[0][-3000:]}" for r, p in enumerate(procs))
        raise AssertionError(f"the 2-node job ran past {timeout} s and was killed.\n{tails}") from None
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {rank} exited with {proc.returncode}:\n{out[-4000:]}"
    output = "\n".join(outputs)
    return TrainRun(subprocess.CompletedProcess(commands, 0, output, ""), read_metrics(log_dir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[TrainRun, TrainRun]:
    root = tmp_path_factory.mktemp("multinode")
    make_shards(root / "data", "train", [300, 300], seed=0, vocab=256, tokenizer="bytes")  # (a 257-wide model)
    make_shards(root / "data", "val", [200], seed=1, vocab=256, tokenizer="bytes")
    args = [*JOB, "--data_dir", str(root / "data")]
    with ThreadPoolExecutor(2) as pool:  # 4 processes on 2 cores, but most of each run is startup
        one_node = pool.submit(run_train, args, root / "one_node", nproc=2, timeout=180)
        two_nodes = pool.submit(run_two_nodes, args, root / "two_nodes")
        return one_node.result(), two_nodes.result()


def test_two_nodes_train_like_two_processes_on_one_node(runs):
    one_node, two_nodes = runs
    assert "device: cpu × 2 ranks" in one_node.proc.stdout and "device: cpu × 2 ranks" in two_nodes.output
    for key, steps in (("loss", [0, 1, 2, 3]), ("val_loss", [0, 2, 3])):
        expected = {r["step"]: r[key] for r in one_node.records if key in r}
        got = {r["step"]: r[key] for r in two_nodes.records if key in r}
        assert sorted(expected) == sorted(got) == steps
        rel = max(abs(got[s] - expected[s]) / abs(expected[s]) for s in steps)
        print(f"{key}: max relative difference {rel:.1e}")
        assert rel <= 1e-5

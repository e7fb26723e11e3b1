"""slurm/train_gpt2.sbatch without SLURM: run with faked SLURM_* variables and stub `scontrol` and `srun` (srun
starts the script's torchrun line once per "node", all on 127.0.0.1), its two launchers train together; USR1 before
the time limit makes them snapshot and requeues the job, and the requeued job resumes from that snapshot."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT, free_port, make_shards
from helpers_train import TINY_ARGS, read_metrics, records_so_far, train_env

SCRIPT = ROOT / "slurm" / "train_gpt2.sbatch"
JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--max_steps", "12",
       "--warmup_steps", "1", "--val_every", "0", "--dtype", "fp32", "--ckpt_every", "1000"]

STUB_SRUN = f"""#!{sys.executable}
# srun for tests: the command once per node of the job, all on this machine; SIGTERM goes on to every task.
import os, signal, subprocess, sys
command = sys.argv[1:]
while command[0].startswith("-"):  # srun's own flags (the script writes them as --flag=value)
    command.pop(0)
tasks = [subprocess.Popen(command, env=os.environ | {{"SLURM_NODEID": str(n), "SLURM_PROCID": str(n)}})
         for n in range(int(os.environ["SLURM_JOB_NUM_NODES"]))]
signal.signal(signal.SIGTERM, lambda *_: [t.send_signal(signal.SIGTERM) for t in tasks])
sys.exit(max(t.wait() for t in tasks))
"""

STUB_SCONTROL = """#!/bin/bash
# scontrol for tests: `show hostnames` names 127.0.0.1 once per node; any other call is written to $SCONTROL_LOG.
if [ "$1 $2" = "show hostnames" ]; then yes 127.0.0.1 | head -n "$SLURM_JOB_NUM_NODES"
else echo "$*" >> "$SCONTROL_LOG"; fi
"""


def test_the_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def fake_slurm_env(tmp_path: Path, restart_count: int = 0) -> dict[str, str]:
    """What SLURM would set for a 2-node job, the script's settings for a tiny CPU run, and the stubs on PATH."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
            (bin_dir / name).write_text(textwrap.dedent(text))
            (bin_dir / name).chmod(0o755)
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"  # torchrun: beside this Python
    return train_env({
        "PATH": path, "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "tiny", "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_RESTART_COUNT": str(restart_count),
        "DATA_DIR": str(tmp_path / "data"), "LOG_DIR": str(tmp_path / "logs"), "GPUS_PER_NODE": "1",
        "RDZV_PORT": str(free_port()), "TORCHRUN_ARGS": "--local_addr=127.0.0.1",
        "TRAIN_ARGS": " ".join([*TINY_ARGS, *JOB]), "SCONTROL_LOG": str(tmp_path / "scontrol.log")})


def start_job(tmp_path: Path, restart_count: int = 0) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SCRIPT)], env=fake_slurm_env(tmp_path, restart_count), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(job: subprocess.Popen, timeout: float = 120) -> str:
    try:
        return job.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        raise AssertionError(f"the job ran past {timeout} s:\n{job.communicate()[0][-4000:]}") from None


@pytest.mark.slow  # two 2-node jobs
def test_two_nodes_train_together_and_a_requeue_before_the_time_limit_resumes_from_the_snapshot(tmp_path):
    if shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("needs the torchrun script beside this Python")
    make_shards(tmp_path / "data", "train", [600], seed=0)
    make_shards(tmp_path / "data", "val", [200], seed=1)
    logs = tmp_path / "logs"

    job = start_job(tmp_path)
    deadline = time.monotonic() + 90
    while not any(r.get("step", 0) >= 1 and "loss" in r for r in records_so_far(logs)):
        assert job.poll() is None and time.monotonic() < deadline, finish(job)[-4000:]
        time.sleep(0.1)
    os.kill(job.pid, signal.SIGUSR1)  # what --signal=B:USR1@300 sends the batch shell
    output = finish(job)
    assert "device: cpu × 2 ranks" in output  # the two launchers met and trained as one job
    assert "rendezvous on 127.0.0.1:" in output and "the time limit is near" in output
    stopped_after = max(r["step"] for r in read_metrics(logs) if "loss" in r)
    assert f"stopping after step {stopped_after} on SIGTERM" in output
    assert (logs / f"snapshot_{stopped_after:07d}.pt").is_file()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"

    output = finish(start_job(tmp_path, restart_count=1))  # SLURM starts the requeued job from the top
    assert f"resuming from {logs / f'snapshot_{stopped_after:07d}.pt'} at step {stopped_after + 1}" in output
    steps = [r["step"] for r in read_metrics(logs) if "loss" in r]
    assert steps == list(range(12))  # each step once, to the end

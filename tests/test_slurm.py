"""slurm/train_gpt2.sbatch without SLURM: run with faked SLURM_* variables and the stubs in tests/slurm_stubs, which
signal processes as real SLURM does (srun SIGKILLs its tasks when it gets SIGTERM; scancel --signal reaches the
tasks and not srun). srun starts the script's torchrun line once per "node", all on 127.0.0.1, and the two launchers
train together; the warning before the time limit makes them snapshot and requeues the job, and the requeued job
resumes from that snapshot."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

from conftest import ROOT, free_port, make_shards
from helpers_train import TINY_ARGS, read_metrics, records_so_far, train_env
from slurm_stubs.fake_slurm import signal_steps

SCRIPT = ROOT / "slurm" / "train_gpt2.sbatch"
STUBS = ROOT / "tests" / "slurm_stubs"
JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--max_steps", "12",
       "--warmup_steps", "1", "--val_every", "0", "--dtype", "fp32", "--snapshot_every", "1000"]

# A torchrun that trains nothing, for the tests of the signals alone: on SIGTERM it takes a moment (a step and a
# snapshot), writes $LOG_DIR/snapshot_<node> and exits 0, as train_gpt2.py's workers do; SIGKILL leaves no file.
FAKE_TORCHRUN = f"""#!{sys.executable}
import os, pathlib, signal, sys, time
node = os.environ["SLURM_NODEID"]
def snapshot_and_exit(*_):
    time.sleep(0.5)
    (pathlib.Path(os.environ["LOG_DIR"]) / f"snapshot_{{node}}").touch()
    sys.exit(0)
signal.signal(signal.SIGTERM, snapshot_and_exit)
(pathlib.Path(os.environ["LOG_DIR"]) / f"ready_{{node}}").touch()
while True:
    time.sleep(1)
"""


def test_the_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def fake_slurm_env(tmp_path: Path, restart_count: int = 0, fake_torchrun: bool = False) -> dict[str, str]:
    """What SLURM would set for a 2-node job (a requeued one starts afresh, with steps of its own), the script's
    settings for a tiny CPU run, and the stubs on PATH (with fake_torchrun, FAKE_TORCHRUN in front of them)."""
    slurm_dir = tmp_path / f"slurm_{restart_count}"
    slurm_dir.mkdir()
    path = [str(STUBS), str(Path(sys.executable).parent), os.environ["PATH"]]  # torchrun: beside this Python
    if fake_torchrun:
        (slurm_dir / "torchrun").write_text(FAKE_TORCHRUN)
        (slurm_dir / "torchrun").chmod(0o755)
        path.insert(0, str(slurm_dir))
    (tmp_path / "logs").mkdir(exist_ok=True)
    return train_env({
        "PATH": os.pathsep.join(path), "FAKE_SLURM_DIR": str(slurm_dir), "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "tiny", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_RESTART_COUNT": str(restart_count),
        "DATA_DIR": str(tmp_path / "data"), "LOG_DIR": str(tmp_path / "logs"), "GPUS_PER_NODE": "1",
        "RDZV_PORT": str(free_port()), "TORCHRUN_ARGS": "--local_addr=127.0.0.1",
        "TRAIN_ARGS": " ".join([*TINY_ARGS, *JOB])})


def start_job(tmp_path: Path, restart_count: int = 0, fake_torchrun: bool = False) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SCRIPT)], env=fake_slurm_env(tmp_path, restart_count, fake_torchrun),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(job: subprocess.Popen, timeout: float = 120) -> str:
    """The job's output once it has ended; then, as SLURM does at the end of a job, SIGKILL what is left of it."""
    try:
        return job.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        raise AssertionError(f"the job ran past {timeout} s:\n{job.communicate()[0][-4000:]}") from None
    finally:
        with suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)


def wait_for(condition, job: subprocess.Popen, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert job.poll() is None and time.monotonic() < deadline, f"no {what}:\n{finish(job)[-4000:]}"
        time.sleep(0.1)


def send_the_time_limit_warning(job: subprocess.Popen, tmp_path: Path) -> None:
    """What SLURM does sig_time seconds before the time limit for the script's `#SBATCH --signal=[B:]SIG@sig_time`
    (sbatch(1)): with B:, SIG to the batch shell alone; without, SIG to every process of the job's steps, and not
    to the batch shell."""
    batch_shell_only, name = re.search(r"^#SBATCH --signal=(B:)?(\w+)@\d+$", SCRIPT.read_text(), re.M).groups()
    if batch_shell_only:
        os.kill(job.pid, signal.Signals[f"SIG{name}"])
    else:
        signal_steps(tmp_path / "slurm_0", signal.Signals[f"SIG{name}"])


def test_srun_sigkills_its_tasks_on_sigterm_and_scancel_signal_reaches_them_as_in_slurm(tmp_path):
    env = fake_slurm_env(tmp_path, fake_torchrun=True)
    logs = tmp_path / "logs"
    sigterm_to_srun = lambda srun: srun.send_signal(signal.SIGTERM)
    scancel = lambda srun: subprocess.run(["scancel", "--signal=TERM", "4242"], env=env, check=True)
    for stop, status, snapshots in ((sigterm_to_srun, 128 + signal.SIGKILL, []),
                                    (scancel, 0, ["snapshot_0", "snapshot_1"])):
        srun = subprocess.Popen(["srun", "--ntasks-per-node=1", "torchrun"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        wait_for(lambda: len(list(logs.glob("ready_*"))) == 2, srun, "two ready tasks")
        stop(srun)
        finish(srun, timeout=30)
        assert srun.returncode == status
        assert sorted(p.name for p in logs.glob("snapshot_*")) == snapshots
        for path in logs.iterdir():
            path.unlink()


def test_before_the_time_limit_every_node_snapshots_and_the_job_is_requeued(tmp_path):
    job = start_job(tmp_path, fake_torchrun=True)
    wait_for(lambda: len(list((tmp_path / "logs").glob("ready_*"))) == 2, job, "two ready launchers")
    send_the_time_limit_warning(job, tmp_path)
    output = finish(job)
    assert "the time limit is near" in output
    assert sorted(p.name for p in (tmp_path / "logs").glob("snapshot_*")) == ["snapshot_0", "snapshot_1"], output
    assert (tmp_path / "slurm_0" / "calls").read_text() == "scancel --signal=TERM 4242\nscontrol requeue 4242\n"


@pytest.mark.slow  # two 2-node jobs
def test_two_nodes_train_together_and_a_requeue_before_the_time_limit_resumes_from_the_snapshot(tmp_path):
    if shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("needs the torchrun script beside this Python")
    make_shards(tmp_path / "data", "train", [600], seed=0)
    make_shards(tmp_path / "data", "val", [200], seed=1)
    logs = tmp_path / "logs"

    job = start_job(tmp_path)
    wait_for(lambda: any(r.get("step", 0) >= 1 and "loss" in r for r in records_so_far(logs)), job, "step 1")
    send_the_time_limit_warning(job, tmp_path)
    output = finish(job)
    assert "device: cpu × 2 ranks" in output  # the two launchers met and trained as one job
    assert "rendezvous on 127.0.0.1:" in output and "the time limit is near" in output
    stopped_after = max(r["step"] for r in read_metrics(logs) if "loss" in r)
    assert f"stopping after step {stopped_after} on SIGTERM" in output
    assert (logs / f"snapshot_{stopped_after:07d}.pt").is_file()
    assert (tmp_path / "slurm_0" / "calls").read_text() == "scancel --signal=TERM 4242\nscontrol requeue 4242\n"

    output = finish(start_job(tmp_path, restart_count=1))  # SLURM starts the requeued job from the top
    assert f"resuming from {logs / f'snapshot_{stopped_after:07d}.pt'} at step {stopped_after + 1}" in output
    steps = [r["step"] for r in read_metrics(logs) if "loss" in r]
    assert steps == list(range(12))  # each step once, to the end

"""slurm/train_gpt2.sbatch on a real one-node SLURM cluster (tests/slurm_cluster.py: munged, slurmctld and slurmd;
skipped, saying why, where they cannot run; tests/test_slurm.py covers the script with stubs everywhere). Two
workers of a tiny CPU model train under the script as sbatch submits it, and each test compares the losses with
an uninterrupted torchrun of the same flags:
- the time limit's warning (the script's `#SBATCH --signal=B:USR1@300`) makes the job snapshot, requeue itself
  and resume at the next step; so does a requeue by SLURM, as preemption makes one;
- scancel stops it with a snapshot, and submitting it again resumes there;
- a branch (--resume PARENT into a LOG_DIR of its own) whose processes are SIGKILLed, requeued by SLURM with the
  identical command, continues the branch (issue 55, case 2).
"""

import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, free_port, make_shards
from helpers_train import TINY_ARGS, TrainRun, read_metrics, records_so_far, run_train, train_env
from rundir.snapshot import SNAPSHOT_NAME, list_snapshots, snapshot_path
from slurm_cluster import UNFINISHED, SlurmCluster, SlurmUnavailable, one_node_cluster

pytestmark = pytest.mark.slow  # each test runs SLURM jobs of two torchrun workers

SCRIPT = ROOT / "slurm" / "train_gpt2.sbatch"
LAST_STEP = 39
JOB = ["--micro_batch_size", "2", "--seq_len", "16", "--total_batch_size", "64", "--max_steps", str(LAST_STEP + 1),
       "--warmup_steps", "1", "--val_every", "0", "--dtype", "fp32", "--snapshot_every", "4", "--keep_last", "20"]
ON_THIS_NODE = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2"]  # the script asks for 2 nodes × 8 GPUs
STOP_SNAPSHOT_ONLY = ["--snapshot_every", "1000"]  # so that a snapshot at the stop is the stop's, not a periodic one
JOB_TIMEOUT = 300  # seconds for a job to end, a requeue included (70 seen on 2 cores shared with other tests)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> SlurmCluster:
    if shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("needs the torchrun script beside this Python")
    try:
        with one_node_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
            yield cluster
    except SlurmUnavailable as e:
        pytest.skip(f"no SLURM cluster here: {e}")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("data")
    make_shards(directory, "train", [600], seed=0)
    make_shards(directory, "val", [200], seed=1)
    return directory


@pytest.fixture(scope="module")
def uninterrupted_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("uninterrupted")


@pytest.fixture(scope="module")
def uninterrupted(data, uninterrupted_dir) -> TrainRun:
    """The job's flags under plain torchrun, to the end; its snapshots (every 4 steps) are the branch's parents."""
    return run_train([*JOB, "--data_dir", str(data)], uninterrupted_dir, nproc=2)


@dataclass
class Job:
    id: int
    log_dir: Path
    output: Path  # the job's output file, appended to across requeues (the script's --open-mode=append)

    def text(self) -> str:
        return self.output.read_text() if self.output.exists() else ""


def submit(cluster: SlurmCluster, data: Path, log_dir: Path, train_args: Sequence[str] = ()) -> Job:
    """sbatch the script from the repository root as the README says, with its settings in the environment."""
    env = train_env({
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),  # torchrun
        "DATA_DIR": str(data), "LOG_DIR": str(log_dir), "GPUS_PER_NODE": "2", "RDZV_PORT": str(free_port()),
        "MAX_RESTARTS": "0",  # a run that fails fails once (torchrun's restarts are tests/test_resume.py's)
        "TORCHRUN_ARGS": "--local_addr=127.0.0.1", "TRAIN_ARGS": " ".join([*TINY_ARGS, *JOB, *train_args])})
    output = log_dir.with_suffix(".out")
    return Job(cluster.submit([*ON_THIS_NODE, f"--output={output}", str(SCRIPT)], env, cwd=ROOT), log_dir, output)


def wait_for_training(cluster: SlurmCluster, job: Job, condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT
    while not condition():
        state = cluster.state(job.id)
        assert state in UNFINISHED and time.monotonic() < deadline, \
            f"job {job.id} is {state}, and no {what}:\n{job.text()[-4000:]}"
        time.sleep(0.1)


def ended(cluster: SlurmCluster, job: Job, expected: str) -> dict[str, str]:
    """Wait for the job to end (its processes gone, a requeue run to the end); check its final state."""
    state = cluster.wait_until_ended(job.id, JOB_TIMEOUT)
    errors = dict.fromkeys(line for line in job.text().splitlines() if line.startswith("error:"))  # ours, once each
    assert state == expected, f"job {job.id} ended {state}, not {expected}: {list(errors)}\n{job.text()[-4000:]}"
    return cluster.job(job.id)


def stopped_after(job: Job) -> int:
    """The step after which the workers stopped on SIGTERM (rank 0 says so)."""
    stops = re.findall(r"stopping after step (\d+) on SIGTERM", job.text())
    assert len(stops) == 1, f"{len(stops)} stops on SIGTERM:\n{job.text()[-4000:]}"
    return int(stops[0])


def losses(records: list[dict]) -> dict[int, float]:
    """{step: loss}; a step logged twice (trained again after a crash) keeps its later line."""
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def resumes(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("event") == "resume"]


def assert_same_losses(records: list[dict], reference: TrainRun, steps: range) -> None:
    got, expected = losses(records), losses(reference.records)
    assert set(steps) <= set(got), f"steps {sorted(set(steps) - set(got))} were not logged"
    worst = max(abs(got[s] - expected[s]) / abs(expected[s]) for s in steps)
    print(f"steps {steps.start}..{steps.stop - 1}: max relative difference from the uninterrupted run {worst:.1e}")
    assert worst <= 1e-6


def warn_of_the_time_limit(cluster: SlurmCluster, job: Job) -> None:
    """What slurmctld does `time` seconds before the time limit for the script's `#SBATCH --signal=B:SIG@time`: SIG
    to the batch shell alone, as `scancel --batch` sends it (sbatch(1), scancel(1)); now, rather than at a moment
    that depends on slurmctld's 30-second checks and on how fast this machine trains."""
    batch_shell_only, name = re.search(r"^#SBATCH --signal=(B:)?(\w+)@\d+$", SCRIPT.read_text(), re.M).groups()
    assert batch_shell_only, "the script's warning must go to the batch shell, which requeues the job"
    cluster.command("scancel", "--batch", f"--signal={name}", str(job.id))


def requeue_as_preemption_does(cluster: SlurmCluster, job: Job) -> None:
    """What slurmctld does to a job preempted on a partition with PreemptMode=REQUEUE and no GraceTime (or whose
    node failed): requeue it, ending the running one as scancel does (see the scancel test)."""
    cluster.command("scontrol", "requeue", str(job.id))


@pytest.mark.parametrize("interrupt", [warn_of_the_time_limit, requeue_as_preemption_does],
                         ids=["time_limit", "preemption"])
def test_an_interrupted_job_snapshots_is_requeued_and_resumes_exactly(interrupt, cluster, data, uninterrupted,
                                                                      tmp_path):
    job = submit(cluster, data, tmp_path / "logs", STOP_SNAPSHOT_ONLY)
    wait_for_training(cluster, job, lambda: max(losses(records_so_far(job.log_dir)), default=-1) >= 3, "step 3")
    interrupt(cluster, job)

    assert ended(cluster, job, "COMPLETED")["Restarts"] == "1"
    warned = "the time limit is near: snapshot, then requeue" in job.text()
    assert warned == (interrupt is warn_of_the_time_limit)  # the script requeues it, or SLURM does
    stopped = stopped_after(job)
    assert 3 <= stopped < LAST_STEP
    assert list_snapshots(job.log_dir) == [snapshot_path(job.log_dir, s) for s in (LAST_STEP, stopped)]
    records = read_metrics(job.log_dir)
    [resume] = resumes(records)
    assert resume == {"event": "resume", "step": stopped + 1, "snapshot": str(snapshot_path(job.log_dir, stopped))}
    assert max(losses(records[:records.index(resume)])) == stopped  # the first run trained no step after its snapshot
    assert [r["step"] for r in records if "loss" in r] == list(range(LAST_STEP + 1))  # each step once, to the end
    assert_same_losses(records, uninterrupted, range(LAST_STEP + 1))


def test_scancel_stops_the_job_with_a_snapshot_and_submitting_it_again_resumes_exactly(cluster, data, uninterrupted,
                                                                                       tmp_path):
    """scancel sends SIGTERM to every process of the job, srun included, and SIGKILL KillWait seconds later (30 s):
    the workers finish their step and snapshot within it. It is not requeued."""
    job = submit(cluster, data, tmp_path / "logs", STOP_SNAPSHOT_ONLY)
    wait_for_training(cluster, job, lambda: max(losses(records_so_far(job.log_dir)), default=-1) >= 3, "step 3")
    cluster.command("scancel", str(job.id))

    assert ended(cluster, job, "CANCELLED")["Restarts"] == "0"
    stopped = stopped_after(job)
    assert 3 <= stopped < LAST_STEP
    assert list_snapshots(job.log_dir) == [snapshot_path(job.log_dir, stopped)]
    assert max(losses(read_metrics(job.log_dir))) == stopped

    again = submit(cluster, data, job.log_dir, STOP_SNAPSHOT_ONLY)
    ended(cluster, again, "COMPLETED")
    records = read_metrics(job.log_dir)
    [resume] = resumes(records)
    assert resume == {"event": "resume", "step": stopped + 1, "snapshot": str(snapshot_path(job.log_dir, stopped))}
    assert_same_losses(records, uninterrupted, range(LAST_STEP + 1))


def test_a_crashed_branch_requeued_by_slurm_continues_the_branch_exactly(cluster, data, uninterrupted,
                                                                         uninterrupted_dir, tmp_path):
    """Issue 55, case 2: a branch (--resume PARENT, LOG_DIR of its own) SIGKILLed after a few snapshots; SLURM's
    requeue runs the identical command again, which must continue the branch from its newest snapshot. The branch
    trains the parent's flags from the parent's step 7, so its losses are the uninterrupted run's."""
    parent = snapshot_path(uninterrupted_dir, 7)
    parents_snapshots = {p: p.stat().st_mtime_ns for p in list_snapshots(uninterrupted_dir)}
    job = submit(cluster, data, tmp_path / "branch", ["--resume", str(parent)])
    wait_for_training(cluster, job, lambda: len(list_snapshots(job.log_dir)) >= 2, "two snapshots of the branch")
    cluster.command("scancel", "--signal=KILL", f"{job.id}.0")  # torchrun and both workers, at once: a crash
    ended(cluster, job, "FAILED")
    newest = list_snapshots(job.log_dir)[0]
    crashed_after = int(SNAPSHOT_NAME.fullmatch(newest.name).group(1))

    cluster.command("scontrol", "requeue", str(job.id))  # as SLURM requeues a job whose node failed
    assert ended(cluster, job, "COMPLETED")["Restarts"] == "1"
    records = read_metrics(job.log_dir)
    assert resumes(records) == [{"event": "resume", "step": 8, "snapshot": str(parent)},  # the branch's start
                                {"event": "resume", "step": crashed_after + 1, "snapshot": str(newest)}]
    assert_same_losses(records, uninterrupted, range(8, LAST_STEP + 1))
    assert {p: p.stat().st_mtime_ns for p in list_snapshots(uninterrupted_dir)} == parents_snapshots  # untouched

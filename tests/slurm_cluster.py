"""A real one-node SLURM cluster for tests: munged, slurmctld and slurmd (Debian's munge and slurm-wlm packages,
which .ci/run installs where they are missing), each with its files in one temporary directory and on ports of
its own, so that it touches nothing of the machine's own SLURM or munge.

    with one_node_cluster(tmp_path) as cluster:          # raises SlurmUnavailable(why) if it cannot come up
        job = cluster.submit(["slurm/train_gpt2.sbatch"], env={...}, cwd=ROOT)
        assert cluster.wait_until_ended(job, timeout=120) == "COMPLETED"

The node is this machine, named localhost, with 2 CPUs and no GPUs; processes are tracked by their parent
(proctrack/linuxproc) and not confined (task/none), so it needs root but no cgroups or systemd. On exit every job
is cancelled, the daemons are stopped and the directory is removed; the daemons also stop if the test process dies.
"""

import ctypes
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from conftest import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = "munge slurmctld slurmd slurm-client"  # slurm-wlm's parts a one-node cluster needs
UNFINISHED = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SIGNALING",
              "STAGE_OUT", "SUSPENDED", "STOPPED"}
PR_SET_PDEATHSIG = 1  # linux/prctl.h
START_TIMEOUT = 60  # seconds for the node to show idle; it takes 2-3 s

SLURM_CONF = """\
ClusterName=tests
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
# cred_expire: a requeued job waits this long before it may start again (120 s by default)
AuthInfo=socket={dir}/munge.socket,cred_expire=5
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# the node as configured, whatever the hardware (a CI machine with more cores or less memory is not drained)
SlurmdParameters=config_overrides
ReturnToService=2
# the main scheduling loop every second, so a requeued job starts as soon as it may (60 s by default)
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
# a finished job stays in `scontrol show job` this long (the tests read its Restarts and state after its end)
MinJobAge=300
# the workers' time to snapshot between a job's SIGTERM and SIGKILL, as SLURM's default: more than they need on a
# loaded machine, and nothing waits for it where they exit in time
KillWait=30
JobRequeue=1
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=tests Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class SlurmUnavailable(Exception):
    """Why no cluster could be started here (the tests skip with this message)."""


@dataclass
class SlurmCluster:
    directory: Path
    env: dict[str, str]  # SLURM_CONF: the environment every SLURM command of this cluster needs

    def command(self, *args: str, timeout: float = 30) -> str:
        """A SLURM command's output (sbatch, scontrol, scancel, sinfo, ...); fails on a non-zero exit."""
        result = subprocess.run(args, env=os.environ | self.env, capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, f"{' '.join(args)} exited with {result.returncode}: {result.stderr}"
        return result.stdout

    def submit(self, flags: Sequence[str], env: dict[str, str], cwd: Path) -> int:
        """sbatch flags (the script last) from cwd with env (as sbatch's default --export=ALL passes it on)."""
        result = subprocess.run(["sbatch", "--parsable", *flags], env=env | self.env, cwd=cwd,
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"sbatch {' '.join(flags)}: {result.stderr}"
        return int(result.stdout.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
        fields = self.command("scontrol", "show", "job", "--oneliner", str(job_id)).split()
        return dict(field.split("=", 1) for field in fields if "=" in field)

    def state(self, job_id: int) -> str:
        """squeue's state of the job: PENDING, RUNNING, COMPLETING (its processes not all gone yet), COMPLETED, ..."""
        return self.command("squeue", "--noheader", "--states=all", f"--jobs={job_id}", "--format=%T").strip()

    def wait_until_ended(self, job_id: int, timeout: float) -> str:
        """Poll the job until it has ended, its processes gone, and return its final state (COMPLETED, FAILED,
        CANCELLED, ...); a requeued job goes on through PENDING and RUNNING. Fails after timeout."""
        deadline = time.monotonic() + timeout
        while (state := self.state(job_id)) in UNFINISHED:
            assert time.monotonic() < deadline, f"job {job_id} is still {state} after {timeout} s"
            time.sleep(0.2)
        return state

    def cancel_every_job(self, timeout: float = 30) -> None:
        """scancel every job and wait until none is left pending, running or completing (each job's slurmstepd
        ends with it)."""
        subprocess.run(["scancel", "--user=root"], env=os.environ | self.env, capture_output=True, timeout=30)
        deadline = time.monotonic() + timeout
        while self.command("squeue", "--noheader").strip() and time.monotonic() < deadline:
            time.sleep(0.2)


@contextmanager
def one_node_cluster(directory: Path) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd with their files under directory; yield once the node is idle; stop them.
    Raises SlurmUnavailable, saying why, where that cannot be done here."""
    missing = [name for name in (*DAEMONS, "sbatch") if shutil.which(name, path=os.environ["PATH"] + ":/usr/sbin")
               is None]
    if missing:
        raise SlurmUnavailable(f"{', '.join(missing)} not installed: `apt-get install {PACKAGES}` (.ci/run does)")
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmd runs jobs as their user and must be started as root")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "state").mkdir()
    (directory / "spool").mkdir()
    key = directory / "munge.key"
    key.write_bytes(os.urandom(128))  # a key of its own: no other munged can vouch for this cluster's users
    key.chmod(0o400)
    conf = directory / "slurm.conf"
    conf.write_text(SLURM_CONF.format(dir=directory, ctld_port=free_port(), slurmd_port=free_port()))
    cluster = SlurmCluster(directory, {"SLURM_CONF": str(conf)})
    munged = ["munged", "--foreground", "--force", f"--socket={directory}/munge.socket", f"--key-file={key}",
              f"--log-file={directory}/munged.log", f"--pid-file={directory}/munged.pid",
              f"--seed-file={directory}/munged.seed"]
    slurm_daemons = [["slurmctld", "-D", "-f", str(conf)], ["slurmd", "-D", "-f", str(conf), "-N", "localhost"]]
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, directory, ignore_errors=True)  # last: once the daemons are gone
        daemons = [stack.enter_context(_daemon(munged, directory))]
        _wait_for(lambda: (directory / "munge.socket").exists(), 10, "munged's socket", daemons, directory)
        daemons += [stack.enter_context(_daemon(command, directory)) for command in slurm_daemons]
        _wait_for(lambda: _node_state(cluster) == "idle", START_TIMEOUT, "idle node in sinfo", daemons, directory)
        stack.callback(cluster.cancel_every_job)
        yield cluster


@contextmanager
def _daemon(command: list[str], directory: Path) -> Iterator[subprocess.Popen]:
    """Run command in the foreground of a session of its own, output to directory/<name>.out; stop it at exit."""
    with open(directory / f"{Path(command[0]).name}.out", "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=os.environ | {"PATH": os.environ["PATH"] + ":/usr/sbin"},
                                   preexec_fn=_terminated_with_this_process)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _terminated_with_this_process() -> None:
    """SIGTERM when the test process dies, even by SIGKILL, where no teardown runs (Linux's PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _node_state(cluster: SlurmCluster) -> str:
    result = subprocess.run(["sinfo", "--noheader", "--nodes=localhost", "--format=%T"],
                            env=os.environ | cluster.env, capture_output=True, text=True, timeout=10)
    return result.stdout.strip()


def _wait_for(condition: Callable[[], bool], timeout: float, what: str, daemons: list[subprocess.Popen],
              directory: Path) -> None:
    """Poll condition until it holds; raise SlurmUnavailable with the daemons' logs after timeout, or at once if
    one of them has exited."""
    deadline = time.monotonic() + timeout
    while not condition():
        exited = [f"{process.args[0]} exited with {process.returncode}" for process in daemons
                  if process.poll() is not None]
        if exited or time.monotonic() > deadline:
            logs = "\n".join(f"--- {path.name}\n{path.read_text()[-1500:]}"
                             for path in sorted(directory.glob("*.log")) + sorted(directory.glob("*.out")))
            why = "; ".join(exited) or f"none within {timeout} s"
            raise SlurmUnavailable(f"no {what}: {why}. The daemons' logs:\n{logs}")
        time.sleep(0.2)

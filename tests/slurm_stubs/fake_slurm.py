"""What the Slurm stubs beside this file (srun, scancel, scontrol) share; tests/test_slurm.py uses it too.

Slurm tracks each job step's processes in a container (a cgroup) and signals a step by signalling every process in
it (slurmstepd: _handle_signal_container -> proctrack_g_signal). Here, where srun starts every "node's" task on this
machine, a step is srun's descendants: the tasks and all their children, but not srun itself, which runs in the
batch step beside the batch shell. Each srun writes its pid into <FAKE_SLURM_DIR>/steps; the stubs log the calls
that change the job into <FAKE_SLURM_DIR>/calls.
"""

import os
import signal
from contextlib import suppress
from pathlib import Path


def slurm_dir() -> Path:
    return Path(os.environ["FAKE_SLURM_DIR"])


def log_call(argv: list[str]) -> None:
    with open(slurm_dir() / "calls", "a") as f:
        f.write(" ".join(argv) + "\n")


def register_step(srun_pid: int) -> None:
    with open(slurm_dir() / "steps", "a") as f:
        f.write(f"{srun_pid}\n")


def descendants(pid: int) -> list[int]:
    """Every process below pid in the process tree, read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, ValueError, IndexError):  # a process that ended while we looked
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, unvisited = [], [pid]
    while unvisited:
        below = children.get(unvisited.pop(), [])
        found += below
        unvisited += below
    return found


def signal_step(srun_pid: int, sig: signal.Signals) -> None:
    """Send sig to every process of the step that srun_pid started."""
    for pid in descendants(srun_pid):
        with suppress(ProcessLookupError):
            os.kill(pid, sig)


def signal_steps(directory: Path, sig: signal.Signals) -> None:
    """Send sig to every process of every step of the job, none of the batch step: what `scancel --signal=SIG` and
    `#SBATCH --signal=SIG` (without B:) do."""
    steps = directory / "steps"
    for srun_pid in steps.read_text().split() if steps.exists() else []:
        signal_step(int(srun_pid), sig)

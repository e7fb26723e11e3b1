"""The report of a tools/gpu_check.py run (not a command): the machine, then a row per check with its figure, its
bound and its verdict, in OUT/report.md and OUT/report.json, rewritten after every check; and the logged subprocess a
stage runs its command in."""

import json
import os
import platform
import signal
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tools.gpu_check.scale import Scale
from training.memory import GiB

ROOT = Path(__file__).resolve().parents[2]  # the repository root: tests/gpu, train_gpt2.py

# A check's result: (figure, bound, passed); passed None is a SKIP, and the figure then says why.
Result = tuple[str, str, bool | None]


@dataclass
class Row:
    stage: str
    name: str
    figure: str
    bound: str
    verdict: str  # PASS, FAIL or SKIP


class Report:
    def __init__(self, out: Path, machine: dict, scale: Scale):
        self.out, self.machine, self.scale = out, machine, scale
        self.rows: list[Row] = []
        self.details: dict = {}  # the stages' raw numbers, for report.json

    def check(self, stage: str, name: str, check: Callable[..., Result], *args) -> Row:
        """Run one check and record its row; an exception in it is that check's FAIL, not the end of the run."""
        try:
            figure, bound, passed = check(*args)
        except Exception as e:  # any error is this check's verdict
            figure, bound, passed = f"{type(e).__name__}: {first_line(str(e))}", "no error", False
        row = Row(stage, name, figure, bound, "SKIP" if passed is None else "PASS" if passed else "FAIL")
        self.rows.append(row)
        print(f"{row.verdict:4s} | {stage}: {name} | {figure} | {bound}", flush=True)
        self.write()
        return row

    @property
    def failed(self) -> bool:
        return any(row.verdict == "FAIL" for row in self.rows)

    def write(self) -> None:
        (self.out / "report.json").write_text(json.dumps(
            {"machine": self.machine, "scale": asdict(self.scale), "rows": [asdict(r) for r in self.rows],
             "details": self.details}, indent=1) + "\n")
        counts = {v: sum(r.verdict == v for r in self.rows) for v in ("PASS", "FAIL", "SKIP")}
        lines = ["# GPU acceptance report", "", "| machine | |", "|---|---|"]
        lines += [f"| {key} | {value} |" for key, value in self.machine.items()]
        lines += ["", f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped", "",
                  "| stage | check | figure | bound | verdict |", "|---|---|---|---|---|"]
        lines += [f"| {r.stage} | {r.name} | {md(r.figure)} | {md(r.bound)} | **{r.verdict}** |" for r in self.rows]
        (self.out / "report.md").write_text("\n".join(lines) + "\n")


def md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def machine_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "CUDA (torch build)": torch.version.cuda, "python": platform.python_version()}
    if device.type != "cuda":
        return {"device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"} | info
    properties = torch.cuda.get_device_properties(device)
    try:
        nccl = torch.cuda.nccl.version()  # (2, 21, 5) in current torch
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception as e:  # a build without NCCL
        nccl = f"unknown ({type(e).__name__})"
    return {"device": properties.name, "GPUs": torch.cuda.device_count(),
            "compute capability": f"{properties.major}.{properties.minor}",
            "memory": f"{properties.total_memory / GiB:.1f} GiB", "driver": nvidia_driver()} | info | {
            "cuDNN": torch.backends.cudnn.version(), "NCCL": nccl}


def nvidia_driver() -> str:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        return first_line(proc.stdout) or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"


def run_logged(command: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int, str]:
    """Run command in the repository, its output (stdout, then stderr) also written to log; returns (exit status,
    output). Past timeout its whole process group is killed (pytest's and torchrun's children too): status -9."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\nstopped after {timeout:.0f} s"
    log.write_text(stdout + stderr)
    return proc.returncode, stdout + stderr


def within_budget(seconds: float, budget: int | None) -> Result:
    """A stage's wall time against its lease's budget (None: not judged, as on a CPU, whose speed says nothing of a
    GPU lease's)."""
    if budget is None:
        return f"{seconds:,.0f} s", "not judged on a CPU", True
    return f"{seconds:,.0f} s", f"< {budget} s", seconds < budget

"""gpu_check.py's tests stage (not a command): `pytest -m gpu tests/gpu`, a row per test, its figure the last line the
test printed."""

import argparse
import importlib.util
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tools.gpu_check.report import Report, Result, first_line, run_logged
from tools.gpu_check.scale import Scale


def tests_stage(report: Report, scale: Scale, args: argparse.Namespace) -> None:
    if importlib.util.find_spec("pytest") is None:
        report.check("tests", "pytest -m gpu tests/gpu", lambda: (
            "pytest is not installed", "installed", False))
        return
    junit = report.out / "tests_junit.xml"
    junit.unlink(missing_ok=True)
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    if scale.device == "cpu":
        env["GPU_TESTS_DEVICE"] = "cpu"  # tests/conftest.py: the GPU tests' bodies on the CPU, at a tiny size
    if args.eval_dir:
        env["GPU_TESTS_HELLASWAG"] = str((Path(args.eval_dir) / "hellaswag.jsonl").resolve())
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "-o", "junit_logging=system-out"]
    _, output = run_logged(command, env, 2 * scale.stage_seconds, report.out / "tests_output.txt")
    if not junit.exists():
        report.check("tests", "pytest -m gpu tests/gpu", lambda: (
            first_line(output.strip().splitlines()[-1] if output.strip() else "no output"), "runs", False))
        return
    cases = ET.parse(junit).getroot().iter("testcase")
    for case in cases:
        report.check("tests", case.get("name"), junit_row, case)


def junit_row(case: ET.Element) -> Result:
    """A test's verdict, and as its figure the last line it printed (tests/gpu print what they measured)."""
    seconds = float(case.get("time", 0))
    for tag in ("failure", "error"):
        problem = case.find(tag)
        if problem is not None:
            return f"{tag}: {first_line(problem.get('message') or problem.text or '')}", "passes", False
    skipped = case.find("skipped")
    if skipped is not None:
        return f"skipped: {first_line(skipped.get('message') or '')}", "passes", None
    printed = [line for line in (case.findtext("system-out") or "").splitlines() if line.strip()
               and not line.startswith(("-----", "USDT"))]
    return (f"{first_line(printed[-1], 200)}; " if printed else "") + f"{seconds:.1f} s", "passes", True

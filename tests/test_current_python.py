"""Running on a PyTorch that is installed already (a cluster module, a container image, no network):
`USE_CURRENT_PYTHON=1 bash quickstart.sh` (and run_tests.sh) use the python on PATH as it is, without a venv or pip,
and say what it lacks; every entry point refuses a torch older than the one this code needs, naming it."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from training import errors
from training.errors import UserError, check_torch_version, run_entry_point


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1+cu128", "2.11.0a0+gitabc1234", "2.13.0+cpu", "3.0.0"])
def test_torch_2_11_and_newer_are_accepted(version):
    check_torch_version(version)


@pytest.mark.parametrize("version", ["2.10.0+cu126", "2.4.1", "1.13.1"])
def test_an_older_torch_is_one_clear_error_naming_the_version_needed(version):
    with pytest.raises(UserError, match=re.escape(f"PyTorch {version} is too old: this code needs torch >= 2.11")):
        check_torch_version(version)


def test_an_entry_point_checks_the_torch_version_before_it_runs(monkeypatch, capsys):
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    with pytest.raises(SystemExit) as exit_info:
        run_entry_point(lambda: pytest.fail("main ran on torch 2.10"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: PyTorch 2.10.0 is too old: this code needs torch >= 2.11") and "Traceback" not in err
    assert errors.MIN_TORCH == (2, 11)


def copy_of_the_project(directory: Path) -> Path:
    """The scripts, modules and recipes, without .venv, data or logs: a fresh checkout."""
    for pattern in ("*.py", "*.sh", "requirements*.txt", "pyproject.toml", "recipes/*.toml", "data/*.py",
                    "training/*.py", "rundir/*.py", "evaluation/*.py", "tools/*.py", "tools/*/*.py"):
        for path in ROOT.glob(pattern):
            (directory / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, directory / path.relative_to(ROOT))
    return directory


def current_python_env() -> dict[str, str]:
    """The test's interpreter first on PATH as python3, as a cluster module puts its own, and no venv active."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    return env | {"USE_CURRENT_PYTHON": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
                  "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow  # a fresh Python preparing Tiny Shakespeare, then another training 2 steps: about 15 s
def test_quickstart_with_the_current_python_trains_without_a_venv_or_pip(tmp_path, shared_data):
    project = copy_of_the_project(tmp_path / "project")
    proc = subprocess.run(["bash", "quickstart.sh", "--model", "tiny", "--micro_batch_size", "2", "--seq_len", "32",
                           "--total_batch_size", "128", "--max_steps", "2", "--val_every", "0", "--sample_every", "0",
                           "--device", "cpu", "--dtype", "fp32"], cwd=project, capture_output=True, text=True,
                          timeout=300, env=current_python_env() | {"OFFLINE_DATA": str(shared_data)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"USE_CURRENT_PYTHON=1: {Path(sys.executable).parent}/python3 (torch {torch.__version__}), no venv" \
        in proc.stdout
    assert "step     1 | loss" in proc.stdout
    assert not (project / ".venv").exists() and "pip" not in proc.stdout + proc.stderr


def test_the_current_python_missing_a_module_is_named_and_nothing_runs(tmp_path):
    project = copy_of_the_project(tmp_path / "project")
    proc = subprocess.run(["bash", "-c", ". ./python_env.sh; use_python requirements.txt numpy no_such_module tqdm "
                           "also_missing; echo ran on"], cwd=project, capture_output=True, text=True, timeout=60,
                          env=current_python_env())
    assert proc.returncode == 2 and "ran on" not in proc.stdout
    assert proc.stderr.startswith(f"error: USE_CURRENT_PYTHON=1: {Path(sys.executable).parent}/python3 cannot import "
                                  "no_such_module, also_missing. Install them into it (the versions tested are in "
                                  "requirements.txt), or leave USE_CURRENT_PYTHON out")
    assert not (project / ".venv").exists()


@pytest.mark.slow  # ruff, then pytest on this file alone (the suite's other files left out of the copy): 10 s
def test_run_tests_with_the_current_python_lints_and_tests_without_a_venv(tmp_path):
    project = copy_of_the_project(tmp_path / "project")
    (project / "tests").mkdir()
    for name in ("conftest.py", Path(__file__).name):
        shutil.copy2(ROOT / "tests" / name, project / "tests" / name)
    proc = subprocess.run(["bash", "run_tests.sh", "-k", "torch_2_11_and_newer_are_accepted"], cwd=project,
                          capture_output=True, text=True, timeout=300, env=current_python_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "All checks passed!" in proc.stdout and "5 passed" in proc.stdout
    assert not (project / ".venv").exists()

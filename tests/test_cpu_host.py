"""tests/cpu_host: the CPU the suite runs as. precision.cpu_has_bf16_arithmetic answers what a test forces
(conftest.py's cpu_bf16), in the processes the test starts too, and fails the test that asks without forcing;
TESTS_CPU=avx2 makes every process of the suite run as on an AVX2-only CPU."""

import subprocess
import sys

import pytest

from conftest import ROOT
from helpers_train import train_env
from training import precision

ASK = "from training import precision; print(precision.cpu_has_bf16_arithmetic())"


def python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A fresh Python started as the tests start theirs (torchrun, the tools), running code."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=train_env(env), capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow  # a fresh Python importing torch, twice
def test_the_forced_answer_holds_here_and_in_the_processes_a_test_starts(cpu_bf16):
    assert precision.cpu_has_bf16_arithmetic() == cpu_bf16
    proc = python(ASK)
    assert (proc.returncode, proc.stdout.strip()) == (0, str(cpu_bf16)), proc.stderr[-3000:]


@pytest.mark.slow  # a fresh Python importing torch
def test_asking_without_forcing_fails_here_and_in_a_process_the_test_starts_naming_the_fixture():
    with pytest.raises(AssertionError, match="did not force the answer: give it tests/conftest.py's cpu_bf16 fixture"):
        precision.cpu_has_bf16_arithmetic()
    proc = python(ASK)
    assert proc.returncode == 1 and "give it tests/conftest.py's cpu_bf16 fixture" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow  # a fresh Python importing torch
def test_tests_cpu_avx2_runs_a_process_as_on_a_cpu_with_avx2_and_no_avx512_or_amx():
    proc = python("import os, torch, cpu_host\n"
                  "print(torch.backends.cpu.get_cpu_capability(), os.environ['ONEDNN_MAX_CPU_ISA'],\n"
                  "      os.environ['MKL_ENABLE_INSTRUCTIONS'],\n"
                  "      torch.cpu._is_avx512_supported(), torch.cpu._is_amx_tile_supported(),\n"
                  "      cpu_host.detected_bf16_arithmetic(), os.environ['TORCHINDUCTOR_CACHE_DIR'])",
                  {"TESTS_CPU": "avx2"})
    assert (proc.returncode, proc.stdout.split()[:6]) == (0, ["AVX2", "AVX2", "AVX2", "False", "False", "False"]), \
        proc.stderr
    assert proc.stdout.split()[6].endswith("_tests_cpu_avx2")  # torch.compile's cache apart from this CPU's

#!/usr/bin/env bash
# Install the pinned dependencies into .venv (created if missing), lint with ruff, and run the test suite on the CPU.
# Tests that need the offline data read it from ../shared/data (or $SHARED_DATA) and skip, saying so, without it.
#   bash run_tests.sh                  # everything: what CI runs
#   bash run_tests.sh -m "not slow"    # the inner loop: no torchrun, no torch.compile (about a minute)
#   TEST_WORKERS=4 bash run_tests.sh   # pytest-xdist's workers (default 2: the tests were sized for 2 cores); a whole
#                                      # test file stays in one worker, so each module fixture is built once
#   USE_CURRENT_PYTHON=1 bash run_tests.sh   # the python on PATH as it is: no venv, no pip (see python_env.sh)
#   TESTS_CPU=avx2 bash run_tests.sh   # as on an x86 CPU with AVX2 but no AVX-512 or AMX (tests/cpu_host/cpu_host.py)
set -euo pipefail
cd "$(dirname "$0")"
. ./python_env.sh
use_python requirements-dev.txt torch numpy tiktoken tqdm pytest xdist ruff transformers safetensors wandb pyarrow \
  matplotlib
"$PYTHON" -m ruff check .
"$PYTHON" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile tests "$@"

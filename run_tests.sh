#!/usr/bin/env bash
# Install the pinned dependencies into .venv (created if missing) and run the test suite on the CPU.
# Tests that need the offline data read it from ../shared/data (or $SHARED_DATA) and skip, saying so, without it.
set -euo pipefail
cd "$(dirname "$0")"
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q -r requirements-dev.txt
python -m pytest -q tests "$@"

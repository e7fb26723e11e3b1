# Sourced by quickstart.sh and run_tests.sh: `use_python REQUIREMENTS MODULE...` sets PYTHON, the interpreter to run.
#   default               .venv (created if missing), with REQUIREMENTS pip-installed into it
#   USE_CURRENT_PYTHON=1  the python3 (else python) on PATH as it is: no venv, no pip install, for a machine whose
#                         PyTorch is installed already (a cluster module, a container image, often offline). It must
#                         import every MODULE and have torch >= 2.11; what is missing is named, and nothing runs.
use_python() {
  local requirements=$1
  shift
  if [ -z "${USE_CURRENT_PYTHON:-}" ]; then
    [ -d .venv ] || python3 -m venv .venv
    . .venv/bin/activate
    python -m pip install -q -r "$requirements"
    PYTHON=python
    return
  fi
  PYTHON=$(command -v python3 || command -v python) || {
    echo "error: USE_CURRENT_PYTHON=1, but there is no python3 or python on PATH" >&2
    exit 2
  }
  "$PYTHON" - "$requirements" "$@" <<'PY' || exit 2
import importlib.util
import sys

requirements, modules = sys.argv[1], sys.argv[2:]
missing = [name for name in modules if importlib.util.find_spec(name) is None]
if missing:
    print(f"error: USE_CURRENT_PYTHON=1: {sys.executable} cannot import {', '.join(missing)}. Install them into it "
          f"(the versions tested are in {requirements}), or leave USE_CURRENT_PYTHON out to install everything into "
          ".venv.", file=sys.stderr)
    sys.exit(2)
import training.errors  # noqa: E402,F401  (on import: exits 2 naming the version needed if torch is older than 2.11)
PY
  echo "USE_CURRENT_PYTHON=1: $PYTHON (torch $("$PYTHON" -c 'import torch; print(torch.__version__)')), no venv"
}

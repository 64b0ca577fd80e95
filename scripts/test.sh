#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite on CPU; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 NANOINFER_DEBUG_CHECKS=1
python -m pytest -q -p no:cacheprovider "$@"

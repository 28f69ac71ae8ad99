#!/usr/bin/env bash
# Sets up (scripts/setup.sh, with the vLLM CPU engine), then lints, type-checks and runs every
# test, the vLLM end-to-end ones included. Exits non-zero when
# anything fails. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --with-vllm
source .venv/bin/activate
python proto/generate.py --check
ruff check .
ruff format --check .
mypy
pytest "$@"

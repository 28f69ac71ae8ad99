#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then lints, type-checks and runs every test. Exits non-zero when
# anything fails. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source .venv/bin/activate
python proto/generate.py --check
ruff check .
ruff format --check .
mypy
pytest "$@"

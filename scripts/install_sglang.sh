#!/usr/bin/env bash
# Installs SGLang for the tests of kvstore's HiCache backend (engine_plugin/sglang_backend.py)
# into .sglang/, a folder of its own beside .venv (tests put it on PYTHONPATH, in the processes
# that run SGLang only). Safe to run again: it does nothing when the pinned set is there.
#
# Why not `pip install sglang`: sglang 0.5.23 pins torch==2.14.1 and pulls ~40 CUDA packages.
# Without its dependencies (--no-deps) it imports on the CPU torch of .venv, given the few
# packages below that .venv lacks, triton among them (imported at module level; setup.sh keeps
# it out of .venv, where vLLM CPU runs without it). Nothing in .venv is added, upgraded or
# downgraded: vLLM pins its own versions there. Where sglang pins another version of something
# .venv holds (transformers, openai, numba, ...), .venv's stays; the paths the tests use work with it.
# SGLang's page hash is a C++ extension compiled at first use: g++ and OpenSSL's headers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TARGET=.sglang
PINS=(
    sglang==0.5.23
    triton==3.9.0
    orjson==3.13.0
    gguf==0.19.0
    ipython==9.18.1
    traitlets==5.16.1
    soundfile==0.13.1  # the HTTP server (launch_server) imports it; cffi is in .venv
)
installed() {
    PYTHONPATH=$TARGET "$PY" - "${PINS[@]}" <<'EOF'
import importlib.metadata as md, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    try:
        if md.version(name) != version:
            sys.exit(1)
    except md.PackageNotFoundError:
        sys.exit(1)
EOF
}
APT=()
command -v g++ >/dev/null || APT+=(g++)
[ -f /usr/include/openssl/sha.h ] || APT+=(libssl-dev)
if [ ${#APT[@]} -gt 0 ]; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT[@]}" >/dev/null
fi
# torch builds the extension with ninja; vLLM brings it into .venv, a plain dev setup may not
"$PY" -c 'import ninja' 2>/dev/null || "$PY" -m pip --disable-pip-version-check -q install ninja
if ! installed; then
    rm -rf "$TARGET"
    "$PY" -m pip --disable-pip-version-check -q install --no-deps --target "$TARGET" "${PINS[@]}"
fi
# Compile SGLang's page hash now (cached under ~/.cache/torch_extensions), so a missing compiler
# or header fails here, with the compiler's message, rather than inside a test.
PATH="$PWD/.venv/bin:$PATH" PYTHONPATH=$TARGET "$PY" -c \
    'from sglang.srt.mem_cache.utils import get_hash_str; get_hash_str([1, 2], None, 2)' >/dev/null

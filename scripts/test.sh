#!/usr/bin/env bash
# Sets up (scripts/setup.sh, with the vLLM CPU engine; scripts/install_sglang.sh), then lints, type-checks and runs every
# test, the vLLM end-to-end ones included. Exits non-zero when
# anything fails. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --with-vllm
# SGLang for the HiCache backend's tests, in .sglang/ beside .venv (see the script for why)
./scripts/install_sglang.sh
# The remote-tier tests start a real Redis Cluster on 127.0.0.1 (Debian's redis-server) and a
# real Mooncake Store in a network namespace of their own (the mooncake extra, which links
# libibverbs even over TCP, and iproute2 to bring the namespace's loopback up).
APT=()
{ command -v redis-server && command -v redis-cli; } >/dev/null || APT+=(redis-server)
ldconfig -p | grep -q 'libibverbs\.so\.1' || APT+=(libibverbs1)
command -v ip >/dev/null || APT+=(iproute2)
if [ ${#APT[@]} -gt 0 ]; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT[@]}" >/dev/null
fi
# promtool checks deploy/prometheus's alert rules (tests/test_metrics.py): Debian's prometheus
# package has it. Without its recommends (a node exporter); where systemd runs, the install also
# starts a Prometheus server, which nothing here wants: stopped and disabled again.
if ! command -v promtool >/dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    { [ -d /run/systemd/system ] && $SUDO systemctl disable --now prometheus; } >/dev/null 2>&1 || true
fi
.venv/bin/python -c 'import mooncake.store' 2>/dev/null ||
    .venv/bin/python -m pip --disable-pip-version-check -q install -e '.[mooncake]'
source .venv/bin/activate
python proto/generate.py --check
ruff check .
ruff format --check .
mypy
# a plain `pip install .` (no torch) and one beside torch, each in a clean venv (~2-3 min)
./scripts/check_installs.sh
# REQUIRE_TEST_TOOLS: a test whose tool this script installs fails, rather than skips, without it
# (not KVSTORE_*: the servers the tests start read those as settings and warn about this one)
REQUIRE_TEST_TOOLS=1 pytest "$@"

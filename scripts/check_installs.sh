#!/usr/bin/env bash
# kvstore installed as a user installs it, each into a clean venv (scripts/test.sh runs this):
#
#   plain    `pip install .`, no extras, no torch: `kvstore --version`; `kvstore serve` on a small
#            arena answering `kvstore stats`; a write and a read through the client; and each
#            optional feature configured without its library refused in one line naming the
#            extra (exit 2). Fails when a hard import of an optional library comes back.
#   engine   torch first (2.13.0 CPU, so nothing pulls a CUDA build), then `pip install .`:
#            every module of both engine plugins imports, up to the engine's own package —
#            vLLM and SGLang bring their own torch and are not installed here, so importing
#            engine_plugin.vllm_connector may stop only at `import vllm`, and
#            engine_plugin.sglang_backend only at `import sglang`; anything else missing fails.
#
# pip resolves the dependencies from its indexes as for a user (its cache is reused); nothing is
# installed with --no-deps. About a minute each here (the C extensions are compiled twice).
# Everything goes under one temporary folder, removed at exit with the server's /dev/shm files.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
WORK=$(mktemp -d /tmp/kvinst-XXXXXX) # short: the server's Unix socket lives under it
SERVER=
TORCH=
cleanup() {
    if [ -n "$TORCH" ] && kill -0 "$TORCH" 2>/dev/null; then
        kill "$TORCH" 2>/dev/null || true
        wait "$TORCH" 2>/dev/null || true
    fi
    if [ -n "$SERVER" ] && kill -0 "$SERVER" 2>/dev/null; then
        kill -KILL "$SERVER" 2>/dev/null || true
        wait "$SERVER" 2>/dev/null || true
    fi
    # a killed server's arena stays in /dev/shm; the data folder names it
    if [ -f "$WORK/data/arena-id" ]; then
        rm -f /dev/shm/"kvstore-$(cat "$WORK/data/arena-id")"-*
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
fail() {
    echo "check_installs: $*" >&2
    exit 1
}
PIP_FLAGS=(--disable-pip-version-check -q)

# The tree as a fresh clone has it: no venvs, build outputs or compiled extensions.
mkdir "$WORK/src"
tar -c --exclude=./.venv --exclude=./.sglang --exclude=./.git --exclude=./build --exclude=./bench-results \
    --exclude='*.egg-info' --exclude='__pycache__' --exclude='*.so' --exclude='./.*_cache' --exclude=./.hypothesis . |
    tar -x -C "$WORK/src"
cd "$WORK" # so that python imports kvstore from the venv, never from the checkout

# torch unpacks (disk-bound) while the plain venv compiles and serves (CPU-bound)
"$PYTHON" -m venv "$WORK/engine"
ENGINE=$WORK/engine/bin
"$ENGINE/python" -m pip "${PIP_FLAGS[@]}" install torch==2.13.0 >"$WORK/torch.log" 2>&1 &
TORCH=$!

echo "check_installs [${SECONDS}s]: plain venv, pip install . (no extras, no torch)"
"$PYTHON" -m venv "$WORK/plain"
PLAIN=$WORK/plain/bin
"$PLAIN/python" -m pip "${PIP_FLAGS[@]}" install "$WORK/src"
"$PLAIN/python" - <<'EOF'
import importlib.util, sys
optional = ("torch", "cryptography", "zstandard", "redis", "matplotlib", "aiohttp", "transformers")
present = [name for name in optional if importlib.util.find_spec(name) is not None]
sys.exit(f"pip install . pulled in optional libraries: {present}" if present else 0)
EOF
"$PLAIN/kvstore" --version | grep -q '^kvstore ' || fail "kvstore --version"

DATA=$WORK/data
SMALL=(--set dram.capacity_bytes=64MiB --set dram.page_bytes=1MiB --set dram.prefault=false
    --set nvme.capacity_bytes=64MiB --set server.metrics_address=)
"$PLAIN/kvstore" serve --data-dir "$DATA" "${SMALL[@]}" >"$WORK/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 120); do
    "$PLAIN/kvstore" stats --data-dir "$DATA" --json >"$WORK/stats.json" 2>/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || fail "kvstore serve exited: $(tail -5 "$WORK/serve.log")"
    sleep 0.5
done
grep -q '"tiers"' "$WORK/stats.json" || fail "kvstore stats did not answer: $(tail -5 "$WORK/serve.log")"
"$PLAIN/kvstore" stats --data-dir "$DATA" >/dev/null || fail "kvstore stats (tables)"
"$PLAIN/python" - "unix://$DATA/kvstore.sock" <<'EOF'
import sys
import kvstore

identity = kvstore.ModelIdentity("check/tiny", "ab" * 32, num_layers=2, num_kv_heads=2, head_dim=32, tokens_per_block=16)
with kvstore.connect(sys.argv[1]) as kv:
    fp = kv.register(identity)
    keys = kvstore.block_keys(fp, list(range(4 * identity.tokens_per_block)), identity.tokens_per_block)
    blocks = [bytes([i + 1]) * identity.block_bytes for i in range(len(keys))]
    kv.put(fp, keys, blocks)
    got = kv.get(fp, keys)
    assert [bytes(b) for b in got] == blocks, "blocks read back differ"
    assert kv.lookup(fp, keys) == len(keys)
loaded = [name for name in ("torch", "cryptography", "zstandard", "redis") if name in sys.modules]
assert not loaded, f"the client imported {loaded}"
EOF
kill -TERM "$SERVER"
wait "$SERVER" || fail "kvstore serve did not exit 0 on SIGTERM: $(tail -5 "$WORK/serve.log")"
SERVER=

# An optional feature configured without its library: one line naming the extra, exit 2.
refused() {
    local extra=$1
    shift
    local code=0
    "$PLAIN/kvstore" serve --data-dir "$WORK/refused" "${SMALL[@]}" "$@" </dev/null >/dev/null 2>"$WORK/err" || code=$?
    [ "$code" = 2 ] && [ "$(wc -l <"$WORK/err")" = 1 ] && grep -q "kvstore\[$extra\]" "$WORK/err" ||
        fail "serve $* without the $extra extra: exit $code, stderr: $(cat "$WORK/err")"
}
refused encryption --set nvme.encryption_keys_dir="$WORK/keys"
refused zstd --set nvme.codec=zstd
refused redis --set remote.backend=redis --set remote.nodes=127.0.0.1:7000
refused engine --set hbm.enabled=true
echo "check_installs [${SECONDS}s]: plain install serves, answers stats, stores and reads; extras refused in one line"

echo "check_installs [${SECONDS}s]: engine venv, torch==2.13.0 then pip install ."
wait "$TORCH" || fail "pip install torch==2.13.0: $(grep -v 'is ignored' "$WORK/torch.log" | tail -5)"
TORCH=
"$ENGINE/python" -m pip "${PIP_FLAGS[@]}" install "$WORK/src"
"$ENGINE/python" - <<'EOF'
import importlib, pkgutil, sys
import engine_plugin

engines = {"vllm", "sglang"}  # the engines' own packages: they bring them, not kvstore
stopped, failed = [], []
for module in sorted(m.name for m in pkgutil.iter_modules(engine_plugin.__path__, "engine_plugin.")):
    try:
        importlib.import_module(module)
    except ImportError as exc:  # a plugin may say what to install, raised from the missing module
        cause = exc if isinstance(exc, ModuleNotFoundError) else exc.__cause__
        missing = getattr(cause, "name", None) or ""
        (stopped if missing.split(".")[0] in engines else failed).append(f"{module}: {exc}")
for connector in ("engine_plugin.vllm_connector", "engine_plugin.sglang_backend"):
    if connector not in sys.modules and not any(s.startswith(connector + ":") for s in stopped):
        failed.append(f"{connector}: not imported")
print("\n".join(f"  stops at its engine: {s}" for s in stopped))
sys.exit("engine plugin modules that do not import:\n" + "\n".join(failed) if failed else 0)
EOF
echo "check_installs [${SECONDS}s]: ok"

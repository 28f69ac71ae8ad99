#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs the main job: the service with embedded defaults and a
# short end-to-end demonstration against it, a vLLM engine restored from it after a restart
# (where vLLM is installed: ./scripts/setup.sh --with-vllm), the store's own demonstration (restart included),
# and the tier benchmark in quick mode (results in bench-results/tiers-quick.json).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source .venv/bin/activate
DEMO_DIR=${KVSTORE_DEMO_DIR:-$PWD/.kvstore}
rm -rf "$DEMO_DIR/serve"
mkdir -p "$DEMO_DIR"
TOKEN=demo-token-$RANDOM
# The embedded default arena is 1 GiB of /dev/shm; a container's /dev/shm may be far smaller
# (Docker's default is 64 MiB). Then the demo's server takes a quarter of what is free.
SHM_FREE_KIB=$(df -Pk /dev/shm | awk 'NR==2 {print $4}')
ARENA=()
if [ "$SHM_FREE_KIB" -lt $((3 * 1024 * 1024)) ]; then
    ARENA=(--set "dram.capacity_bytes=$((SHM_FREE_KIB / 4))KiB" --set dram.page_bytes=1MiB)
    echo "note: /dev/shm has $((SHM_FREE_KIB / 1024)) MiB free; the demo's server uses a $((SHM_FREE_KIB / 4096)) MiB arena instead of 1 GiB"
fi
# The token goes in the environment, never on a command line (/proc/PID/cmdline is world-readable).
KVSTORE_SERVER_TOKENS="$TOKEN=demo" kvstore serve --data-dir "$DEMO_DIR/serve" --tcp 127.0.0.1:0 \
    --set server.metrics_address= "${ARENA[@]}" >"$DEMO_DIR/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 150); do
    grep -q "kvstore serving" "$DEMO_DIR/serve.log" 2>/dev/null && break
    if ! kill -0 $SERVER 2>/dev/null; then
        echo "kvstore serve did not start:" >&2
        tail -5 "$DEMO_DIR/serve.log" >&2
        exit 1
    fi
    sleep 0.2
done
TCP=$(sed -n 's/.* and \(127\.0\.0\.1:[0-9]*\).*/\1/p' "$DEMO_DIR/serve.log" | head -1)
echo "== kvstore serve (embedded defaults) on unix://$DEMO_DIR/serve/kvstore.sock and $TCP"
kvstore demo --service "unix://$DEMO_DIR/serve/kvstore.sock" --tcp "$TCP" --token "$TOKEN"
echo "== vLLM with the connector: one prompt, then an engine restart (tiny random model, vLLM CPU)"
python -m kvstore.cli.demo_engine "unix://$DEMO_DIR/serve/kvstore.sock"
kill -TERM $SERVER && wait $SERVER && echo "server drained and exited 0"
trap - EXIT
echo "== the store: prefix hits, stale-model and tenant isolation, restart"
kvstore demo --data-dir "$DEMO_DIR/demo" --set dram.capacity_bytes=64MiB --set nvme.capacity_bytes=2GiB
mkdir -p bench-results
if [ "$(df -Pk /dev/shm | awk 'NR==2 {print $4}')" -lt $((768 * 1024)) ]; then
    echo "skipping kvstore bench tiers --quick: it needs about 768 MiB free in /dev/shm"
else
    kvstore bench tiers --quick --data-dir "$DEMO_DIR/bench" --json bench-results/tiers-quick.json
fi

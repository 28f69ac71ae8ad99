#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs the main job: the service with embedded defaults and a
# short end-to-end demonstration against it, the store's own demonstration (restart included),
# and the tier benchmark in quick mode (results in bench-results/tiers-quick.json).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source .venv/bin/activate
DEMO_DIR=${KVSTORE_DEMO_DIR:-$PWD/.kvstore}
rm -rf "$DEMO_DIR/serve"
TOKEN=demo-token-$RANDOM
kvstore serve --data-dir "$DEMO_DIR/serve" --tcp 127.0.0.1:0 --set "server.tokens=$TOKEN=demo" \
    --set server.metrics_address= >"$DEMO_DIR/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 100); do
    grep -q "kvstore serving" "$DEMO_DIR/serve.log" 2>/dev/null && break
    sleep 0.2
done
TCP=$(sed -n 's/.* and \(127\.0\.0\.1:[0-9]*\).*/\1/p' "$DEMO_DIR/serve.log" | head -1)
echo "== kvstore serve (embedded defaults) on unix://$DEMO_DIR/serve/kvstore.sock and $TCP"
kvstore demo --service "unix://$DEMO_DIR/serve/kvstore.sock" --tcp "$TCP" --token "$TOKEN"
kill -TERM $SERVER && wait $SERVER && echo "server drained and exited 0"
trap - EXIT
echo "== the store: prefix hits, stale-model and tenant isolation, restart"
kvstore demo --data-dir "$DEMO_DIR/demo" --set dram.capacity_bytes=64MiB --set nvme.capacity_bytes=2GiB
mkdir -p bench-results
kvstore bench tiers --quick --data-dir "$DEMO_DIR/bench" --json bench-results/tiers-quick.json

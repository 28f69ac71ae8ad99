#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs the main job: the end-to-end demonstration of the
# store, and the tier benchmark in quick mode (results in bench-results/tiers-quick.json).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source .venv/bin/activate
DATA_DIR=${KVSTORE_DATA_DIR:-$PWD/.kvstore/demo}
kvstore demo --data-dir "$DATA_DIR" --set dram.capacity_bytes=64MiB --set nvme.capacity_bytes=2GiB
mkdir -p bench-results
kvstore bench tiers --quick --data-dir "$PWD/.kvstore/bench" --json bench-results/tiers-quick.json

#!/usr/bin/env bash
# The checks that need a GPU, as one short run on a lent CUDA machine that has torch but cannot
# reach a package registry: the packages torch's image lacks come as wheels in .whl/ (ignored by
# git; carried to the machine), the native copiers are built in place. Fetch the wheels here first:
#   echo /.whl/ >> .git/info/exclude
#   for p in lmdb==3.0.0 zstandard==0.25.0 grpcio==1.85.3 protobuf==7.36.2 redis==8.2.0 \
#            xxhash==4.1.0 cryptography==50.0.2 cffi pycparser; do
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$p"; done
#   python3 -m pip download --no-deps -d .whl grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
# (the versions .venv has: the generated stubs need that protobuf). ~20 MiB. Prints, in this order: the machine; the gpu-marked tests; `kvstore bench device`;
# the CPU suites that touch the arena and the copier, run with CUDA present (every dram arena is
# registered then); the service rows that a 2-core CI machine cannot settle (same-host store,
# lookup latency with 4 clients); with `quick`, the first two only. Each part has its own time limit; logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, torch.cuda.get_device_name(0))'
nproc; free -g | head -2; df -h /dev/shm | tail -1
# The arenas live in /dev/shm; a small one (a container's 64 MiB) cannot hold the bench's.
if [ "$(df --output=avail -B1G /dev/shm | tail -1)" -lt 8 ]; then
    mount -o remount,size=16G /dev/shm && df -h /dev/shm | tail -1
fi

if [ -d .whl ] && $PY -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
inc=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
gcc -O3 -shared -fPIC -I"$inc" tiers/native/gather.c -o "tiers/_gather$suffix" || echo "native gather: not built"
gcc -O3 -shared -fPIC -pthread -I"$inc" engine_plugin/native/blockcopy.c -o "engine_plugin/_blockcopy$suffix" ||
    echo "native blockcopy: not built"

GPU_FILES=(tests/test_kv_layout.py tests/test_memory_tiers.py tests/test_builder.py tests/test_tier_contract.py
    tests/test_bench_device.py tests/test_cache_layouts.py)
echo "== gpu-marked tests"
timeout 100 $PY -m pytest -q -p no:cacheprovider -m gpu "${GPU_FILES[@]}" 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
# the connector's worker on GPU caches (layer-wise loads on events) where vLLM is installed
if $PY -c 'import vllm' 2>/dev/null; then
    timeout 60 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_vllm_layerwise.py 2>&1 | tail -5
else echo "vllm not installed: tests/test_vllm_layerwise.py's gpu test not run"; fi

echo "== kvstore bench device (its layer-wise row: the A/B behind layerwise_load on GPU hosts)"
timeout 110 $PY -m kvstore bench device --json "$OUT/device.json" 2>&1 | tee "$OUT/device.txt"

# `gpu_checks.sh quick`: the two parts above only.
[ "${1:-}" = quick ] && exit 0

echo "== the arena and copier suites with CUDA present"
timeout 90 $PY -m pytest -q -p no:cacheprovider -x "${GPU_FILES[@]}" tests/test_inplace_copies.py \
    tests/test_store_arena.py 2>&1 | tee "$OUT/cuda-present.log" | tail -15

echo "== service rows on this machine's cores"
# A file, not stdin: the lookup clients are spawned processes that import it.
cat >/tmp/service_rows.py <<'EOF'
from benchmarks.common import print_results
from benchmarks.service_lookup import bench_lookup
from benchmarks.service_remote import bench_remote
from benchmarks.service_same_host import bench_same_host
from benchmarks.service_setup import BLOCK, bench_server

if __name__ == "__main__":
    count, rounds = 64, 5
    server = bench_server(arena_bytes=(3 * count + 64) * BLOCK)
    try:
        print_results("remote", bench_remote(server, count, rounds, "auto"))
        same_host = bench_server(arena_bytes=(3 * count + 64) * BLOCK)
        try:
            rows = bench_same_host(same_host, count, rounds) + bench_same_host(same_host, count, rounds, small=True)
            print_results("same host", rows)
        finally:
            same_host.stop()
        print_results("lookup", bench_lookup(server, calls=500))
    finally:
        server.stop()
EOF
timeout 120 $PY /tmp/service_rows.py 2>&1 | tee "$OUT/service.txt"
echo "== done"

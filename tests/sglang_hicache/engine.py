"""One SGLang engine process on CPU with kvstore as its HiCache storage tier, for the end-to-end
case of tests/sglang_backend_cases.py (run with tests/sglang_hicache/env.py's environment, so
the shims apply):

    python -m tests.sglang_hicache.engine MODEL ADDRESS PROMPT_FILE

It generates greedily for the prompt, waits until the sidecar holds the prompt's full pages
(SGLang's backup thread writes them after the request), and prints one line: ``RESULT {json}``
with the output ids and SGLang's cached-token counts (where the prompt's KV came from).

SGLang leaves its load-snapshot file (``/dev/shm/sglang_loads_<instance>_<digest>.shm``) behind
at shutdown: the engine removes it, and prints its path first (``LOADS <path>``) so that the
test removes it too should this process be killed before it could.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

PAGE = 16
MAX_NEW_TOKENS = 8


def main() -> None:
    import sglang
    from sglang.srt.managers.load_snapshot import shm_path_for

    from kvstore.client import connect

    model, address, prompt_file = sys.argv[1:4]
    extra = {
        "backend_name": "kvstore",
        "module_path": "engine_plugin.sglang_backend",
        "class_name": "KvstoreHiCacheStorage",
        "address": address,
        "interface_v1": 1,
    }
    engine = sglang.Engine(
        model_path=model,
        device="cpu",
        page_size=PAGE,
        attention_backend="torch_native",
        disable_cuda_graph=True,
        max_total_tokens=4096,
        enable_hierarchical_cache=True,
        hicache_io_backend="direct",  # the copy the shims give CPU torch
        hicache_mem_layout="layer_first",
        hicache_write_policy="write_through",
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra),
        enable_cache_report=True,
    )
    loads = Path(shm_path_for(engine.port_args.instance_id))
    print(f"LOADS {loads}", flush=True)
    try:
        out = engine.generate(
            Path(prompt_file).read_text(), {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}
        )
        pages = out["meta_info"]["prompt_tokens"] // PAGE
        deadline = time.monotonic() + 30
        with connect(address) as kv:
            while kv.stats()["blocks"] < pages and time.monotonic() < deadline:
                time.sleep(0.1)
            blocks = kv.stats()["blocks"]
        meta = out["meta_info"]
        result = {
            "output_ids": out["output_ids"],
            "prompt_tokens": meta["prompt_tokens"],
            "cached": meta.get("cached_tokens_details") or {},
            "blocks": blocks,
        }
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        engine.shutdown()
        loads.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

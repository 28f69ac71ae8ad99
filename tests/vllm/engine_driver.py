"""A vLLM CPU engine in its own process, driven over stdin/stdout by the end-to-end tests.

    python -m tests.vllm.engine_driver MODEL_DIR SIDECAR_ADDRESS [POLICY]
    stdin:  one JSON object per line: {"prompt": [token ids], "salt": str | null}
    stdout: one JSON object per line: {"tokens": [...], "logprobs": [...], "cached": int, "seconds": float}

The engine runs with vLLM's own prefix cache off, so every cached token it reports came from
kvstore through the connector.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model, address = sys.argv[1], sys.argv[2]
    policy = sys.argv[3] if len(sys.argv) > 3 else "auto"
    transfer = KVTransferConfig(
        kv_connector="KvstoreConnector",
        kv_connector_module_path="engine_plugin.vllm_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"address": address, "policy": policy},
    )
    llm = LLM(
        model=model,
        distributed_executor_backend="uni",
        dtype="bfloat16",
        max_model_len=4096,
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.08,  # on CPU: the share of host memory for KV; three engines run at once
        kv_transfer_config=transfer,
        seed=0,
    )
    params = SamplingParams(max_tokens=4, logprobs=3, temperature=0.0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        prompt = TokensPrompt(prompt_token_ids=request["prompt"])
        if request.get("salt"):
            prompt["cache_salt"] = request["salt"]
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        completion = out.outputs[0]
        logprobs = [{str(k): v.logprob for k, v in step.items()} for step in completion.logprobs or []]
        reply = {
            "tokens": list(completion.token_ids),
            "logprobs": logprobs,
            "cached": out.num_cached_tokens or 0,
        }
        reply["seconds"] = seconds
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()

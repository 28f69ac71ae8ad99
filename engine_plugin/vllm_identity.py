"""The model fingerprint of a vLLM engine, from its configuration and its files.

Everything that changes KV contents goes in (see ``kvstore.keys.ModelIdentity``): a digest of
the weight files and ``config.json`` (``engine_plugin.digests``: every byte, cached per file so
start-up stays fast), the tokenizer files (the chat template lives in
``tokenizer_config.json``), dtype and KV-cache dtype, the layout (layers, KV heads, head size,
block size, memory layout), RoPE settings and the tensor-parallel rank and size. Same
configuration with other weights: other keys.

What the engine was given is not in it: neither the model's path (replicas mount the same
weights at other paths, across pods and hosts) nor the served model name. The served name is
the identity's ``model_id``, a label for operators that the weights digest keeps out of the
fingerprint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine_plugin.digests import TOKENIZER_PATTERNS, DigestCache
from kvstore.keys import DTYPE_BYTES, ModelIdentity

_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


def _dtype_name(dtype: Any) -> str:
    name = _DTYPES.get(str(dtype), str(dtype).removeprefix("torch."))
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported KV dtype {dtype!r}")
    return name


def _memory_layout(vllm_config: Any) -> str:
    """The tag of how a block's bytes are ordered: the CPU layout, or the CUDA one with the
    token/head order its attention backend uses (NHD unless configured otherwise)."""
    if str(vllm_config.device_config.device) == "cpu":
        return "vllm-cpu"
    order = getattr(vllm_config.cache_config, "kv_cache_layout", None) or os.environ.get(
        "VLLM_KV_CACHE_LAYOUT"
    )
    return f"vllm-cuda-{order or 'NHD'}"


def identity_from_vllm(
    vllm_config: Any, tp_rank: int = 0, digests: DigestCache | None = None
) -> ModelIdentity:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    digests = digests or DigestCache()
    model_path = Path(model.model)
    tokenizer_path = Path(model.tokenizer or model.model)
    weights = digests.model_digest(model_path) if model_path.is_dir() else ""
    if not weights:
        raise ValueError(
            f"no weight files under {model_path}: kvstore needs local weights to fingerprint them"
        )
    tokenizer = digests.folder_digest(tokenizer_path, TOKENIZER_PATTERNS) if tokenizer_path.is_dir() else ""
    digests.save()
    hf = model.hf_config
    kv_dtype = _dtype_name(model.dtype) if cache.cache_dtype in ("auto", None) else str(cache.cache_dtype)
    rope_scaling = getattr(hf, "rope_scaling", None)
    return ModelIdentity(
        model_id=str(model.served_model_name or model.model),  # vLLM made it one name, the first
        weights_digest=weights,
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_dim=model.get_head_size(),
        tokens_per_block=cache.block_size,
        kv_dtype=kv_dtype if kv_dtype in DTYPE_BYTES else "fp8",
        kv_quantization="" if cache.cache_dtype in ("auto", None) else str(cache.cache_dtype),
        memory_layout=_memory_layout(vllm_config),
        tokenizer_digest=tokenizer,
        chat_template_version="",  # covered by the tokenizer files (tokenizer_config.json)
        rope_theta=float(getattr(hf, "rope_theta", 10000.0) or 10000.0),
        rope_scaling=json.dumps(rope_scaling, sort_keys=True) if rope_scaling else "",
        tp_rank=tp_rank,
        tp_world_size=parallel.tensor_parallel_size,
    )

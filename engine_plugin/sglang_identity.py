"""The model fingerprint of one SGLang HiCache rank, from what SGLang tells its storage backend.

SGLang's page keys are chained SHA-256 hashes of token ids, seeded only by the request's
``extra_key`` and cache salt: nothing of the model, its weights, the KV dtype, the page size or
the tensor-parallel rank is in them. So the backend builds kvstore's fingerprint
(``kvstore.keys.ModelIdentity``) from three sources and keys every page under it:

- ``HiCacheStorageConfig``: the model name, TP rank and size, pipeline and context-parallel
  ranks, the MLA flag (MLA KV is the same on every TP rank: keyed by its DCP shard instead);
- the host pool handed to ``register_mem_pool_host``: page size, KV dtype, layers, heads, head
  sizes, the pool's class and layout (which order a page's bytes are in) and its storage format
  tag;
- the model's local folder: a digest of its weight files and ``config.json``, one of its
  tokenizer files (``engine_plugin.digests``: every byte, cached per file) and its RoPE settings.

Same configuration with other weights, another dtype, page size or rank: other keys. The
folder's path and the model name SGLang was given are not in the fingerprint: the name is the
identity's ``model_id``, a label for operators, so replicas that mount the same weights at other
paths share pages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine_plugin.digests import TOKENIZER_PATTERNS, DigestCache
from kvstore.keys import DTYPE_BYTES, ModelIdentity

_DTYPES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.uint8: "int8",  # SGLang keeps fp8 KV as raw bytes on some paths
    torch.int8: "int8",
}


def model_folder(model_name: str | None, model_path: str = "") -> Path:
    """The local folder of the model's weights: ``model_path`` when given, else SGLang's model
    name when it is a folder, else its snapshot in the Hugging Face cache (SGLang has downloaded
    it before the cache starts). Raises ValueError when there is none: without the weights
    kvstore cannot tell two checkpoints of one name apart."""
    name = model_path or model_name or ""
    if name and Path(name).is_dir():
        return Path(name)
    if name and not model_path:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name, local_files_only=True))
        except (ImportError, ValueError, OSError):  # not a hub id, or not in the cache
            pass
    raise ValueError(
        f"kvstore needs the model's local weights to fingerprint them; {name or 'no model'} is no "
        "local folder: give its folder as 'model_path' in --hicache-storage-backend-extra-config"
    )


def identity_from_sglang(
    storage_config: Any,
    host_pool: Any,
    folder: Path,
    interface: str,
    digests: DigestCache | None = None,
) -> ModelIdentity:
    """The identity of the pages this rank stores. ``interface`` names how a page's bytes are
    ordered: ``"flat"`` (``get_data_page``, the copying calls) or ``"pieces"`` (the zero-copy
    calls: the pieces of ``get_page_buffer_meta`` one after another)."""
    if getattr(storage_config, "should_split_heads", False):
        raise ValueError("kvstore does not store split-head pages (heterogeneous TP) yet")
    digests = digests or DigestCache()
    weights = digests.model_digest(folder)
    if not weights:
        raise ValueError(f"no weight files under {folder}: kvstore needs local weights to fingerprint them")
    tokenizer = digests.folder_digest(folder, TOKENIZER_PATTERNS)
    digests.save()
    config = _hf_config(folder)
    rope_scaling = config.get("rope_scaling") or config.get("rope_parameters")  # transformers 5

    page_size = int(host_pool.page_size)
    layers = int(host_pool.layer_num)
    dtype = host_pool.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"kvstore does not know the KV dtype {dtype} of SGLang's host pool")
    kv_dtype = _DTYPES[dtype]
    page_bytes = page_bytes_of(host_pool)
    per_token_layer = page_bytes // (page_size * layers * 2 * DTYPE_BYTES[kv_dtype])
    if per_token_layer * page_size * layers * 2 * DTYPE_BYTES[kv_dtype] != page_bytes:
        raise ValueError(
            f"a page of {page_bytes} B is not K and V of {layers} layers and {page_size} tokens in {dtype}"
        )
    heads = int(getattr(host_pool, "head_num", 1) or 1)
    if per_token_layer % heads:
        heads = 1
    mla = bool(storage_config.is_mla_model)
    # MLA KV is replicated over TP (one writer): every rank reads the same pages, per DCP shard
    rank, world = (
        (storage_config.dcp_rank, storage_config.dcp_size)
        if mla
        else (storage_config.tp_rank, storage_config.tp_size)
    )
    return ModelIdentity(
        model_id=str(storage_config.model_name or folder),
        weights_digest=weights,
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=per_token_layer // heads,
        tokens_per_block=page_size,
        kv_dtype=kv_dtype,
        kv_quantization=str(getattr(host_pool, "storage_format_tag", None) or ""),
        memory_layout=_layout_tag(storage_config, host_pool, interface),
        tokenizer_digest=tokenizer,
        rope_theta=float(config.get("rope_theta") or 10000.0),
        rope_scaling=json.dumps(rope_scaling, sort_keys=True) if rope_scaling else "",
        tp_rank=int(rank),
        tp_world_size=int(world),
    )


def page_bytes_of(host_pool: Any) -> int:
    """Bytes of one page: the flat data page, which the zero-copy pieces must add up to."""
    flat = host_pool.get_dummy_flat_data_page()
    flat_bytes = int(flat.numel() * flat.element_size())
    _, sizes = host_pool.get_page_buffer_meta(torch.arange(host_pool.page_size, dtype=torch.int64))
    if sum(sizes) != flat_bytes:
        raise ValueError(
            f"{type(host_pool).__name__}: the zero-copy pieces of a page add up to {sum(sizes)} B, "
            f"its flat page is {flat_bytes} B"
        )
    return flat_bytes


def _layout_tag(storage_config: Any, host_pool: Any, interface: str) -> str:
    """Everything about a page's bytes that the identity's numbers do not already say."""
    geometry = ",".join(
        f"{name}={getattr(host_pool, name)}"
        for name in ("head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim")
        if getattr(host_pool, name, None) is not None
    )
    parts = [
        "sglang",
        type(host_pool).__name__,
        str(host_pool.layout),
        interface,
        geometry,
        f"layers={getattr(host_pool, 'start_layer', 0)}-{getattr(host_pool, 'end_layer', '')}",
        f"pp={storage_config.pp_rank}/{storage_config.pp_size}",
        f"cp={storage_config.attn_cp_rank}/{storage_config.attn_cp_size}",
    ]
    return "|".join(parts)


def _hf_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}

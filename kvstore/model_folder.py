"""What a local Hugging Face model folder says about its KV cache, for the router and the
benchmarks (the connector reads the same from vLLM's own config)."""

from __future__ import annotations

import json
from pathlib import Path


def block_bytes_of(model_dir: Path, block_size: int) -> int:
    """Bytes of one KV block of the model (16-bit KV, all layers, K and V) of ``block_size``
    tokens, from its ``config.json``."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return int(2 * config["num_hidden_layers"] * kv_heads * head_dim * 2 * block_size)

"""What the connector does with hybrid models: vLLM's ``SupportsHMA`` is not implemented.

vLLM 0.32 offers ``SupportsHMA`` (``request_finished_all_groups``: block ids per KV cache group)
for its hybrid KV cache manager, which keeps sliding-window layers' KV for the window only and
runs SSM (Mamba) layers. The connector moves one kvstore block per vLLM block with every
layer's K and V in it, addressed by one list of block ids, so it does not claim ``SupportsHMA``;
vLLM then turns its hybrid manager off at start (its warning says so):

- sliding-window (and chunked local) layers next to full-attention layers: vLLM allocates their
  KV for the whole sequence, as for full attention (more KV memory per request; attention
  compute unchanged). Blocks are whole and restores exact: tested on a tiny random Llama with a
  sliding-window layer (``tests/test_vllm_link.py``);
- every layer sliding-window: one group, vLLM's sliding-window manager; blocks outside the
  window are vLLM's null block and loads into them are discarded;
- SSM (Mamba) layers, or several KV cache groups however they came about: refused here, at
  start, naming what is unsupported (vLLM itself refuses hybrid SSM models without its hybrid
  manager before the connector is built).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(f"vllm.{__name__}")


def check_kv_cache_groups(kv_cache_config: Any, model: str) -> None:
    """Raise ``ValueError`` for what the connector cannot move; say once what sliding-window
    layers cost. ``kv_cache_config``: vLLM's ``KVCacheConfig`` (None where vLLM passes none)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) > 1:
        raise ValueError(
            f"the kvstore connector does not implement vLLM's SupportsHMA: {model} runs with "
            f"{len(groups)} KV cache groups (vLLM's hybrid KV cache manager is on), and the "
            "connector moves one; start vLLM with --disable-hybrid-kv-cache-manager"
        )
    specs = [_layer_specs(group.kv_cache_spec) for group in groups]
    flat = [spec for layer_specs in specs for spec in layer_specs]
    if any(isinstance(spec, MambaSpec) or not isinstance(spec, AttentionSpec) for spec in flat):
        raise ValueError(
            f"the kvstore connector does not support {model}: it has SSM (Mamba) or other "
            "non-attention layers, which need vLLM's hybrid KV cache manager (SupportsHMA), "
            "not implemented by the connector"
        )
    if any(
        getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None) for spec in flat
    ):
        log.info(
            "kvstore connector: %s has sliding-window layers; the connector does not implement "
            "SupportsHMA, so vLLM keeps their KV for the whole sequence (hybrid KV cache manager "
            "off: more KV memory per request). Restores are exact.",
            model,
        )


def _layer_specs(spec: Any) -> list[Any]:
    """A group's spec, or the per-layer specs of a group of one type with several shapes."""
    per_layer = getattr(spec, "kv_cache_specs", None)
    return list(per_layer.values()) if isinstance(per_layer, dict) else [spec]

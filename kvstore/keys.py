"""Identity of KV blocks: model fingerprints and chained block keys.

A ``Fingerprint`` is a 32-byte digest of everything that changes KV contents (``ModelIdentity``).
A ``BlockKey`` is a 32-byte hash chained from a root that mixes the fingerprint and an optional
cache salt: key[i] = H(key[i-1], token ids of block i as little-endian int32, extra keys of block
i). Equal keys therefore mean equal model, equal salt and equal full prefix; one changed token
changes its block's key and every key after it. Only full blocks get keys.

Everything here is a pure function of its inputs: the same on every process and machine.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import NewType

import numpy as np

Fingerprint = NewType("Fingerprint", bytes)
BlockKey = NewType("BlockKey", bytes)

KEY_BYTES = 32
_ROOT_DOMAIN = b"kvstore/root/v1"
_BLOCK_DOMAIN = b"kvstore/block/v1"
_FINGERPRINT_DOMAIN = "kvstore/fingerprint/v1"

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}


@dataclass(frozen=True)
class ModelIdentity:
    """Everything that changes the contents of a KV block. Change any field: new keys.

    Digests are hex strings of the files they cover (weights, adapter, tokenizer); ``""`` means
    "none" (no adapter). ``rope_scaling`` is the canonical JSON of the scaling config, or "".

    ``model_id`` names the model for operators (stats, ``kvstore invalidate --model``, the
    router). With a weights digest it is a label only, left out of the fingerprint: the weights
    identify the model, so replicas that mount the same weights at other paths or serve them under
    other names share keys. Without one (a client that cannot digest its weights) the name is all
    that tells two models apart, and it counts.
    """

    model_id: str
    weights_digest: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    kv_dtype: str = "bfloat16"
    kv_quantization: str = ""
    memory_layout: str = "vllm-cpu"  # which engine layout the block bytes follow
    adapter_id: str = ""
    adapter_digest: str = ""
    tokenizer_digest: str = ""
    chat_template_version: str = ""
    rope_theta: float = 10000.0
    rope_scaling: str = ""
    tp_rank: int = 0
    tp_world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "tp_world_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_world_size {self.tp_world_size}")
        if self.kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown kv_dtype {self.kv_dtype!r}; known: {sorted(DTYPE_BYTES)}")

    def canonical(self) -> bytes:
        """The canonical serialization the fingerprint digests (sorted JSON, tagged)."""
        body = {"domain": _FINGERPRINT_DOMAIN, **asdict(self)}
        if self.weights_digest:
            del body["model_id"]
        return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    def fingerprint(self) -> Fingerprint:
        return Fingerprint(hashlib.sha256(self.canonical()).digest())

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this rank: K and V for every layer, head and token of the block."""
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype]
        return per_token * self.tokens_per_block

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def root_key(fingerprint: Fingerprint, cache_salt: bytes | str | None = None) -> BlockKey:
    """The chain's root: mixes the fingerprint and the salt. Not itself a stored block."""
    if len(fingerprint) != KEY_BYTES:
        raise ValueError(f"fingerprint must be {KEY_BYTES} bytes, got {len(fingerprint)}")
    salt = cache_salt.encode() if isinstance(cache_salt, str) else (cache_salt or b"")
    h = hashlib.sha256(_ROOT_DOMAIN)
    h.update(fingerprint)
    h.update(struct.pack("<Q", len(salt)))
    h.update(salt)
    return BlockKey(h.digest())


def block_keys(
    fingerprint: Fingerprint,
    token_ids: Sequence[int] | np.ndarray,
    tokens_per_block: int,
    *,
    cache_salt: bytes | str | None = None,
    extra_keys: Sequence[bytes] = (),
    block_extra_keys: Sequence[Sequence[bytes]] | None = None,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Chained keys for every full block of ``token_ids``.

    ``extra_keys`` apply to every block (an adapter id); ``block_extra_keys[i]`` to block i
    only (hashes of multimodal inputs whose placeholders fall in it). ``parent`` continues a
    chain from an earlier key instead of the root (the salt is then ignored).
    """
    if tokens_per_block <= 0:
        raise ValueError("tokens_per_block must be positive")
    tokens = np.asarray(token_ids, dtype="<i4")
    if tokens.ndim != 1:
        raise ValueError("token_ids must be one-dimensional")
    n_blocks = len(tokens) // tokens_per_block
    if block_extra_keys is not None and len(block_extra_keys) < n_blocks:
        raise ValueError(f"block_extra_keys covers {len(block_extra_keys)} of {n_blocks} blocks")
    raw = tokens[: n_blocks * tokens_per_block].tobytes()
    common = _pack_extras(extra_keys)
    stride = tokens_per_block * 4
    key = parent if parent is not None else root_key(fingerprint, cache_salt)
    keys: list[BlockKey] = []
    for i in range(n_blocks):
        h = hashlib.sha256(_BLOCK_DOMAIN)
        h.update(key)
        h.update(raw[i * stride : (i + 1) * stride])
        h.update(common)
        if block_extra_keys is not None and block_extra_keys[i]:
            h.update(_pack_extras(block_extra_keys[i]))
        key = BlockKey(h.digest())
        keys.append(key)
    return keys


def _pack_extras(extras: Sequence[bytes]) -> bytes:
    """Length-prefixed, so that (b"ab", b"c") and (b"a", b"bc") hash differently."""
    parts = [struct.pack("<I", len(extras))]
    for extra in extras:
        parts.append(struct.pack("<I", len(extra)))
        parts.append(extra)
    return b"".join(parts)


def check_key(key: bytes) -> None:
    """Raise ValueError unless ``key`` is a 32-byte key or fingerprint."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        size = len(key) if isinstance(key, bytes | bytearray | memoryview) else type(key).__name__
        raise ValueError(f"keys and fingerprints are {KEY_BYTES} bytes, got {size}")

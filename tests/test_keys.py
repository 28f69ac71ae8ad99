"""Block identity: every field of the fingerprint matters, chains break at the first change."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from kvstore.keys import BlockKey, ModelIdentity, block_keys, root_key

BASE = ModelIdentity(
    model_id="tiny-llama",
    weights_digest="aa" * 32,
    num_layers=4,
    num_kv_heads=2,
    head_dim=64,
    tokens_per_block=16,
    kv_dtype="bfloat16",
    kv_quantization="",
    memory_layout="vllm-cpu",
    adapter_id="",
    adapter_digest="",
    tokenizer_digest="bb" * 32,
    chat_template_version="v1",
    rope_theta=10000.0,
    rope_scaling="",
    tp_rank=0,
    tp_world_size=2,
)

CHANGED = {
    "weights_digest": "cc" * 32,
    "num_layers": 5,
    "num_kv_heads": 4,
    "head_dim": 128,
    "tokens_per_block": 32,
    "kv_dtype": "float16",
    "kv_quantization": "fp8-per-tensor",
    "memory_layout": "vllm-cuda-flash",
    "adapter_id": "lora-7",
    "adapter_digest": "dd" * 32,
    "tokenizer_digest": "ee" * 32,
    "chat_template_version": "v2",
    "rope_theta": 500000.0,
    "rope_scaling": '{"factor":8.0,"type":"llama3"}',
    "tp_rank": 1,
    "tp_world_size": 4,
}


def test_every_field_is_covered_by_a_change() -> None:
    assert set(CHANGED) | {"model_id"} == set(ModelIdentity.field_names())


def test_the_weights_not_the_name_identify_a_model() -> None:
    # The engines give the served name (vLLM's default: the model's path) as model_id: the same
    # weights under another path or name share keys, other weights under the same name do not.
    renamed = dataclasses.replace(BASE, model_id="/mnt/other-pod/tiny-llama")
    assert renamed.fingerprint() == BASE.fingerprint()
    assert dataclasses.replace(BASE, weights_digest="cc" * 32).fingerprint() != BASE.fingerprint()
    # Without a weights digest the name is all that tells two models apart: it counts.
    anonymous = dataclasses.replace(BASE, weights_digest="")
    assert dataclasses.replace(anonymous, model_id="other").fingerprint() != anonymous.fingerprint()


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_every_fingerprint_field_changes_the_digest(field: str) -> None:
    changed = dataclasses.replace(BASE, **{field: CHANGED[field]})
    assert changed.fingerprint() != BASE.fingerprint()
    assert len(changed.fingerprint()) == 32


def test_fingerprint_is_deterministic_across_processes() -> None:
    code = (
        "from tests.test_keys import BASE; from kvstore.keys import block_keys;"
        "print(BASE.fingerprint().hex(), block_keys(BASE.fingerprint(), list(range(64)), 16)[-1].hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [BASE.fingerprint().hex(), block_keys(BASE.fingerprint(), list(range(64)), 16)[-1].hex()]


def test_block_bytes_follow_the_layout() -> None:
    # 2 (K and V) x 4 layers x 2 heads x 64 dims x 2 bytes x 16 tokens
    assert BASE.block_bytes == 2 * 4 * 2 * 64 * 2 * 16


def test_bad_identity_is_rejected() -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(BASE, tp_rank=2)
    with pytest.raises(ValueError):
        dataclasses.replace(BASE, kv_dtype="float7")
    with pytest.raises(ValueError):
        dataclasses.replace(BASE, num_layers=0)


def test_only_full_blocks_get_keys() -> None:
    fp = BASE.fingerprint()
    assert len(block_keys(fp, list(range(47)), 16)) == 2
    assert len(block_keys(fp, list(range(48)), 16)) == 3
    assert block_keys(fp, [], 16) == []


def test_one_changed_token_changes_its_block_and_every_later_one() -> None:
    fp = BASE.fingerprint()
    tokens = list(range(1000, 1000 + 16 * 8))
    keys = block_keys(fp, tokens, 16)
    tokens[16 * 3 + 5] += 1  # inside block 3
    changed = block_keys(fp, tokens, 16)
    assert changed[:3] == keys[:3]
    assert all(a != b for a, b in zip(changed[3:], keys[3:], strict=True))


def test_tokens_hash_as_int32_not_repr() -> None:
    fp = BASE.fingerprint()
    # 256 and 1 differ as int32 bytes; a naive byte-per-token encoding would collide them.
    assert block_keys(fp, [256] * 16, 16) != block_keys(fp, [0] * 16, 16)
    assert block_keys(fp, [2**31 - 1] * 16, 16) != block_keys(fp, [-1] * 16, 16)


def test_salt_changes_the_root_and_every_key() -> None:
    fp = BASE.fingerprint()
    assert root_key(fp) != root_key(fp, "tenant-a") != root_key(fp, "tenant-b")
    plain = block_keys(fp, list(range(32)), 16)
    salted = block_keys(fp, list(range(32)), 16, cache_salt="tenant-a")
    assert not set(plain) & set(salted)
    assert block_keys(fp, list(range(32)), 16, cache_salt=b"tenant-a") == salted


def test_extra_keys_change_keys_and_are_unambiguous() -> None:
    fp = BASE.fingerprint()
    tokens = list(range(32))
    plain = block_keys(fp, tokens, 16)
    assert block_keys(fp, tokens, 16, extra_keys=[b"lora-1"]) != plain
    assert block_keys(fp, tokens, 16, extra_keys=[b"ab", b"c"]) != block_keys(
        fp, tokens, 16, extra_keys=[b"a", b"bc"]
    )
    per_block = block_keys(fp, tokens, 16, block_extra_keys=[[], [b"image-hash"]])
    assert per_block[0] == plain[0] and per_block[1] != plain[1]


def test_chains_continue_from_a_parent() -> None:
    fp = BASE.fingerprint()
    tokens = list(range(64))
    whole = block_keys(fp, tokens, 16, cache_salt="s")
    head = block_keys(fp, tokens[:32], 16, cache_salt="s")
    tail = block_keys(fp, tokens[32:], 16, parent=BlockKey(head[-1]))
    assert head + tail == whole

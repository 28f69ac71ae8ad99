"""File digests for fingerprints: content-true, path-free, and cached so engine start-up stays
fast; and the vLLM identity built on them: the weights, not the path or the served name."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine_plugin.digests import _SETTLED_S, WEIGHT_PATTERNS, DigestCache
from engine_plugin.vllm_identity import identity_from_vllm


def _settle() -> None:
    """Past the window in which a just-written file's digest is not cached."""
    time.sleep(_SETTLED_S + 0.05)


def _model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "model-00001-of-00002.safetensors").write_bytes(os.urandom(1 << 20))
    (folder / "model-00002-of-00002.safetensors").write_bytes(os.urandom(1 << 16))
    (folder / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (folder / "config.json").write_text("{}")
    return folder


def _flip_in_place(path: Path, offset: int) -> None:
    """One bit of ``path`` changed where it lies, its size and mtime put back as they were."""
    before = path.stat()
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 1]), offset)
    finally:
        os.close(fd)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_folder_digest_follows_the_weights_and_is_cached(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(os.urandom(1 << 20))
    (model / "config.json").write_text("{}")
    _settle()
    cache = DigestCache(tmp_path / "cache.json")
    first = cache.folder_digest(model, WEIGHT_PATTERNS)
    assert first and cache.hashed_files == 1
    cache.save()
    again = DigestCache(tmp_path / "cache.json")
    assert again.folder_digest(model, WEIGHT_PATTERNS) == first
    assert again.hashed_files == 0  # served from the cache: size and mtime unchanged
    (model / "model.safetensors").write_bytes(os.urandom(1 << 20))  # same size, new weights
    weights = again.folder_digest(model, WEIGHT_PATTERNS)
    assert weights != first and again.hashed_files == 1
    model_digest = again.model_digest(model)
    (model / "config.json").write_text('{"x": 1}')  # not a weight file, but the model's config
    assert again.folder_digest(model, WEIGHT_PATTERNS) == weights
    assert again.model_digest(model) != model_digest


def test_no_matching_files_is_an_empty_digest(tmp_path: Path) -> None:
    assert DigestCache(tmp_path / "c.json").folder_digest(tmp_path, WEIGHT_PATTERNS) == ""
    (tmp_path / "config.json").write_text("{}")
    assert DigestCache(tmp_path / "c.json").model_digest(tmp_path) == ""  # a config, no weights


def test_the_digest_is_the_weights_not_their_path(tmp_path: Path) -> None:
    model = _model(tmp_path / "pod-a" / "model")
    copy = Path(shutil.copytree(model, tmp_path / "host-b" / "mnt" / "weights"))
    _settle()
    cache = DigestCache(tmp_path / "cache.json")
    digest = cache.folder_digest(model, WEIGHT_PATTERNS)
    assert cache.folder_digest(copy, WEIGHT_PATTERNS) == digest  # same bytes, another path
    cache.save()
    # one bit flipped in place, size and mtime restored: the cache must not answer for it
    again = DigestCache(tmp_path / "cache.json")
    _flip_in_place(copy / "model-00002-of-00002.safetensors", 1000)
    assert again.folder_digest(copy, WEIGHT_PATTERNS) != digest
    assert again.hashed_files == 1
    assert again.folder_digest(model, WEIGHT_PATTERNS) == digest  # the original: from the cache
    assert again.hashed_files == 1
    # a shard renamed is another checkpoint layout: another digest
    (model / "model-00002-of-00002.safetensors").rename(model / "extra.safetensors")
    assert again.folder_digest(model, WEIGHT_PATTERNS) != digest


def _vllm_config(model: Path, served_name: str | None = None) -> SimpleNamespace:
    """What ``identity_from_vllm`` reads of vLLM's ``VllmConfig`` (building the real one takes
    a minute here: the real engines of tests/test_vllm_e2e.py check it end to end)."""
    hf_config = SimpleNamespace(rope_theta=10000.0, rope_scaling=None)
    model_config = SimpleNamespace(
        model=str(model),
        tokenizer=str(model),
        served_model_name=served_name or str(model),  # vLLM's default: the path it was given
        dtype="torch.bfloat16",
        hf_config=hf_config,
        get_num_layers=lambda parallel: 2,
        get_num_kv_heads=lambda parallel: 2,
        get_head_size=lambda: 32,
    )
    return SimpleNamespace(
        model_config=model_config,
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=32),
        device_config=SimpleNamespace(device="cpu"),
    )


def test_vllm_identity_is_the_weights_not_the_path_or_the_served_name(tmp_path: Path) -> None:
    model = _model(tmp_path / "a" / "model")
    copy = Path(shutil.copytree(model, tmp_path / "b" / "weights"))
    digests = DigestCache(tmp_path / "cache.json")
    base = identity_from_vllm(_vllm_config(model), digests=digests)
    moved = identity_from_vllm(_vllm_config(copy), digests=digests)
    renamed = identity_from_vllm(_vllm_config(copy, served_name="llama-prod"), digests=digests)
    assert base.fingerprint() == moved.fingerprint() == renamed.fingerprint()
    assert (base.model_id, renamed.model_id) == (str(model), "llama-prod")  # a label, kept
    shard = copy / "model-00001-of-00002.safetensors"
    _replace_byte(shard, 4096)
    changed = identity_from_vllm(_vllm_config(copy), digests=digests)
    assert changed.weights_digest != base.weights_digest
    assert changed.fingerprint() != base.fingerprint()  # other weights at the same path
    (copy / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    _replace_byte(shard, 4096)  # the weights as they were: the tokenizer alone differs
    retokenized = identity_from_vllm(_vllm_config(copy), digests=digests)
    assert retokenized.weights_digest == base.weights_digest
    assert retokenized.fingerprint() != base.fingerprint()
    (copy / "config.json").write_text('{"rms_norm_eps": 1e-6}')  # no field of its own: the digest's
    assert identity_from_vllm(_vllm_config(copy), digests=digests).weights_digest != base.weights_digest


def test_a_model_without_local_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="local weights"):
        identity_from_vllm(_vllm_config(Path("meta-llama/Llama-3.1-8B")), digests=DigestCache(tmp_path / "c"))


def _replace_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))

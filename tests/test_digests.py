"""File digests for fingerprints: content-true, and cached so engine start-up stays fast."""

from __future__ import annotations

import os
from pathlib import Path

from engine_plugin.digests import WEIGHT_PATTERNS, DigestCache


def test_folder_digest_follows_the_weights_and_is_cached(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(os.urandom(1 << 20))
    (model / "config.json").write_text("{}")
    cache = DigestCache(tmp_path / "cache.json")
    first = cache.folder_digest(model, WEIGHT_PATTERNS)
    assert first and cache.hashed_files == 1
    cache.save()
    again = DigestCache(tmp_path / "cache.json")
    assert again.folder_digest(model, WEIGHT_PATTERNS) == first
    assert again.hashed_files == 0  # served from the cache: size and mtime unchanged
    (model / "config.json").write_text('{"x": 1}')  # not a weight file
    assert again.folder_digest(model, WEIGHT_PATTERNS) == first
    (model / "model.safetensors").write_bytes(os.urandom(1 << 20))  # same size, new weights
    assert again.folder_digest(model, WEIGHT_PATTERNS) != first
    assert again.hashed_files == 1


def test_no_matching_files_is_an_empty_digest(tmp_path: Path) -> None:
    assert DigestCache(tmp_path / "c.json").folder_digest(tmp_path, WEIGHT_PATTERNS) == ""

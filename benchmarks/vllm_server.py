"""vLLM's own OpenAI server (``vllm.entrypoints.openai.api_server``) on vLLM CPU, with the kvstore
connector, as a child process on 127.0.0.1: what ``kvstore route`` sits in front of.

    server = OpenAIServer(model_dir, sidecar.unix)     # waits until /health answers
    server.url                                          # http://127.0.0.1:<port>
    server.close()

Settings match ``benchmarks/vllm_engine.py``: vLLM's own prefix cache off (every cached token
came through the connector), 32-token blocks, a 256 MiB KV pool, greedy and seeded; usage
reports ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.ports import free_port
from benchmarks.vllm_engine import ENGINE_START_S, KV_CACHE_BYTES, ROOT


class OpenAIServer:
    def __init__(self, model: Path, sidecar: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        transfer = {
            "kv_connector": "KvstoreConnector",
            "kv_connector_module_path": "engine_plugin.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"address": sidecar},
        }
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4096"]
        argv += ["--block-size", "32", "--enforce-eager", "--no-enable-prefix-caching", "--seed", "0"]
        argv += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enable-prompt-tokens-details"]
        argv += ["--kv-transfer-config", json.dumps(transfer), "--uvicorn-log-level", "warning"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-server-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.close(keep_log=True)
            print(f"vLLM's OpenAI server did not start; its log is kept in {self.log.name}", file=sys.stderr)
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + ENGINE_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's OpenAI server exited ({self.proc.returncode}): {self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM's OpenAI server did not answer within {ENGINE_START_S} s: {self._tail()}")

    def _tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def close(self, keep_log: bool = False) -> None:
        """Stop the server and remove its log, unless ``keep_log`` (it failed to start)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()
        if not keep_log:
            Path(self.log.name).unlink(missing_ok=True)

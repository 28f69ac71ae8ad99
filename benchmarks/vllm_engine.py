"""A vLLM CPU engine with the kvstore connector in its own process, driven over stdin/stdout
(by the end-to-end tests and the calibration and decision benchmarks).

    python -m benchmarks.vllm_engine CONFIG_JSON     (``Engine`` writes it: see ``EngineConfig``)
    stdin:  one JSON object per line: {"prompt": [token ids], "salt": str | null, "max_tokens": int,
            "policy": "auto" | "restore" | "recompute" | null (this request's connector policy)}
            or {"batch": [such requests]} (submitted together, run as the engine batches them)
            or {"timed": [such requests, each with "at": seconds from the start]} (each
            submitted at its time, the engine stepping meanwhile: an online server's arrivals)
            or {"metrics": true} or {"reset_prefix_cache": true}
    stdout: one JSON object per line: {"tokens": [...], "logprobs": [...], "cached": int,
            "seconds": float, "ttft": float (vLLM's first-token latency of the request),
            "first_token_at": float, "finished_at": float (the engine's clock: order only)}
            or {"batch": [such replies, in the order sent]} (also for "timed")
            or {"metrics": {"series{labels}": value}} (the connector's ``kvstore_connector_*``
            series from vLLM's Prometheus registry) or {"reset": bool}

``Engine`` starts one and talks to it.

By default the engine runs the kvstore connector with vLLM's own prefix cache off
(``prefix_caching=False``), so every cached token it reports came from kvstore through the
connector; with it on vLLM serves what it still holds itself and the connector is asked only
about the rest. ``connector=None`` runs vLLM alone; another name runs that vLLM connector with
``connector_config`` as its extra config (the replay benchmark's peers).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


ROOT = Path(__file__).resolve().parent.parent
ENGINE_START_S = 240
# vLLM's KV pool, sized in bytes: on CPU `gpu_memory_utilization` is a share of what the NUMA
# node reports (7.7 GiB on some machines, 24 on others), so a share that fits one machine leaves
# nothing on another. 256 MiB holds max_model_len tokens many times over for the test models.
KV_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class EngineConfig:
    """What the engine process is started with (one JSON argument)."""

    model: str
    address: str = ""
    policy: str = "auto"
    calibration: str = ""
    tensor_parallel: int = 1
    prefix_caching: bool = False
    audit_fraction: float = 0.0
    connector: str | None = "kvstore"  # None: vLLM alone; another name: that vLLM connector
    connector_config: dict[str, Any] = field(default_factory=dict)
    kv_cache_bytes: int = KV_CACHE_BYTES
    kv_events_endpoint: str = ""  # vLLM publishes its KV cache events there (ZMQ PUB); "": off


class Engine:
    """One engine process; ``generate`` sends a prompt and waits for its completion."""

    def __init__(
        self,
        model: Path,
        address: str = "",
        policy: str = "auto",
        calibration: str = "",
        tensor_parallel: int = 1,
        prefix_caching: bool = False,
        audit_fraction: float = 0.0,
        connector: str | None = "kvstore",
        connector_config: dict[str, Any] | None = None,
        kv_cache_bytes: int = KV_CACHE_BYTES,
        start_s: float = ENGINE_START_S,
        kv_events_endpoint: str = "",
    ) -> None:
        config = EngineConfig(
            str(model),
            address,
            policy,
            calibration,
            tensor_parallel,
            prefix_caching,
            audit_fraction,
            connector,
            connector_config or {},
            kv_cache_bytes,
            kv_events_endpoint,
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        if tensor_parallel > 1:
            # vLLM CPU binds each rank's threads to a NUMA node; one node here: a core per rank.
            cores = os.cpu_count() or 1
            env.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % cores) for r in range(tensor_parallel))
            )
        # Open for the engine's lifetime; its tail goes into the error if the engine dies, and
        # ``close`` removes it unless the engine failed.
        self.log = tempfile.NamedTemporaryFile(prefix="kv-engine-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.vllm_engine", json.dumps(asdict(config))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
            env=env,
        )
        # A thread reads stdout line by line: a selector on the pipe cannot see lines already
        # sitting in the reader's buffer (two lines in one chunk would hang the second).
        self._lines: queue.Queue[str] = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        try:
            ready = self._read(start_s)
            if not ready.get("ready"):
                raise RuntimeError(f"the engine said {ready} instead of ready")
        except (RuntimeError, TimeoutError):
            self.proc.kill()
            self.proc.wait()
            self._keep_log("the engine did not start")
            raise

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(line)
            else:  # vLLM logs to stdout: keep it with the engine's stderr
                self.log.write(line.encode())
                self.log.flush()
        self._lines.put("")  # end of output: the engine exited

    def _read(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.send_signal(signal.SIGUSR1)  # the engine dumps its stacks into its log
                time.sleep(1)
                tail = self.log_tail()
                raise TimeoutError(
                    f"the engine did not answer in {timeout_s:.0f} s; its log ends:\n{tail}"
                ) from None
            if not line:
                tail = self.log_tail(3000)
                raise RuntimeError(f"the engine exited with {self.proc.wait()}:\n{tail}")
            if line.startswith("{"):
                return dict(json.loads(line))

    def generate(
        self, prompt: list[int], salt: str | None = None, max_tokens: int = 4, policy: str | None = None
    ) -> dict[str, Any]:
        """``policy`` overrides the connector's policy for this request only."""
        assert self.proc.stdin is not None
        request = {"prompt": prompt, "salt": salt, "max_tokens": max_tokens, "policy": policy}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read(300)

    def generate_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Several requests submitted at once (each as ``generate``'s arguments: ``prompt``,
        ``salt``, ``max_tokens``, ``policy``); their replies in the same order."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"batch": requests}) + "\n")
        self.proc.stdin.flush()
        return list(self._read(300)["batch"])

    def generate_timed(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``generate_batch``, each request submitted ``at`` seconds after the first."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"timed": requests}) + "\n")
        self.proc.stdin.flush()
        return list(self._read(600)["batch"])

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's own prefix cache (what the engine still holds itself)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"reset_prefix_cache": True}) + "\n")
        self.proc.stdin.flush()
        return bool(self._read(60)["reset"])

    def log_tail(self, nchars: int = 6000) -> str:
        """The end of the engine's log (vLLM's and the connector's lines), for a failure message."""
        return Path(self.log.name).read_text(errors="replace")[-nchars:]

    def metrics(self) -> dict[str, float]:
        """The connector's Prometheus series: ``name{label=value,...}`` -> value."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"metrics": True}) + "\n")
        self.proc.stdin.flush()
        return dict(self._read(60)["metrics"])

    def close(self, keep_log: bool = False) -> None:
        """Stop the engine and remove its log, unless ``keep_log`` (the caller reads the whole
        log and removes it) or the engine failed to exit cleanly (the log is kept and its path
        printed)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._close_log()
        if code != 0:
            self._keep_log(f"the engine exited with {code}")
        elif not keep_log:
            Path(self.log.name).unlink(missing_ok=True)

    def _close_log(self) -> None:
        self._pump_thread.join(10)  # the engine's last lines written before the file closes
        self.log.close()

    def _keep_log(self, why: str) -> None:
        self._close_log()
        print(f"{why}; the engine's log is kept in {self.log.name}", file=sys.stderr)


def main() -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID: every thread's stack into the log

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    config = EngineConfig(**json.loads(sys.argv[1]))
    llm = LLM(
        model=config.model,
        distributed_executor_backend="uni" if config.tensor_parallel == 1 else "mp",
        tensor_parallel_size=config.tensor_parallel,
        dtype="bfloat16",
        max_model_len=4096,
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=config.prefix_caching,
        kv_cache_memory_bytes=config.kv_cache_bytes,
        kv_transfer_config=_transfer_config(config, KVTransferConfig),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=config.kv_events_endpoint
        )
        if config.kv_events_endpoint
        else None,
        seed=0,
        disable_log_stats=False,  # the connector's decisions reach vLLM's Prometheus registry
    )
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("metrics"):
            print(json.dumps({"metrics": _connector_metrics()}), flush=True)
            continue
        if request.get("reset_prefix_cache"):
            print(json.dumps({"reset": bool(llm.reset_prefix_cache())}), flush=True)
            continue
        batch = request.get("batch", request.get("timed"))
        requests = batch if batch is not None else [request]
        prompts, params = [], []
        for one in requests:
            policy = one.get("policy")
            extra = {"kv_transfer_params": {"kvstore_policy": policy}} if policy else None
            params.append(
                SamplingParams(
                    max_tokens=one.get("max_tokens", 4), logprobs=3, temperature=0.0, extra_args=extra
                )
            )
            prompt = TokensPrompt(prompt_token_ids=one["prompt"])
            if one.get("salt"):
                prompt["cache_salt"] = one["salt"]
            prompts.append(prompt)
        start = time.perf_counter()
        if "timed" in request:
            outs = _run_timed(llm, [float(one["at"]) for one in requests], prompts, params)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        replies = [_reply(out, seconds) for out in outs]
        print(json.dumps({"batch": replies} if batch is not None else replies[0]), flush=True)


_timed_runs = 0


def _run_timed(llm: Any, at: list[float], prompts: list[Any], params: list[Any]) -> list[Any]:
    """Submit each prompt at its time while the engine steps; the outputs in the prompts' order."""
    global _timed_runs
    _timed_runs += 1
    engine = llm.llm_engine
    order = sorted(range(len(prompts)), key=lambda i: at[i])
    outs: dict[int, Any] = {}
    start = time.perf_counter()
    while order or len(outs) < len(prompts):
        now = time.perf_counter() - start
        while order and at[order[0]] <= now:
            i = order.pop(0)
            engine.add_request(f"timed-{_timed_runs}-{i}", prompts[i], params[i])
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[int(out.request_id.split("-")[2])] = out  # timed-RUN-I[-suffix]
        elif order:
            time.sleep(min(0.005, max(0.0, at[order[0]] - now)))
    return [outs[i] for i in range(len(prompts))]


def _reply(out: Any, seconds: float) -> dict[str, Any]:
    completion = out.outputs[0]
    logprobs = [{str(k): v.logprob for k, v in step.items()} for step in completion.logprobs or []]
    stats = out.metrics
    return {
        "tokens": list(completion.token_ids),
        "logprobs": logprobs,
        "cached": out.num_cached_tokens or 0,
        "seconds": seconds,
        "ttft": stats.first_token_latency if stats is not None else seconds,
        "first_token_at": stats.first_token_ts if stats is not None else 0.0,
        "finished_at": stats.last_token_ts if stats is not None else 0.0,
    }


def _transfer_config(config: EngineConfig, transfer_config: Any) -> Any:
    if config.connector is None:
        return None
    if config.connector != "kvstore":
        return transfer_config(
            kv_connector=config.connector,
            kv_role="kv_both",
            kv_connector_extra_config=config.connector_config,
        )
    return transfer_config(
        kv_connector="KvstoreConnector",
        kv_connector_module_path="engine_plugin.vllm_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "address": config.address,
            "policy": config.policy,
            "calibration": config.calibration or None,
            "audit_fraction": config.audit_fraction,
            **config.connector_config,
        },
    )


def _connector_metrics() -> dict[str, float]:
    """The connector's series in vLLM's Prometheus registry (``LLM.get_metrics`` shows only
    ``vllm:`` names), as ``name{label=value,...}`` without vLLM's per-engine labels."""
    from prometheus_client import REGISTRY

    flat: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if not metric.name.startswith("kvstore_connector_"):
            continue
        for sample in metric.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(
                f"{k}={v}"
                for k, v in sorted(sample.labels.items())
                if k in ("decision", "tier", "call", "result")
            )
            flat[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return flat


if __name__ == "__main__":
    main()

"""``kvstore demo --service ADDRESS --engine``: one prompt across a vLLM engine restart.

A tiny random Llama (built here: nothing is downloaded) on vLLM CPU, with the kvstore connector
on the live sidecar and vLLM's own prefix cache on, as in production:

1. the first engine computes the prompt: nothing is in kvstore yet (a full miss), and the
   connector saves its blocks to the sidecar;
2. the same prompt again is served by vLLM's own prefix cache: kvstore is not asked, which is
   why a first try with vLLM shows nothing from kvstore until the engine restarts;
3. the engine stops (its own cache goes with it) and a fresh one serves the prompt: its blocks
   come from the sidecar.

Each engine's first request is a throwaway prompt: vLLM CPU's first forward pass warms the
engine up (seconds, with or without the connector) and would hide what a restore saves. Each
request's line of the connector's own log (what it decided, predicted and measured) is shown.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 1000
WARM_UP = [(i * 13) % 400 + 5 for i in range(64)]


def run_engine_demo(unix_address: str, say: Callable[[str], None] = print) -> bool:
    """False (and says why) when vLLM is not installed here."""
    if importlib.util.find_spec("vllm") is None:
        say(
            "skipped: vLLM is not installed in this environment "
            "(./scripts/setup.sh --with-vllm installs its CPU build)"
        )
        return False
    from benchmarks.tiny_model import build_tiny_llama
    from benchmarks.vllm_engine import Engine

    prompt = [(i * 7) % 500 + 3 for i in range(PROMPT_TOKENS)]
    folder = Path(tempfile.mkdtemp(prefix="kvstore-demo-model-"))
    try:
        start = time.perf_counter()
        model = build_tiny_llama(folder / "tiny-llama", seed=0)
        say(
            f"built a tiny random Llama in {time.perf_counter() - start:.1f} s; the prompt: {PROMPT_TOKENS} tokens"
        )
        first = _start(Engine, model, unix_address, "engine 1", say)
        try:
            cold = _serve(first, prompt, "engine 1", say)
            say(
                f"engine 1: computed all {PROMPT_TOKENS} tokens, first token in {cold['ttft'] * 1e3:.0f} ms "
                f"(nothing in kvstore yet); {_grew(cold, 'kvstore_connector_saved_blocks_total'):.0f} "
                "blocks saved to the sidecar"
            )
            again = _serve(first, prompt, "engine 1", say)
            say(
                f"engine 1, the same prompt again: vLLM's own prefix cache served {again['cached']} tokens "
                f"(first token in {again['ttft'] * 1e3:.0f} ms); kvstore had nothing to add"
            )
        finally:
            first.close()  # the engine removes its log (keeps it when the engine failed)
        say("engine 1 stopped: vLLM's own prefix cache went with it")
        second = _start(Engine, model, unix_address, "engine 2", say)
        try:
            warm = _serve(second, prompt, "engine 2", say)
        finally:
            second.close()
        restored = _grew(warm, "kvstore_connector_restored_tokens_total")
        if restored == 0:
            raise RuntimeError("the fresh engine restored nothing from the sidecar")
        if warm["tokens"] != cold["tokens"]:
            raise RuntimeError("the restored prompt gave another first token than the computed one")
        load_s = _grew(warm, "kvstore_connector_restore_seconds_sum")
        say(
            f"engine 2 (fresh): restored {restored:.0f} of {PROMPT_TOKENS} tokens from the sidecar (loaded "
            f"in {load_s * 1e3:.1f} ms), first token in {warm['ttft'] * 1e3:.0f} ms against "
            f"{cold['ttft'] * 1e3:.0f} ms computed "
            f"in engine 1 ({cold['ttft'] / max(warm['ttft'], 1e-9):.1f}x faster), the same output token"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return True


def _start(engine_class: Any, model: Path, address: str, name: str, say: Callable[[str], None]) -> Any:
    start = time.perf_counter()
    engine = engine_class(model, address, prefix_caching=True)
    started = time.perf_counter() - start
    try:
        warm_up = engine.generate(WARM_UP, max_tokens=1)
    except BaseException:
        engine.close()
        raise
    say(
        f"{name}: started in {started:.0f} s; its first request (a throwaway {len(WARM_UP)}-token prompt, "
        f"vLLM's warm-up) took {warm_up['seconds']:.1f} s"
    )
    return engine


def _serve(engine: Any, prompt: list[int], name: str, say: Callable[[str], None]) -> dict[str, Any]:
    """One request, with the connector's log line for it."""
    log = Path(engine.log.name)
    seen = len(decision_lines(log))
    before = engine.metrics()
    out: dict[str, Any] = engine.generate(prompt, max_tokens=1)
    out["metrics_before"], out["metrics_after"] = before, engine.metrics()
    for line in decision_lines(log)[seen:]:
        say(f"  {name}'s log: {line}")
    return out


def _grew(out: dict[str, Any], series: str) -> float:
    """How much the connector's series (summed over its labels) grew over the request."""
    before, after = out["metrics_before"], out["metrics_after"]
    names = {k for k in after if k == series or k.startswith(series + "{")}
    return float(sum(after[k] - before.get(k, 0.0) for k in names))


def decision_lines(log: Path) -> list[str]:
    """The connector's decision lines, without vLLM's prefix (process, level, time, file)."""
    lines = log.read_text(errors="replace").splitlines()
    return [line.split("] ", 1)[-1] for line in lines if "vllm_decisions.py" in line]


if __name__ == "__main__":  # python -m kvstore.cli.demo_engine UNIX_ADDRESS (scripts/demo.sh)
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m kvstore.cli.demo_engine unix:///path/to/kvstore.sock")
    run_engine_demo(sys.argv[1])

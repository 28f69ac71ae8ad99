"""A starting prefill speed for the cost model, measured at the connector's first start.

The built-in per-token cost (``kvstore.cost_model.DEFAULT_PREFILL``) cannot fit every model and
device: on this project's 2-core CPU machine it was 3x too slow for the tiny test model and 20x
too fast for the small one (0.4 ms a token against 0.1 and 8). A prefill's per-token cost is
mostly its linear layers, so the worker times them once at start, with the model's shapes
(this rank's share under tensor parallelism), dtype and device, through the matrix product
vLLM itself uses there where it can say which: ``probe_per_token_s``. The scheduler's
calibration starts from that instead of the default, until its own timed prefills correct it.

Measured against the engine on this machine (vLLM CPU, bf16): tiny 0.09-0.16 ms a token
against 0.1; small 5.5 against 8 (attention and the element-wise work are left out).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(f"vllm.{__name__}")

PROBE_TOKENS = 256  # a prompt's worth: per-token cost at a few tokens is dominated by call overhead
PROBE_REPEATS = 3  # the fastest of these (the first also warms the kernels up)
PROBE_BUDGET_S = 1.0  # no repeat past this: a big model on CPU takes seconds a pass


@dataclass(frozen=True)
class ModelShapes:
    """One rank's linear layers of one decoder layer (inputs x outputs), how many layers, and
    the weights' type."""

    linears: tuple[tuple[int, int], ...]
    layers: int
    dtype: torch.dtype = torch.bfloat16


def shapes_from_vllm(vllm_config: Any) -> ModelShapes | None:
    """This rank's shapes from vLLM's model config; None where the config does not say them."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    try:
        world = max(1, int(parallel.tensor_parallel_size))
        hidden = int(model.get_hidden_size())
        head = int(model.get_head_size())
        q = int(model.get_num_attention_heads(parallel)) * head
        kv = int(model.get_num_kv_heads(parallel)) * head
        text = getattr(model, "hf_text_config", None) or model.hf_config
        intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden) // world
        layers = int(model.get_num_layers(parallel))
        dtype = model.dtype if isinstance(model.dtype, torch.dtype) else torch.bfloat16
    except (AttributeError, TypeError, ValueError) as exc:
        log.info("kvstore connector: no prefill probe (%s); the built-in prefill curve stands", exc)
        return None
    # qkv, attention output, gate and up, down: a Llama-style decoder layer's products
    return ModelShapes(
        ((hidden, q + 2 * kv), (q, hidden), (hidden, 2 * intermediate), (intermediate, hidden)), layers, dtype
    )


def probe_per_token_s(shapes: ModelShapes, device: torch.device, tokens: int = PROBE_TOKENS) -> float:
    """Seconds a token for the linear layers of one forward pass over ``tokens`` tokens: one
    decoder layer's products timed (the fastest of ``PROBE_REPEATS`` within ``PROBE_BUDGET_S``),
    times the layers. Runs once, in ``register_kv_caches``: 0.1-0.7 s for the test models on
    this 2-core CPU, milliseconds on a GPU."""
    products = []
    for inputs, outputs in shapes.linears:
        weight = torch.randn(outputs, inputs, dtype=shapes.dtype, device=device) * inputs**-0.5
        products.append((torch.randn(tokens, inputs, dtype=shapes.dtype, device=device), _product(weight)))
    best, began = float("inf"), time.perf_counter()
    for _ in range(PROBE_REPEATS):
        _synchronize(device)
        start = time.perf_counter()
        for x, product in products:
            product(x)
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() - began > PROBE_BUDGET_S:
            break
    return best * shapes.layers / tokens


def _product(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x @ weight.T`` as vLLM computes an unquantized linear layer on this device: on CPU its
    dispatch picks oneDNN, a packed AMX kernel or torch's by the machine and shape."""
    if weight.device.type == "cpu":
        try:
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            linear: Callable[..., torch.Tensor] = getattr(layer, "cpu_linear")  # noqa: B009 (set by the dispatch)
            return lambda x: linear(x, weight, None)
        except (ImportError, AttributeError, RuntimeError, TypeError):
            pass  # an older or newer vLLM: torch's product, what vLLM falls back to
    return lambda x: torch.nn.functional.linear(x, weight)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

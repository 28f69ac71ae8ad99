"""Traces for ``kvstore bench replay``: the brief's workloads as token ids, and a user's own trace
read from JSONL.

A trace is a list of requests sent one after another. The generators take the fleet
simulation's workloads (``benchmarks.fleet_sim``: an agent endpoint, multi-turn chats, RAG over
Zipf-popular documents, several tenants) and give every segment of a prompt (a system prompt, a
document, a turn) token ids of its own, drawn from a generator seeded by the segment's name, so
prompts that share a segment share its tokens. A tenant other than the default sends its
requests with its own cache salt: the tenants' system prompts are the same tokens, and no cache
may serve one tenant's KV to another. Sessions are interleaved: ``concurrent`` of them are open
at a time, and each request comes from one of them at random (a session's turns stay in order),
so the trace's working set is larger than any one session.

JSONL format (``--trace FILE``), one request per line:

    {"tokens": [1, 17, 423, ...]}                   token ids of the prompt, or
    {"text": "You are a helpful ..."}               text, tokenized with ``--tokenizer DIR``
                                                    (default: the model's folder)
    optional: "salt": "tenant-a"                    vLLM's cache_salt for the request
              "max_tokens": 16                      tokens to generate (default 16)

Blank lines and lines starting with ``#`` are skipped. A line that is not such an object, or a
token id outside the model's vocabulary, is refused with its line number.

``--trace`` also reads the field's formats (``benchmarks.traces``, told apart by their first
line): Mooncake's (each hash id ``tokens_per_id`` tokens, one vLLM block by default) and
multi-turn chat (text through the tokenizer; without one, a token per word). Their prompts are cut to the model's context and
their outputs to ``DEFAULT_MAX_TOKENS``; their timestamps are not used (one request at a time).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.fleet_sim import Prompt, agent, chats, rag, tenants
from benchmarks.traces import detect_format, read_chat, read_mooncake, token_hit_rate_unbounded, word_ids
from kvstore.errors import InvalidArgument

DEFAULT_MAX_TOKENS = 16
FIRST_ID = 3  # below it: the tiny tokenizer's special tokens


@dataclass(frozen=True)
class TraceRequest:
    tokens: tuple[int, ...]
    salt: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS


# Sized for a 4096-token context with room for the answer (the test models' max_model_len).
WORKLOADS: dict[str, Callable[[random.Random, int], list[list[Prompt]]]] = {
    "agent": lambda rng, n: agent(rng, n, system_tokens=2048, turn_tokens=240),
    "chats": lambda rng, n: chats(rng, n, turn_tokens=260),
    # one request per session: four times the sessions, for a trace as long as the others'
    "rag": lambda rng, n: rag(rng, 4 * n, documents=24, doc_tokens=1536),
    "tenants": lambda rng, n: tenants(rng, n, count=3),
}


def generate(
    workload: str,
    sessions: int,
    vocab: int,
    *,
    seed: int = 0,
    concurrent: int = 8,
    max_prompt_tokens: int = 4096 - DEFAULT_MAX_TOKENS - 1,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> list[TraceRequest]:
    """``sessions`` sessions of ``workload`` (a name in ``WORKLOADS``) as one interleaved trace."""
    if workload not in WORKLOADS:
        raise InvalidArgument(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    rng = random.Random(seed)
    plan = WORKLOADS[workload](rng, sessions)
    cache: dict[str, list[int]] = {}
    out = []
    for prompt in _interleaved(plan, rng, concurrent):
        tokens: list[int] = []
        for what, count in prompt.segments:
            tokens.extend(_segment(cache, f"{workload}:{what}", count, vocab))
        salt = None if prompt.tenant == "tenant" else prompt.tenant
        out.append(TraceRequest(tuple(tokens[:max_prompt_tokens]), salt, max_tokens))
    return out


def distinct_tokens(requests: Sequence[TraceRequest], block_tokens: int) -> int:
    """Tokens in the trace's distinct full blocks (a block is its whole prefix, and its salt): what
    a cache must hold to serve every repeated prefix from memory."""
    seen: set[tuple[str | None, int, int]] = set()
    for request in requests:
        for end in range(block_tokens, len(request.tokens) + 1, block_tokens):
            seen.add((request.salt, end, hash(request.tokens[:end])))
    return len(seen) * block_tokens


def unbounded_hit_rate(requests: Sequence[TraceRequest], block_tokens: int) -> float:
    """The trace's token hit rate with unbounded capacity (``benchmarks.traces``), each salt a
    cache of its own."""
    by_salt: dict[str | None, list[tuple[int, ...]]] = {}
    for request in requests:
        by_salt.setdefault(request.salt, []).append(request.tokens)
    hit = sum(
        token_hit_rate_unbounded(prompts, block_tokens) * sum(map(len, prompts))
        for prompts in by_salt.values()
    )
    return hit / max(1, sum(len(r.tokens) for r in requests))


def read_trace(
    path: Path, vocab: int, tokenizer: Path | None, tokens_per_id: int, max_prompt_tokens: int = 4079
) -> list[TraceRequest]:
    """A trace in any format ``--trace`` reads (the module's docstring)."""
    kind = detect_format(path)
    if kind == "tokens":
        return read_jsonl(path, vocab, tokenizer)
    if kind == "mooncake":
        requests = read_mooncake(path, vocab, tokens_per_id)
    else:
        requests = read_chat(path, _encoder(tokenizer, str(path)) if tokenizer else word_ids(vocab))
    return [
        TraceRequest(r.tokens[:max_prompt_tokens], None, min(r.output_tokens, DEFAULT_MAX_TOKENS))
        for r in requests
    ]


def _segment(cache: dict[str, list[int]], what: str, count: int, vocab: int) -> list[int]:
    """The token ids of a segment: the same name, the same tokens (a longer draw extends a
    shorter one)."""
    have = cache.get(what, [])
    if len(have) < count:
        draw = random.Random(f"segment:{what}")
        have = [draw.randrange(FIRST_ID, vocab) for _ in range(count)]
        cache[what] = have
    return have[:count]


def _interleaved(plan: Sequence[list[Prompt]], rng: random.Random, concurrent: int) -> list[Prompt]:
    waiting = [list(session) for session in plan if session]
    waiting.reverse()
    open_: list[list[Prompt]] = []
    out = []
    while waiting or open_:
        while waiting and len(open_) < concurrent:
            open_.append(waiting.pop())
        session = open_[rng.randrange(len(open_))]
        out.append(session.pop(0))
        if not session:
            open_.remove(session)
    return out


def read_jsonl(path: Path, vocab: int, tokenizer: Path | None = None) -> list[TraceRequest]:
    """A user's trace (the format above); ``tokenizer`` is needed only for "text" lines."""
    encode: Callable[[str], list[int]] | None = None
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            where = f"{path}:{number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(item, dict) or ("tokens" in item) == ("text" in item):
                raise InvalidArgument(f'{where}: expected an object with "tokens" or "text" (one of them)')
            if "text" in item:
                if encode is None:
                    encode = _encoder(tokenizer, where)
                tokens = encode(str(item["text"]))
            else:
                tokens = item["tokens"]
                if not isinstance(tokens, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in tokens
                ):
                    raise InvalidArgument(f'{where}: "tokens" must be a list of integers')
            bad = next((t for t in tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidArgument(
                    f"{where}: token id {bad} is outside the model's vocabulary (0..{vocab - 1})"
                )
            if not tokens:
                raise InvalidArgument(f"{where}: an empty prompt")
            salt = item.get("salt")
            max_tokens = item.get("max_tokens", DEFAULT_MAX_TOKENS)
            if salt is not None and not isinstance(salt, str):
                raise InvalidArgument(f'{where}: "salt" must be a string')
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise InvalidArgument(f'{where}: "max_tokens" must be a positive integer')
            out.append(TraceRequest(tuple(tokens), salt, max_tokens))
    if not out:
        raise InvalidArgument(f"{path}: no requests")
    return out


def _encoder(tokenizer: Path | None, where: str) -> Callable[[str], list[int]]:
    if tokenizer is None:
        raise InvalidArgument(f'{where}: a "text" line needs a tokenizer folder (--tokenizer DIR)')
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    return lambda text: list(tok.encode(text, add_special_tokens=False))

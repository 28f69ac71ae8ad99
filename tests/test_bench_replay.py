"""``kvstore bench replay``: its traces (generated and read from JSONL) and a short replay through
real vLLM CPU engines, vLLM alone against vLLM with the kvstore connector and a real sidecar.
The replay test asserts orderings the cache must produce (hit rates; a request kvstore restored is
served faster than the same request vLLM alone recomputed), not the benchmark's figures."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from benchmarks.replay_traces import TraceRequest, distinct_tokens, generate, read_jsonl
from kvstore.errors import InvalidArgument

VOCAB = 512
FIRST = 3  # the tiny tokenizer's special tokens come before it


def test_generated_traces_are_repeatable_and_interleave_whole_sessions() -> None:
    trace = generate("chats", 6, VOCAB, seed=3)
    assert trace == generate("chats", 6, VOCAB, seed=3)
    assert trace != generate("chats", 6, VOCAB, seed=4)
    assert all(FIRST <= t < VOCAB for r in trace for t in r.tokens)
    # every later turn sends the whole history: some earlier request is its prefix, and turns of
    # one session are not all in a row (sessions interleave)
    continued = [
        i
        for i, r in enumerate(trace)
        if any(r.tokens[: len(p.tokens)] == p.tokens and len(p.tokens) > 200 for p in trace[:i])
    ]
    assert len(continued) >= len(trace) // 2
    assert any(b - a > 1 for a, b in itertools.pairwise(continued))


def test_tenants_share_tokens_but_never_a_salt() -> None:
    trace = generate("tenants", 9, VOCAB, seed=1)
    salts = {r.salt for r in trace}
    assert len(salts) == 3 and None not in salts
    heads = {r.salt: r.tokens[:2048] for r in trace}
    assert len(set(heads.values())) == 1  # the same system prompt: only the salt keeps them apart
    agent = generate("agent", 4, VOCAB)
    assert {r.salt for r in agent} == {None}
    assert all(len(r.tokens) <= 4096 - r.max_tokens - 1 for r in agent)


def test_distinct_tokens_counts_each_prefix_block_once_per_salt() -> None:
    head = tuple(range(3, 67))  # two 32-token blocks
    a = TraceRequest(head + (9,) * 32)
    b = TraceRequest(head + (8,) * 40)
    assert distinct_tokens([a, b], 32) == (2 + 1 + 1) * 32
    assert distinct_tokens([a, TraceRequest(a.tokens, salt="t")], 32) == 2 * 3 * 32


def test_a_jsonl_trace_of_tokens_and_text(tmp_path: Path, tiny_tokenizer: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "# a user's trace\n"
        '{"tokens": [5, 6, 7], "salt": "a", "max_tokens": 2}\n'
        "\n"
        '{"text": "word1 token1 text1"}\n'
    )
    first, second = read_jsonl(path, VOCAB, tiny_tokenizer)
    assert first == TraceRequest((5, 6, 7), "a", 2)
    assert second.salt is None and second.max_tokens == 16 and len(second.tokens) >= 3


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", "trace.jsonl:2: not JSON"),
        ('{"tokens": [1], "text": "x"}', 'with "tokens" or "text"'),
        ('{"tokens": [1, "2"]}', "must be a list of integers"),
        ('{"tokens": [1, 512]}', "token id 512 is outside"),
        ('{"tokens": []}', "an empty prompt"),
        ('{"tokens": [1], "salt": 3}', '"salt" must be a string'),
        ('{"tokens": [1], "max_tokens": 0}', '"max_tokens" must be a positive integer'),
        ('{"text": "hello"}', "needs a tokenizer folder"),
    ],
)
def test_a_bad_trace_line_is_refused_with_its_line_number(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"tokens": [1, 2]}\n' + line + "\n")
    with pytest.raises(InvalidArgument, match=says):
        read_jsonl(path, VOCAB, None)


def test_an_empty_trace_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("# nothing\n")
    with pytest.raises(InvalidArgument, match="no requests"):
        read_jsonl(path, VOCAB)


def test_a_peer_that_does_not_start_is_reported_with_its_error() -> None:
    from benchmarks.replay_setup import failure_reason

    log = (
        "INFO starting\n"
        "[rank0]: Traceback (most recent call last):\n"
        "[rank0]: ValueError: The environment variable 'MOONCAKE_CONFIG_PATH' is not set.\n"
        "RuntimeError: the engine exited with 1:\n"
    )
    assert failure_reason(log) == "ValueError: The environment variable 'MOONCAKE_CONFIG_PATH' is not set."


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from benchmarks.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tok") / "llama", seed=0)


@pytest.mark.timeout(900)  # on a CPU without AVX-512 vLLM's bf16 linears fall back: ~4x slower
def test_a_short_replay_through_vllm_with_and_without_kvstore(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="the replay drives vLLM CPU engines (scripts/setup.sh installs it)")
    from benchmarks.replay import run_replay
    from benchmarks.replay_setup import ReplaySpec

    spec = ReplaySpec(
        "small", ("chats",), sessions=7, pool_tokens=5120, prefix_tokens=2048, rounds=2, peers=False
    )
    out, png = tmp_path / "replay.json", tmp_path / "replay.png"
    doc = run_replay(None, True, str(out), str(png), configs=("kvstore-dram",), spec=spec)
    assert json.loads(out.read_text())["replay"] == doc["replay"] and png.stat().st_size > 10_000
    chats = doc["replay"]["chats"]  # type: ignore[index]
    vllm, ours = chats["vllm"], chats["kvstore-dram"]
    assert doc["working_set_bytes"]["chats"] > doc["pool_bytes"]  # type: ignore[index]
    assert vllm["requests"] == ours["requests"] >= 30
    # vLLM's pool evicts histories; kvstore brings them back
    assert ours["token_hit_rate"] > vllm["token_hit_rate"]
    assert ours["restored_bytes_by_tier"].get("dram", 0) > 0
    rows = {r["metric"]: r for r in doc["results"]}  # type: ignore[attr-defined]
    paired = rows["chats: TTFT where kvstore held more, kvstore-dram"]
    assert paired["value"] is not None and paired["value"] < 1, paired
    restore = rows["restore TTFT vs vLLM's own hit, 2048 tokens"]
    assert restore["value"] is not None, restore  # every round restored the whole prefix

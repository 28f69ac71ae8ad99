"""The field's trace formats (``benchmarks/traces.py``): Mooncake's JSONL and ShareGPT-style chat
read into prompts whose shared blocks are shared tokens, the unbounded-capacity hit rate on hand-made
traces whose answer is worked out here, malformed lines refused with their line number, and a
Mooncake trace replayed through real sidecars and a real shared kvstore server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.fleet_traces import local_vs_global
from benchmarks.traces import (
    Request,
    block_keys,
    detect_format,
    hash_id_hit_rate,
    read_chat,
    read_mooncake,
    read_mooncake_rows,
    token_hit_rate_unbounded,
    unbounded_hit_rate,
    word_ids,
)
from kvstore.errors import InvalidArgument

SAMPLES = Path(__file__).parent.parent / "benchmarks" / "samples"


def write(path: Path, lines: list[object]) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def mooncake(ts: int, ids: list[int], input_length: int | None = None, output: int = 10) -> dict[str, object]:
    return {
        "timestamp": ts,
        "input_length": input_length if input_length is not None else 512 * len(ids),
        "output_length": output,
        "hash_ids": ids,
    }


def test_mooncake_hash_ids_become_shared_token_blocks(tmp_path: Path) -> None:
    trace = write(
        tmp_path / "t.jsonl",
        ["# a label line", mooncake(0, [1, 2]), "", mooncake(1500, [1, 3], input_length=600, output=0)],
    )
    assert detect_format(trace) == "mooncake"
    a, b = read_mooncake(trace, vocab=1000, tokens_per_id=16)
    # id 1 heads both: the same 16 tokens; the partial last block of b (88 of 512 tokens) keeps
    # its share of 16: ceil(88 * 16 / 512) = 3
    assert len(a.tokens) == 32 and len(b.tokens) == 16 + 3
    assert a.tokens[:16] == b.tokens[:16] and a.tokens[16:19] != b.tokens[16:19]
    assert all(3 <= t < 1000 for t in a.tokens + b.tokens)
    assert (a.arrival_s, b.arrival_s) == (0.0, 1.5)
    assert (a.output_tokens, b.output_tokens) == (10, 1)  # a request generates at least a token
    assert len(read_mooncake(trace, vocab=1000)[0].tokens) == 1024  # the format's own 512 per id


def test_unbounded_hit_rate_of_a_hand_made_trace(tmp_path: Path) -> None:
    # hits (leading ids an earlier request held):
    #   [1, 2, 3]    -> 0 (nothing seen)
    #   [1, 2, 4]    -> 2 (1, 2)
    #   [1, 5]       -> 1 (1)
    #   [2, 3]       -> 0 (2 was seen only after 1: another prefix)
    #   [1, 2, 3, 6] -> 3
    # 6 of 14 ids
    trace = write(
        tmp_path / "t.jsonl",
        [mooncake(i, ids) for i, ids in enumerate([[1, 2, 3], [1, 2, 4], [1, 5], [2, 3], [1, 2, 3, 6]])],
    )
    assert hash_id_hit_rate(read_mooncake_rows(trace)) == pytest.approx(6 / 14)
    # in tokens, one 16-token block per id: the same answer
    prompts = [r.tokens for r in read_mooncake(trace, vocab=1000, tokens_per_id=16)]
    assert token_hit_rate_unbounded(prompts, 16) == pytest.approx(6 / 14)
    # 32-token blocks pair the ids: [1,2] hits in requests 2 and 5 only, [1,5] is one block: 64/224
    assert token_hit_rate_unbounded(prompts, 32) == pytest.approx(64 / (14 * 16))
    # keys that already name their prefix (chained) are taken as they are: 8 seen, 8 hits
    assert unbounded_hit_rate([[7, 8], [7, 9], [8]]) == pytest.approx(2 / 5)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "not JSON"),
        ('["a list"]', "expected a JSON object"),
        (json.dumps(mooncake(0, [])), '"hash_ids" must be a non-empty list'),
        (json.dumps({**mooncake(0, [1]), "timestamp": -1}), '"timestamp" must be a non-negative'),
        (json.dumps({**mooncake(0, [1]), "output_length": "12"}), '"output_length" must be'),
        (json.dumps(mooncake(0, [1, 2], input_length=100)), "2 hash ids for input_length 100"),
    ],
)
def test_a_malformed_mooncake_line_is_refused_with_its_line_number(
    tmp_path: Path, line: str, says: str
) -> None:
    trace = write(tmp_path / "t.jsonl", [mooncake(0, [1]), "# comment", line])
    with pytest.raises(InvalidArgument, match=r"t\.jsonl:3: ") as refused:
        read_mooncake(trace, vocab=1000)
    assert says in str(refused.value)


def test_chat_turns_resend_the_conversation_and_conversations_interleave(tmp_path: Path) -> None:
    def conversation(name: str, rounds: int) -> dict[str, object]:
        turns = [{"from": "system", "value": "you are terse"}]
        for r in range(rounds):
            turns += [
                {"from": "human", "value": f"{name} asks {r}"},
                {"from": "gpt", "value": " ".join(["yes"] * (r + 2))},
            ]
        return {"id": name, "conversations": turns}

    openai = {
        "id": "c",
        "messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}],
    }
    trace = write(tmp_path / "chat.jsonl", [conversation("a", 2), conversation("b", 3), openai])
    assert detect_format(trace) == "chat"
    requests = read_chat(trace, word_ids(1000), concurrent=2, interval_s=0.5)
    # a and b open first, a turn each per round; c joins the round after a is done, behind b
    assert [r.session for r in requests] == ["a", "b", "a", "b", "b", "c"]
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    a1, a2 = requests[0], requests[2]
    # a's second prompt: system (3 words) + turn (3) + reply (2) + turn (3), its first the head of it
    assert len(a1.tokens) == 6 and len(a2.tokens) == 11 and a2.tokens[:6] == a1.tokens
    assert (a1.output_tokens, a2.output_tokens) == (2, 3)  # the recorded replies' lengths
    assert requests[5].tokens == tuple(word_ids(1000)("hello there"))
    # the system prompt is shared: b's first request finds a's head of 3 words in 1-token blocks
    assert block_keys(requests[1].tokens, 1)[:3] == block_keys(a1.tokens, 1)[:3]


def test_a_malformed_chat_line_is_refused_with_its_line_number(tmp_path: Path) -> None:
    good = {"id": "a", "conversations": [{"from": "human", "value": "hi"}]}
    bad_role = {"id": "b", "conversations": [{"from": "narrator", "value": "once"}]}
    no_user = {"id": "c", "messages": [{"role": "assistant", "content": "unprompted"}]}
    for line, says in ((bad_role, "turn 0 has \"from\" 'narrator'"), (no_user, "no user turn")):
        trace = write(tmp_path / "chat.jsonl", [good, line])
        with pytest.raises(InvalidArgument, match=r"chat\.jsonl:2: ") as refused:
            read_chat(trace, word_ids(1000))
        assert says in str(refused.value)
    unknown = write(tmp_path / "other.jsonl", [{"prompt": "?"}])
    with pytest.raises(InvalidArgument, match=r"other\.jsonl:1: not a known trace format"):
        detect_format(unknown)


def test_a_global_pool_finds_what_round_robin_local_caches_miss() -> None:
    # two nodes, round robin: the second request lands on the other node, which never saw [1, 2];
    # the third is back on node 0, which holds 1, 2 (its capacity: 4 of the 8 blocks)
    keys = [[1, 2], [1, 2], [1, 2, 3]]
    local, pooled = local_vs_global(keys, nodes=2, capacity=8)
    assert local == pytest.approx(2 / 7) and pooled == pytest.approx(4 / 7)
    # a pool of one block keeps only the last block touched: no prefix survives
    assert local_vs_global(keys, nodes=1, capacity=1) == (0.0, 0.0)


def test_the_samples_are_labelled_synthetic_and_read() -> None:
    moon = SAMPLES / "mooncake-synthetic.jsonl"
    chat = SAMPLES / "chat-synthetic.jsonl"
    for sample in (moon, chat):
        assert "SYNTHETIC" in sample.read_text().splitlines()[0]
    rows = read_mooncake_rows(moon)
    assert len(rows) == 300 and 0.3 < hash_id_hit_rate(rows) < 0.95
    assert len(read_chat(chat, word_ids(1000))) > 40


def test_bench_replay_reads_the_field_formats_cut_to_the_model(tmp_path: Path) -> None:
    from benchmarks.replay_traces import TraceRequest, read_trace, unbounded_hit_rate

    moon = write(tmp_path / "m.jsonl", [mooncake(0, [1, 2, 3], output=500), mooncake(5, [1, 2, 4])])
    first, second = read_trace(moon, 1000, None, tokens_per_id=32, max_prompt_tokens=80)
    assert len(first.tokens) == 80 and first.tokens[:64] == second.tokens[:64]
    assert first.max_tokens == 16 and first.salt is None  # outputs cut to the replay's 16
    chat = write(tmp_path / "c.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "a b c"}]}])
    assert read_trace(chat, 1000, None, 32) == [TraceRequest(tuple(word_ids(1000)("a b c")), None, 16)]
    # each salt is a cache of its own: the same 64 tokens hit only under the salt that stored them
    same = tuple(range(3, 67))
    salted = [TraceRequest(same, "x"), TraceRequest(same, "y"), TraceRequest(same, "x")]
    assert unbounded_hit_rate(salted, 32) == pytest.approx(64 / 192)
    # --limit N: the first N requests, under the file's name
    from benchmarks.replay_setup import QUICK, make_traces

    limited = make_traces(QUICK, 1000, str(moon), tmp_path, None, 32, limit=1)
    assert list(limited) == ["m"] and [r.tokens[:80] for r in limited["m"]] == [first.tokens]


def test_a_mooncake_trace_through_real_sidecars_and_a_shared_tier(tmp_path: Path) -> None:
    """Four real sidecars, round robin, over a shared kvstore server: a block one sidecar stored
    is found by the next request on another, so the hit rate is the trace's unbounded one."""
    from benchmarks.fleet_real import replay
    from benchmarks.fleet_traces import MODEL

    ids = [[1, 2, 3], [1, 2, 4], [1, 2, 4, 5], [1, 6], [1, 2, 3, 7], [1, 2, 4, 5, 8]]
    trace = write(tmp_path / "t.jsonl", [mooncake(10 * i, x) for i, x in enumerate(ids)])
    requests: list[Request] = read_mooncake(trace, vocab=1000, tokens_per_id=16)
    unbounded = token_hit_rate_unbounded([r.tokens for r in requests], 16)
    played = replay("round-robin", True, 0, trace=requests, model=MODEL, speedup=100.0)
    assert played.requests == len(ids) and played.replicas_used == 4
    assert unbounded == pytest.approx(13 / 21)  # hits 0, 2, 3, 1, 3, 4 of 21 blocks
    assert played.hit_rate >= 0.9 * unbounded
    assert len(played.request_s) == len(ids) and played.blocks == 21

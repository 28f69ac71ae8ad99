"""The field's public trace formats, read into one shape for ``bench replay`` and ``bench fleet``.

**Mooncake** (the FAST'25 release: conversation, tool-and-agent and synthetic traces), JSONL,
one request per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 1192]}

``timestamp``: milliseconds since the trace began; ``hash_ids``: one id per 512-token block of
the prompt (the last one partial), an id shared across requests meaning the same prefix block.
Each id becomes ``tokens_per_id`` token ids drawn from a generator seeded by the id (512 keeps
the trace's lengths; a smaller count shrinks every prompt alike, so that a long-context trace
fits a small model or a small machine); the partial last block gets its share of the count.

**Chat** (multi-turn, ShareGPT-style as vLLM's and LMCache's multi-round benchmarks read it),
JSONL, one conversation per line::

    {"id": "c1", "conversations": [{"from": "system", "value": "..."},
                                    {"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}

``"messages": [{"role": "user", "content": "..."}]`` (OpenAI style: system / user / assistant) is
read too. Every user turn is a request whose prompt is the conversation so far (the recorded
replies included) and the new user text; its output length is the recorded reply's. Each
message is encoded on its own, so a turn's prompt extends the previous turn's token for token.
Conversations interleave: ``concurrent`` are open at a time, served in turn; a request's arrival
is its place in that order times ``interval_s``.

Both readers skip blank lines and lines starting with ``#`` (a sample's label) and refuse a
malformed line with its file and line number (``InvalidArgument``). A request's ``arrival_s`` is
the trace's own time; a player honours it divided by a speed-up factor it states.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvstore.errors import InvalidArgument

MOONCAKE_BLOCK_TOKENS = 512  # the tokens behind one hash id, in the format
FIRST_ID = 3  # below it: the special tokens of the test models' tokenizers
DEFAULT_OUTPUT_TOKENS = 16
USER_ROLES = frozenset({"human", "user"})
ROLES = USER_ROLES | {"gpt", "assistant", "system", "bot", "model"}

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class Request:
    arrival_s: float  # the trace's own time since its start
    tokens: tuple[int, ...]
    output_tokens: int
    session: str = ""  # the conversation, where the format names one


@dataclass(frozen=True)
class MooncakeRow:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def detect_format(path: Path) -> str:
    """``mooncake``, ``chat`` or ``tokens`` (``benchmarks.replay_traces``), from the first line."""
    for number, item in _objects(path):
        if "hash_ids" in item:
            return "mooncake"
        if "conversations" in item or "messages" in item:
            return "chat"
        if "tokens" in item or "text" in item:
            return "tokens"
        raise InvalidArgument(
            f"{path}:{number}: not a known trace format (a Mooncake line has hash_ids, a chat line "
            "conversations or messages, a replay line tokens or text)"
        )
    raise InvalidArgument(f"{path}: no requests")


# ----------------------------------------------------------------------------- Mooncake


def read_mooncake_rows(path: Path) -> list[MooncakeRow]:
    rows = []
    for number, item in _objects(path):
        where = f"{path}:{number}"
        fields: dict[str, int] = {}
        for name in ("timestamp", "input_length", "output_length"):
            value = item.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f'{where}: "{name}" must be a non-negative integer, got {value!r}')
            fields[name] = value
        ids = item.get("hash_ids")
        if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
            raise InvalidArgument(f'{where}: "hash_ids" must be a non-empty list of integers')
        blocks = -(-fields["input_length"] // MOONCAKE_BLOCK_TOKENS)
        if blocks != len(ids):
            raise InvalidArgument(
                f"{where}: {len(ids)} hash ids for input_length {fields['input_length']} "
                f"(one per {MOONCAKE_BLOCK_TOKENS} tokens: {blocks})"
            )
        rows.append(
            MooncakeRow(fields["timestamp"], fields["input_length"], fields["output_length"], tuple(ids))
        )
    if not rows:
        raise InvalidArgument(f"{path}: no requests")
    return rows


def read_mooncake(path: Path, vocab: int, tokens_per_id: int = MOONCAKE_BLOCK_TOKENS) -> list[Request]:
    """The trace's requests, each hash id mapped to ``tokens_per_id`` token ids of its own."""
    if tokens_per_id < 1:
        raise InvalidArgument(f"tokens per hash id must be positive, got {tokens_per_id}")
    blocks: dict[int, list[int]] = {}
    out = []
    for row in read_mooncake_rows(path):
        tokens: list[int] = []
        for hash_id in row.hash_ids:
            block = blocks.get(hash_id)
            if block is None:
                draw = random.Random(hash_id)
                block = blocks[hash_id] = [draw.randrange(FIRST_ID, vocab) for _ in range(tokens_per_id)]
            tokens.extend(block)
        last = row.input_length - (len(row.hash_ids) - 1) * MOONCAKE_BLOCK_TOKENS  # 1..512
        short = tokens_per_id - -(-last * tokens_per_id // MOONCAKE_BLOCK_TOKENS)
        del tokens[len(tokens) - short :]
        out.append(Request(row.timestamp_ms / 1000, tuple(tokens), max(1, row.output_length)))
    return out


def hash_id_hit_rate(rows: Iterable[MooncakeRow]) -> float:
    """The trace's hit rate with unbounded capacity in its own unit: the share of hash ids whose
    whole prefix was seen in an earlier request (what a prefix cache of any size could reuse)."""
    return unbounded_hit_rate([_chained(row.hash_ids) for row in rows])


# ----------------------------------------------------------------------------- chat


def word_ids(vocab: int) -> Encode:
    """An encoder that needs no tokenizer: one token id per whitespace-separated word, the same
    word the same id (lengths are word counts)."""
    span = vocab - FIRST_ID
    return lambda text: [FIRST_ID + xxhash.xxh3_64_intdigest(w.encode()) % span for w in text.split()]


def read_chat(path: Path, encode: Encode, *, concurrent: int = 8, interval_s: float = 0.0) -> list[Request]:
    conversations: list[list[Request]] = []
    for number, item in _objects(path):
        where = f"{path}:{number}"
        session = str(item.get("id", f"line-{number}"))
        turns = _turns(item, where)
        prompt: list[int] = []
        requests = []
        for i, (role, text) in enumerate(turns):
            ids = encode(text)
            if role in USER_ROLES:
                following = turns[i + 1] if i + 1 < len(turns) else ("user", "")
                replied = following[0] not in USER_ROLES | {"system"}
                output = len(encode(following[1])) if replied else DEFAULT_OUTPUT_TOKENS
                if prompt or ids:
                    requests.append(Request(0.0, tuple(prompt + ids), max(1, output), session))
            prompt += ids
        if not requests:
            raise InvalidArgument(f"{where}: a conversation with no user turn")
        conversations.append(requests)
    if not conversations:
        raise InvalidArgument(f"{path}: no requests")
    return [
        Request(i * interval_s, r.tokens, r.output_tokens, r.session)
        for i, r in enumerate(_interleaved(conversations, concurrent))
    ]


def _turns(item: dict[str, object], where: str) -> list[tuple[str, str]]:
    key, role_key, text_key = (
        ("conversations", "from", "value") if "conversations" in item else ("messages", "role", "content")
    )
    raw = item.get(key)
    if not isinstance(raw, list) or not raw:
        raise InvalidArgument(f'{where}: "{key}" must be a non-empty list of turns')
    turns = []
    for k, turn in enumerate(raw):
        if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str):
            raise InvalidArgument(f'{where}: turn {k} must be an object with a string "{text_key}"')
        role = str(turn.get(role_key, "")).lower()
        if role not in ROLES:
            raise InvalidArgument(
                f'{where}: turn {k} has "{role_key}" {role!r}; expected one of {sorted(ROLES)}'
            )
        turns.append((role, str(turn[text_key])))
    return turns


def _interleaved(conversations: Sequence[list[Request]], concurrent: int) -> list[Request]:
    """``concurrent`` conversations open at a time, one turn of each in turn; a finished one
    gives its place to the next."""
    waiting = list(reversed(conversations))
    open_: list[list[Request]] = []
    out = []
    while waiting or open_:
        while waiting and len(open_) < max(1, concurrent):
            open_.append(list(waiting.pop()))
        for conversation in list(open_):
            out.append(conversation.pop(0))
            if not conversation:
                open_.remove(conversation)
    return out


# ----------------------------------------------------------------------------- figures


def block_keys(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """Chained keys of the full blocks of ``tokens``: a key names its whole prefix."""
    keys = []
    prev = 0
    for end in range(block_tokens, len(tokens) + 1, block_tokens):
        prev = xxhash.xxh3_64_intdigest(repr((prev, tokens[end - block_tokens : end])).encode())
        keys.append(prev)
    return keys


def unbounded_hit_rate(key_lists: Iterable[Sequence[int]]) -> float:
    """Share of keys found in a cache that keeps everything, requests in order: a request hits
    its leading keys that an earlier request held (a prefix cache stops at the first miss)."""
    seen: set[int] = set()
    hit = total = 0
    for keys in key_lists:
        for key in keys:
            if key not in seen:
                break
            hit += 1
        total += len(keys)
        seen.update(keys)
    return hit / max(1, total)


def token_hit_rate_unbounded(prompts: Iterable[Sequence[int]], block_tokens: int) -> float:
    """The same in tokens over full blocks of ``block_tokens``: the most a cache of this block size
    can reach on the trace (a partial last block is always computed)."""
    hit = total = 0
    seen: set[int] = set()
    for tokens in prompts:
        keys = block_keys(tokens, block_tokens)
        for key in keys:
            if key not in seen:
                break
            hit += block_tokens
        total += len(tokens)
        seen.update(keys)
    return hit / max(1, total)


def distinct_blocks(prompts: Iterable[Sequence[int]], block_tokens: int) -> int:
    return len({k for tokens in prompts for k in block_keys(tokens, block_tokens)})


# ----------------------------------------------------------------------------- lines


def _objects(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"{path}:{number}: not JSON ({e.msg})") from None
            if not isinstance(item, dict):
                raise InvalidArgument(f"{path}:{number}: expected a JSON object")
            yield number, item


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _chained(ids: Sequence[int]) -> list[int]:
    """Ids made prefix-exact: the same id after another prefix is another block."""
    out = []
    prev = 0
    for i in ids:
        prev = xxhash.xxh3_64_intdigest(f"{prev}|{i}".encode())
        out.append(prev)
    return out

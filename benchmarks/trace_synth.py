"""Synthetic traces in the field's formats (``benchmarks.traces``), since the real ones cannot be
downloaded here. They are labelled synthetic on their first line and are no measurement of any
service: they have the shape of Mooncake's conversation trace (a few shared system prompts of
Zipf popularity, multi-turn sessions whose every turn resends the history, documents some
sessions share, one partial block at the end of each prompt) at a size this machine replays.

    python -m benchmarks.trace_synth mooncake --requests 300 --out benchmarks/samples/mooncake-synthetic.jsonl
    python -m benchmarks.trace_synth chat --conversations 40 --out benchmarks/samples/chat-synthetic.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

from benchmarks.traces import MOONCAKE_BLOCK_TOKENS

LABEL = "# SYNTHETIC trace in the {} format, written by benchmarks/trace_synth.py (seed {}): not real traffic"


def mooncake_lines(requests: int, seed: int = 0) -> list[str]:
    """``requests`` Mooncake-format lines: sessions of 1-6 turns, each turn the history plus new
    blocks, on one of 6 system prompts (Zipf) and, for a third of sessions, one of 30 documents."""
    rng = random.Random(seed)
    ids = itertools.count(1)
    systems = [[next(ids) for _ in range(rng.randint(2, 6))] for _ in range(6)]
    documents = [[next(ids) for _ in range(rng.randint(4, 16))] for _ in range(30)]
    zipf = [1 / (i + 1) ** 1.1 for i in range(30)]
    lines: list[tuple[int, dict[str, object]]] = []
    start_ms = 0
    while len(lines) < requests:
        start_ms += int(rng.expovariate(1 / 900))  # a new session every ~0.9 s
        full = list(rng.choices(systems, weights=zipf[:6])[0])
        if rng.random() < 1 / 3:
            full += rng.choices(documents, weights=zipf)[0]
        at = start_ms
        for _ in range(rng.randint(1, 6)):
            full += [next(ids) for _ in range(rng.randint(1, 4))]  # the new user turn's blocks
            tail = rng.randint(1, MOONCAKE_BLOCK_TOKENS)  # the partial last block: its own id
            row = {
                "timestamp": at,
                "input_length": len(full) * MOONCAKE_BLOCK_TOKENS + tail,
                "output_length": rng.randint(20, 600),
                "hash_ids": [*full, next(ids)],
            }
            lines.append((at, row))
            full += [next(ids) for _ in range(rng.randint(0, 1))]  # the reply's full blocks
            at += int(rng.expovariate(1 / 20_000))  # the user reads and types (~20 s)
    lines.sort(key=lambda pair: pair[0])
    return [LABEL.format("Mooncake", seed)] + [json.dumps(row) for _, row in lines[:requests]]


def chat_lines(conversations: int, seed: int = 0) -> list[str]:
    """ShareGPT-style conversations: a shared system prompt, 2-6 rounds of words."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(f"w{rng.randrange(5000)}" for _ in range(words))

    system = text(120)
    out = [LABEL.format("ShareGPT chat", seed)]
    for c in range(conversations):
        turns = [{"from": "system", "value": system}]
        for _ in range(rng.randint(2, 6)):
            turns.append({"from": "human", "value": text(rng.randint(20, 120))})
            turns.append({"from": "gpt", "value": text(rng.randint(30, 200))})
        out.append(json.dumps({"id": f"synthetic-{c}", "conversations": turns}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("format", choices=("mooncake", "chat"))
    parser.add_argument("--requests", type=int, default=300, help="Mooncake lines")
    parser.add_argument("--conversations", type=int, default=40, help="chat lines")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    lines = (
        mooncake_lines(args.requests, args.seed)
        if args.format == "mooncake"
        else chat_lines(args.conversations, args.seed)
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

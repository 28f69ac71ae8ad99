"""A routed request's body, parsed and checked before anything reads it: every malformed body is
a ``BadBody`` (the router's 400), never an exception from deeper down (a 500).

Refused: bytes that are not UTF-8 JSON; a body that is not an object; nesting deeper than
``MAX_DEPTH``; ``NaN``/``Infinity`` and numbers that overflow a float (``1e400``) or run past
``MAX_INT_DIGITS`` digits; and, in the fields the router reads, the wrong types: ``prompt`` a
string, token ids, or a list of either; token ids integers in [0, 2^31) (the engines' and the
block keys' range); ``messages`` a list of objects whose ``content`` is a string, a list of
objects, or null; ``cache_salt`` a string. The other fields are the engine's business and go to
it as they came.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 64  # an OpenAI request nests a few levels; 100k levels is an attack on the parser
MAX_INT_DIGITS = 20
TOKEN_ID_LIMIT = 2**31


class BadBody(ValueError):
    """The body cannot be routed; its message says why, for the caller."""


def _constant(name: str) -> float:
    raise BadBody(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadBody(f"the number {text[:40]} is out of range")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BadBody(f"an integer of {len(text)} digits is out of range")
    return int(text)


def _depth_within(value: object, limit: int) -> bool:
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return False
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return True


def parse_body(raw: bytes, path: str) -> dict[str, Any]:
    """The body of a request to ``path`` (``/v1/completions`` or ``/v1/chat/completions``)."""
    try:
        body = json.loads(raw, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except RecursionError:
        raise BadBody(f"invalid JSON body: nested deeper than {MAX_DEPTH} levels") from None
    except BadBody as exc:
        raise BadBody(f"invalid JSON body: {exc}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise BadBody(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadBody("invalid JSON body: not a JSON object")
    if not _depth_within(body, MAX_DEPTH):
        raise BadBody(f"invalid JSON body: nested deeper than {MAX_DEPTH} levels")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadBody("cache_salt must be a string")
    if path == "/v1/chat/completions":
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
    return body


def _check_token_ids(ids: list[Any]) -> None:
    for t in ids:
        # bool is an int to Python, not to the engine
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < TOKEN_ID_LIMIT:
            raise BadBody(f"a token id must be an integer from 0 to {TOKEN_ID_LIMIT - 1}, got {t!r:.40}")


def _check_prompt(prompt: object) -> None:
    if prompt is None or isinstance(prompt, str):
        return
    if not isinstance(prompt, list):
        raise BadBody("prompt must be a string, token ids, or a list of either")
    if all(isinstance(p, str) for p in prompt):
        return
    if all(isinstance(p, list) for p in prompt):
        for ids in prompt:
            _check_token_ids(ids)
        return
    _check_token_ids(prompt)


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list):
        raise BadBody("messages must be a list of objects")
    for message in messages:
        if not isinstance(message, dict):
            raise BadBody("messages must be a list of objects")
        role, content = message.get("role"), message.get("content")
        if role is not None and not isinstance(role, str):
            raise BadBody("a message's role must be a string")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
            raise BadBody("a message's content must be a string or a list of objects")

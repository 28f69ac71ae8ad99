"""``kvstore config``: every setting's effective value and where it came from.

The values are what ``kvstore serve`` would run with given the same ``--config``, ``--set``
and environment: they come from the loader itself (``kvstore.server.config.load_settings``),
called once per layer of its precedence (defaults, then the file, then ``KVSTORE_*``
variables, then flags), and a setting's source is the highest layer that changed it. A value a
layer sets to what the layers below already gave reads as theirs: the same value either way.
Secrets are never printed: a setting named for a token, password or secret shows ``***`` in
place of the secret (``server.tokens`` keeps its tenants and hides the tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from kvstore.cli.common import overrides
from kvstore.server.config import Settings, load_settings

REDACTED = "***"
_SECRET_WORDS = ("token", "password", "secret")
_NOT_SECRET_SUFFIXES = ("_file", "_dir", "_path")
_SECRET_KEYS = frozenset({"server.tokens"})  # token -> tenant: the keys are the secrets


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    config = sub.add_parser(
        "config",
        parents=[common],
        help="print every setting's effective value and its source (default, file, env, flag)",
    )
    config.add_argument("--json", action="store_true", help='{"settings": {NAME: {"value", "source"}}}')
    config.set_defaults(func=run_config)


def run_config(args: argparse.Namespace) -> int:
    rows = effective_settings(args.config, dict(os.environ), overrides(args))
    if args.json:
        out = {name: {"value": _plain(value), "source": source} for name, value, source in rows}
        print(json.dumps({"file": args.config, "settings": out}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"settings ({args.config or 'no file'})")
    for col in ("setting", "value", "source"):
        table.add_column(col, overflow="fold")
    for name, value, source in rows:
        table.add_row(name, _text(value), source)
    Console().print(table)
    return 0


def effective_settings(
    config_file: str | None, env: Mapping[str, str], flags: Mapping[str, str]
) -> list[tuple[str, Any, str]]:
    """(dotted name, effective value with secrets redacted, source) of every setting."""
    quiet = logging.getLogger("kvstore.server.config")
    layers: list[tuple[str, Settings]] = [("default", load_settings(None, env={}))]
    if config_file:
        layers.append(("file", load_settings(config_file, env={})))
    was = quiet.disabled
    quiet.disabled = True  # the last layer warns of unknown variables; this one need not too
    try:
        layers.append(("env", load_settings(config_file, env=env)))
    finally:
        quiet.disabled = was
    if flags:
        layers.append(("flag", load_settings(config_file, env=env, overrides=flags)))
    flat = [(source, dict(_leaves(settings))) for source, settings in layers]
    rows = []
    for name, value in flat[-1][1].items():
        source = "default"
        for (_, lower), (layer, upper) in itertools.pairwise(flat):
            if upper[name] != lower[name]:
                source = layer
        rows.append((name, redact(name, value), source))
    return rows


def _leaves(section: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def is_secret(name: str) -> bool:
    field = name.rpartition(".")[2]
    return any(w in field for w in _SECRET_WORDS) and not field.endswith(_NOT_SECRET_SUFFIXES)


def redact(name: str, value: Any) -> Any:
    """``value`` with the secrets in it replaced by REDACTED."""
    if not is_secret(name) or value in ("", None) or value == {}:
        return value
    if isinstance(value, Mapping):
        if name in _SECRET_KEYS:
            return {f"{REDACTED}{i}": v for i, v in enumerate(value.values(), 1)}
        return dict.fromkeys(value, REDACTED)
    return REDACTED


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


UNSET = "(none)"


def _text(value: Any) -> str:
    # None, "" and an empty list or table all mean "not set" to the loader; the table says so
    # one way (--json keeps each value's own type: null, "", [] or {}).
    if value is None or value == "":
        return UNSET
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in value.items()) or UNSET
    if isinstance(value, tuple | list):
        return ",".join(map(str, value)) or UNSET
    return str(value)

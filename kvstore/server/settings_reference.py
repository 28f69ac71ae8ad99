"""The settings reference (docs/settings.md), generated from the settings' own declarations.

Each knob is a field of a frozen section dataclass (``kvstore.server.config``); its description
is the comment written beside it or on the lines just above it, its default the field's default.
Reading the source rather than a second table keeps the reference from drifting:
``tests/test_settings_reference.py`` fails when docs/settings.md is not what this prints, or
when a field has no comment.

    python -m kvstore.server.settings_reference > docs/settings.md
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import io
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvstore.server.config import Settings, enum_name

_HEADER = """\
# Settings reference

Generated from the code (`kvstore/server/config.py` and the sections it names) by
`python -m kvstore.server.settings_reference > docs/settings.md`; a test fails when this file
is stale. Do not edit it by hand: change the comment beside the field.

Sources, lowest precedence first: embedded defaults, a TOML file (`kvstore serve --config
FILE`), `KVSTORE_<SECTION>_<FIELD>` environment variables (`KVSTORE_DRAM_CAPACITY_BYTES=8GiB`,
`KVSTORE_DATA_DIR=/srv/kv`), then `--set section.field=value` flags. A variable that names no
setting is reported in one warning and ignored; a bad value is refused in one line naming the
setting. Sizes take units (`512MiB`, `4GiB`, `1.5GB`), durations (settings ending in `_s`) too
(`250ms`, `10s`, `5m`, `1h`). Tables are TOML tables, or `name=value,name=value` in a variable or
`--set`; lists are TOML arrays, or comma-separated. `KVSTORE_TOKEN`, `KVSTORE_ADDRESS` and
`KVSTORE_TLS_CA`, `KVSTORE_TLS_CERT`, `KVSTORE_TLS_KEY` belong to the client commands, not to
the server.
"""


@dataclass(frozen=True)
class Knob:
    """One setting as the reference shows it."""

    name: str  # dotted: "dram.capacity_bytes", or "data_dir" at the top
    kind: str  # "size", "duration", "true/false", "`cache` or `durable`", ...
    default: str  # as one would write it in kvstore.toml
    description: str  # the field's comment; "" when it has none


def knobs() -> list[Knob]:
    """Every setting, top-level ones first, then each section in declaration order."""
    out: list[Knob] = []
    hints = typing.get_type_hints(Settings)
    top_docs = field_comments(Settings)
    for f in dataclasses.fields(Settings):
        if not dataclasses.is_dataclass(hints[f.name]):
            out.append(_knob(f, hints[f.name], f.name, top_docs.get(f.name, "")))
    for f in dataclasses.fields(Settings):
        section = hints[f.name]
        if isinstance(section, type) and dataclasses.is_dataclass(section):
            docs = field_comments(section)
            section_hints = typing.get_type_hints(section)
            for sf in dataclasses.fields(section):
                out.append(_knob(sf, section_hints[sf.name], f"{f.name}.{sf.name}", docs.get(sf.name, "")))
    return out


def reference() -> str:
    """docs/settings.md, whole."""
    lines = [_HEADER.rstrip("\n")]
    current = None
    for knob in knobs():
        section = knob.name.split(".")[0] if "." in knob.name else ""
        if section != current:
            current = section
            doc = _section_doc(section)
            lines += ["", f"## [{section}]" if section else "## Top level", ""]
            lines += [doc, ""] if doc else []
            lines += ["| setting | kind | default | what |", "|---|---|---|---|"]
        lines.append(f"| `{knob.name}` | {knob.kind} | {knob.default} | {_cell(knob.description)} |")
    return "\n".join(lines) + "\n"


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the comment lines just above it and the comments on its own lines."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    code_lines = source.splitlines()
    class_node = typing.cast(ast.ClassDef, ast.parse(source).body[0])
    out: dict[str, str] = {}
    previous_end = class_node.lineno  # the class line; decorators lie above it
    body = class_node.body
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above: list[str] = []
            line = node.lineno - 1
            while line > previous_end and line in comments and code_lines[line - 1].lstrip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            own = [
                comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in comments
            ]
            out[node.target.id] = " ".join(above + own)
        previous_end = node.end_lineno or node.lineno
    return out


def _section_doc(section: str) -> str:
    if not section:
        return ""
    cls = typing.get_type_hints(Settings)[section]
    doc = inspect.getdoc(cls) or ""
    # a dataclass without a docstring gets a generated signature as its doc: not a description
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split())


def _knob(f: dataclasses.Field[Any], hint: Any, name: str, description: str) -> Knob:
    if f.default is not dataclasses.MISSING:
        default = _value(f.default, name)
    elif f.default_factory is not dataclasses.MISSING and f.default_factory in (dict, tuple, list):
        default = _value(f.default_factory(), name)
    else:  # computed where the server starts (data_dir): the description says how
        default = "computed at start"
    return Knob(name, _kind(hint, name), default, description)


def _kind(hint: Any, name: str) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _kind(inner[0], name) + " or none"
    if origin is Literal:
        choices = [f"`{c}`" if c else '`""`' for c in typing.get_args(hint)]
        return "one of " + ", ".join(choices)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(f"`{enum_name(m)}`" for m in hint)
    if origin in (Mapping, dict) or hint in (Mapping, dict):
        value = typing.get_args(hint)[1] if typing.get_args(hint) else str
        return f"table of {_kind(value, name)}"
    if origin is tuple:
        return "list"
    if hint is bool:
        return "true/false"
    if hint is int:
        return "size" if "_bytes" in name else "integer"
    if hint is float:
        return "duration" if name.endswith("_s") else "number"
    return "text"


def _value(value: object, name: str) -> str:
    if value is None:
        return "none"
    if isinstance(value, enum.Enum):
        return f'`"{enum_name(value)}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and "_bytes" in name:
        return f"`{_size(value)}`"
    if isinstance(value, float):
        text = f"{value:g}"
        return f"`{text}s`" if name.endswith("_s") else f"`{text}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, Mapping):
        return "`{}`" if not value else "`" + ", ".join(f"{k}={v}" for k, v in value.items()) + "`"
    if isinstance(value, tuple | list):
        return "`[" + ", ".join(f'"{v}"' for v in value) + "]`"
    return f"`{value}`"


def _size(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _cell(text: str) -> str:
    """A comment as a table cell: pipes escaped, placeholders such as <data_dir>/nvme in code
    (markdown would take them for HTML tags and hide them)."""
    return re.sub(r"(?<![`\w])(<\w+>[^\s,;)]*)", r"`\1`", text.replace("|", "\\|"))


if __name__ == "__main__":
    print(reference(), end="")

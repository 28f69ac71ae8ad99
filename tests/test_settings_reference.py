"""docs/settings.md is generated from the settings' declarations and cannot drift from them."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

from kvstore.server.config import Settings, load_settings
from kvstore.server.settings_reference import field_comments, knobs, reference

DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def test_docs_settings_md_is_what_the_code_generates() -> None:
    assert DOC.read_text() == reference(), (
        "docs/settings.md is stale: python -m kvstore.server.settings_reference > docs/settings.md"
    )


def test_every_setting_in_the_code_is_in_the_reference_with_a_description() -> None:
    hints = typing.get_type_hints(Settings)
    declared = set()
    for f in dataclasses.fields(Settings):
        if dataclasses.is_dataclass(hints[f.name]):
            declared |= {f"{f.name}.{sf.name}" for sf in dataclasses.fields(hints[f.name])}
        else:
            declared.add(f.name)
    listed = {k.name: k for k in knobs()}
    assert set(listed) == declared
    undocumented = sorted(name for name, k in listed.items() if not k.description)
    assert not undocumented, f"give these fields a comment (the reference reads it): {undocumented}"


def test_each_default_the_reference_shows_is_the_default_the_code_loads() -> None:
    defaults = Settings()
    checked = 0
    for knob in knobs():
        text = knob.default.strip("`")
        if knob.default in ("none", "computed at start") or text[:1] in "{[":
            continue
        section, _, name = knob.name.rpartition(".")
        loaded = load_settings(env={}, overrides={knob.name: text.strip('"')})
        expected = getattr(getattr(defaults, section), name) if section else getattr(defaults, name)
        actual = getattr(getattr(loaded, section), name) if section else getattr(loaded, name)
        assert actual == expected, f"{knob.name}: the reference shows {knob.default}"
        checked += 1
    assert checked > 50


@dataclass(frozen=True)
class _Example:
    """A section."""

    # above, first line
    # above, second line
    above: int = 1
    beside: str = "x"  # beside it
    wrapped: tuple[str, ...] = (
        "a",  # on a wrapped declaration's
        "b",
    )  # own lines
    bare: float = 0.0

    # a blank line parts this from the field below: not its comment

    after_blank: bool = True


def test_comments_are_read_above_beside_and_on_wrapped_declarations() -> None:
    docs = field_comments(_Example)
    assert docs["above"] == "above, first line above, second line"
    assert docs["beside"] == "beside it"
    assert docs["wrapped"] == "on a wrapped declaration's own lines"
    assert docs["bare"] == ""
    assert docs["after_blank"] == ""

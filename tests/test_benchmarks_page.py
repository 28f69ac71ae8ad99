"""BENCHMARKS.md is a results page a user can rerun: every file it cites is in the repository,
every command it names parses with the CLI's own parser (or is a script that exists), and the
ratios in its summary are the ones the kept output it cites printed."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvstore.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "BENCHMARKS.md").read_text()

# Paths into the repository's own folders, wherever the page names them (prose, tables, code);
# not the tail of an absolute path such as /run/kvstore/kvstore.sock.
REPO_PATH = re.compile(
    r"(?<![\w/])(?:bench-results|benchmarks|scripts|tests|tiers|kvstore|engine_plugin|docs)/[\w./-]*"
)
KEPT = re.compile(r"bench-results/[\w.-]+\.txt")
# A figure as the bench tables print it: a ratio with two decimals, or milliseconds.
FIGURE = re.compile(r"(\d+\.\d+)(x| ms)\b")


def _summary_rows() -> list[list[str]]:
    section = PAGE.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows[0].split("|")[1:-1] == [" figure ", " target ", " latest ", " command ", " kept output "]
    return [[cell.strip() for cell in row.split("|")[1:-1]] for row in rows[2:]]


def _code_commands() -> list[str]:
    commands = []
    for block in re.findall(r"```\n(.*?)```", PAGE, re.S):
        for line in block.splitlines():
            line = line.split(" | ")[0].split("#")[0].strip()
            if line:
                commands.append(line)
    return commands


def _check_command(command: str) -> None:
    """Fails unless the command is a real CLI invocation (its flags included) or a script here."""
    words = shlex.split(command)
    if words[0] == "kvstore":
        try:
            build_parser().parse_args(words[1:])
        except SystemExit as exc:
            raise AssertionError(f"{command!r}: the CLI refuses it") from exc
    elif words[:2] == ["python", "-m"] and words[2].startswith("benchmarks."):
        module = ROOT / (words[2].replace(".", "/") + ".py")
        assert module.is_file(), f"{command!r}: {module} is not in the repository"
        source = module.read_text()
        # Modes come first (`privacy_costs seal`), then flags, each flag's value after it.
        flags = [i for i, word in enumerate(words) if word.startswith("--")]
        for mode in words[3 : flags[0] if flags else None]:
            assert f'"{mode}"' in source, f"{command!r}: {words[2]} has no mode {mode}"
        for i in flags:
            flag = words[i].split("=")[0]
            assert f'"{flag}"' in source, f"{command!r}: {words[2]} takes no {flag}"
    elif words[0] == "bash":
        assert (ROOT / words[1]).is_file(), f"{command!r}: {words[1]} is not in the repository"
    else:
        raise AssertionError(f"{command!r} is neither a kvstore command nor a script of the repository")


def test_every_path_the_page_cites_is_in_the_repository() -> None:
    cited = {match.rstrip(".,;:)") for match in REPO_PATH.findall(PAGE)}
    assert len(cited) > 10
    missing = sorted(path for path in cited if not (ROOT / path).exists())
    assert not missing, f"BENCHMARKS.md cites paths that are not in the repository: {missing}"
    for name in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", PAGE):
        assert (ROOT / name).is_file(), f"plot {name} is not in the repository"
    for doc in set(re.findall(r"\b[A-Z]+\.md\b", PAGE)):
        assert (ROOT / doc).is_file(), f"BENCHMARKS.md names {doc}, which is not in the repository"


def test_every_summary_row_has_a_target_a_real_command_and_a_kept_output() -> None:
    rows = _summary_rows()
    assert len(rows) >= 20
    for figure, target, latest, command, kept in rows:
        assert target and latest, f"row {figure!r} has no target or no latest figure"
        names = re.findall(r"`([^`]+)`", command)
        assert len(names) == 1, f"row {figure!r} names no single command"
        _check_command(names[0])
        outputs = KEPT.findall(kept)
        assert outputs, f"row {figure!r} cites no kept output in bench-results/"
        for output in outputs:
            assert (ROOT / output).is_file(), f"row {figure!r}: {output} is not in the repository"


@pytest.mark.parametrize("command", _code_commands())
def test_every_command_shown_parses(command: str) -> None:
    _check_command(command)


def test_summary_figures_are_the_ones_the_kept_output_printed() -> None:
    checked = 0
    for figure, _target, latest, _command, kept in _summary_rows():
        printed = "".join((ROOT / output).read_text() for output in KEPT.findall(kept))
        for number, unit in FIGURE.findall(latest):
            # Tables print "1.71 ms", some scripts "1.71ms".
            assert f"{number}{unit}" in printed or f"{number}{unit.strip()}" in printed, (
                f"row {figure!r}: {number}{unit} is not in {KEPT.findall(kept)}"
            )
            checked += 1
    assert checked >= 40


def test_the_page_is_results_not_a_lab_notebook() -> None:
    found = re.findall(r"\b(sitting|scratch)\b", PAGE, re.I)
    assert not found, f"BENCHMARKS.md reads as a lab notebook: {len(found)} x {set(found)}"

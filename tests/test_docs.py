"""The user docs (README.md, docs/*.md, ARCHITECTURE.md) name only what exists: files, `kvstore`
commands and their flags, settings. A renamed flag or setting, or a moved file, fails here
rather than in a reader's shell."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

from kvstore.cli.main import build_parser
from kvstore.server.settings_reference import knobs

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = ("store", "dram", "nvme", "hbm", "server", "remote", "events")
FILE_SUFFIXES = (".md", ".py", ".sh", ".c", ".h", ".toml", ".proto", ".yaml", ".yml", ".json")


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def _code_spans(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", prose)


def _shell_commands(text: str) -> list[str]:
    """Each command of the sh blocks, continuation lines joined, comments dropped."""
    out: list[str] = []
    for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, flags=re.S):
        lines = [re.sub(r"(^|\s)#.*$", "", line).rstrip() for line in block.splitlines()]
        joined = "\n".join(lines).replace("\\\n", " ")
        pending = ""
        for line in joined.splitlines():
            pending += line
            if pending.count("'") % 2:  # a quoted argument (JSON) goes on over the next lines
                pending += " "
                continue
            out += [part.strip() for part in re.split(r"&&|\|\||;|\||&(?!\w)", pending) if part.strip()]
            pending = ""
    return out


def _kvstore_invocations(path: Path) -> list[list[str]]:
    text = path.read_text()
    commands = [(c, True) for c in _shell_commands(text)]
    commands += [(s, False) for s in _code_spans(text) if s.startswith("kvstore ")]
    top = _subparsers(build_parser())
    out = []
    for command, in_block in commands:
        try:
            words = shlex.split(command)
        except ValueError:
            continue
        while words and ("=" in words[0] and not words[0].startswith("-")):
            words = words[1:]  # VAR=value before the command
        if not words or Path(words[0]).name != "kvstore" or any("<" in w for w in words):
            continue
        if in_block or (words[1:2] and (words[1] in top or words[1].startswith("-"))):
            out.append(words[1:])  # a span like `kvstore sidecar at …` quotes a log line
    return out


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_kvstore_command_and_flag_in_the_docs_exists(doc: Path) -> None:
    settings = {k.name for k in knobs()}
    for words in _kvstore_invocations(doc):
        parser = build_parser()
        chain = ["kvstore"]
        while words and words[0] in _subparsers(parser):
            parser = _subparsers(parser)[words[0]]
            chain.append(words.pop(0))
        assert len(chain) > 1 or words[:1] in (["--version"], ["--help"]), f"{doc.name}: kvstore {words}"
        options = {o for action in parser._actions for o in action.option_strings}
        for i, word in enumerate(words):
            if word.startswith("--"):
                assert word.split("=")[0] in options, f"{doc.name}: `{' '.join(chain)}` has no {word}"
            if i and words[i - 1] == "--set":
                assert word.split("=")[0] in settings, f"{doc.name}: --set {word}: no such setting"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_setting_the_docs_name_exists(doc: Path) -> None:
    settings = {k.name for k in knobs()}
    named = set()
    for span in _code_spans(doc.read_text()):
        match = re.fullmatch(rf"((?:{'|'.join(SECTIONS)})\.[a-z_]+)(=.*)?", span)
        if match and not span.endswith(FILE_SUFFIXES):
            named.add(match.group(1))
    assert not named - settings, f"{doc.name} names settings the code does not have"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_file_the_docs_name_exists(doc: Path) -> None:
    text = doc.read_text()
    mentioned = set(
        re.findall(r"(?<![\w./<$-])((?:[\w.-]+/)+[\w.-]+\.(?:md|py|sh|c|h|toml|proto|ya?ml|json))\b", text)
    )
    mentioned |= set(re.findall(r"(?<![\w/.-])([A-Z]+\.md)\b", text))
    mentioned |= {"LICENSE"} if "(LICENSE)" in text else set()
    missing = sorted(p for p in mentioned if not (ROOT / p).exists() and not p.startswith(("/", "~")))
    assert not missing, f"{doc.name} names files that are not in the repository: {missing}"


def test_the_readme_opens_with_the_two_commands_a_newcomer_runs() -> None:
    head = (ROOT / "README.md").read_text().split("```", 2)[1]
    assert "./scripts/demo.sh" in head and "./scripts/test.sh" in head
    assert (ROOT / "scripts" / "demo.sh").exists() and (ROOT / "scripts" / "test.sh").exists()


@pytest.mark.parametrize(
    ("flag", "module_key", "class_key"),
    [
        ("--kv-transfer-config", "kv_connector_module_path", "kv_connector"),
        ("--hicache-storage-backend-extra-config", "module_path", "class_name"),
    ],
)
def test_the_readme_engine_lines_load_our_plugin_with_json_the_engine_can_parse(
    flag: str, module_key: str, class_key: str
) -> None:
    command = next(c for c in _shell_commands((ROOT / "README.md").read_text()) if flag in c)
    words = shlex.split(command)
    config = json.loads(words[words.index(flag) + 1])
    module = ROOT / (config[module_key].replace(".", "/") + ".py")
    assert f"class {config[class_key]}(" in module.read_text()
    address = config.get("address") or config["kv_connector_extra_config"]["address"]
    data_dir = next(w for w in _shell_commands((ROOT / "README.md").read_text()) if "--data-dir" in w)
    assert (
        address
        == f"unix://{shlex.split(data_dir)[shlex.split(data_dir).index('--data-dir') + 1]}/kvstore.sock"
    )

"""Each setting is declared once: a component takes its settings section as its config, as it is.

The sections are the components' own frozen dataclasses (``tiers.dram.DramConfig`` is ``[dram]``);
the builder hands each one over whole, so no field is copied, dropped or given a second default
on the way. A dataclass elsewhere that declares several fields of a section is such a second
declaration (as ``HbmConfig`` once held a 1 GiB default beside ``HbmSettings``' 4 GiB), and fails
here. And the sidecar with its defaults touches no GPU: nothing loads torch or CUDA unless the
hbm tier is on (docs/settings.md, ``dram.pin_with_cuda``).
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from benchmarks.server_process import ServerProcess
from kvstore.errors import InvalidArgument
from kvstore.server.builder import build_remote, build_tiers
from kvstore.server.config import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvstore", "tiers", "engine_plugin")  # production code; tests and benchmarks make their own
SHADOW_FIELDS = 3  # this many of a section's field names in one other dataclass: a second declaration


def sections() -> dict[str, type]:
    hints = typing.get_type_hints(Settings)
    return {
        f.name: hints[f.name] for f in dataclasses.fields(Settings) if dataclasses.is_dataclass(hints[f.name])
    }


def dataclass_fields() -> dict[str, set[str]]:
    """``path:Class`` -> the annotated fields of every dataclass in the production packages."""
    out: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef):
                    continue
                decorators = [ast.unparse(d) for d in node.decorator_list]
                if not any(d.split("(")[0].endswith("dataclass") for d in decorators):
                    continue
                names = {
                    n.target.id
                    for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                }
                out[f"{path.relative_to(ROOT)}:{node.name}"] = names
    return out


def test_no_dataclass_declares_a_section_a_second_time() -> None:
    declared = {cls.__name__ for cls in sections().values()} | {"Settings"}
    shadows = []
    for where, names in dataclass_fields().items():
        if where.rsplit(":", 1)[1] in declared:
            continue
        for section, cls in sections().items():
            shared = names & {f.name for f in dataclasses.fields(cls)}
            if len(shared) >= SHADOW_FIELDS:
                shadows.append(f"{where} declares [{section}]'s {', '.join(sorted(shared))}")
    assert not shadows, "take the section itself (or a field of it) instead:\n" + "\n".join(shadows)


def test_the_builder_hands_each_tier_its_section_whole(tmp_path: Path) -> None:
    """Not a copy: the very object parsed, so every field a user sets reaches the tier."""
    settings = load_settings(
        env={},
        overrides={
            "data_dir": str(tmp_path),
            "dram.capacity_bytes": "8MiB",
            "dram.page_bytes": "1MiB",
            "dram.prefault": "false",
            "dram.throttle_bytes_per_s": "0",
            "hbm.enabled": "true",
            "hbm.device": "cpu",  # the hbm tier's logic on a CPU pool: no GPU needed
            "hbm.capacity_bytes": "4MiB",
            "hbm.page_bytes": "1MiB",
            "nvme.capacity_bytes": "16MiB",
            "remote.backend": "kvstore",
            "remote.nodes": "127.0.0.1:9",  # nothing is contacted while building
            "remote.timeout_s": "250ms",
        },
    )
    tiers, _ = build_tiers(settings)
    try:
        by_name = {t.name: t for t in tiers}
        assert by_name["hbm"].config is settings.hbm  # type: ignore[attr-defined]
        assert by_name["dram"].config is settings.dram  # type: ignore[attr-defined]
        # the one field resolved at start: the folder, under data_dir
        nvme = dataclasses.replace(settings.nvme, path=str(settings.nvme_path))
        assert by_name["nvme"].config == nvme  # type: ignore[attr-defined]
    finally:
        for tier in tiers:
            tier.close()
    remote = build_remote(settings)
    assert remote is not None
    try:
        assert remote.config is settings.remote  # type: ignore[attr-defined]
    finally:
        remote.close()


def test_a_section_checks_itself_once_whatever_the_source(tmp_path: Path) -> None:
    """Two variables that only make sense together are checked together, after every source."""
    env = {"KVSTORE_DRAM_CAPACITY_BYTES": "16MiB", "KVSTORE_DRAM_PAGE_BYTES": "1MiB"}
    assert load_settings(env=env).dram.capacity_bytes == 16 << 20
    with pytest.raises(InvalidArgument, match="smaller than one page"):
        load_settings(env={"KVSTORE_DRAM_CAPACITY_BYTES": "16MiB"})
    with pytest.raises(InvalidArgument, match=r"remote\.timeout_s must be positive"):
        load_settings(env={}, overrides={"remote.timeout_s": "0"})


def _gpu_libraries(pid: int) -> list[str]:
    """The files of torch and of the CUDA driver and runtime mapped into process ``pid``."""
    mapped = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/" in line}
    return sorted(p for p in mapped if "/torch/" in p or "libcuda" in p or "libcudart" in p)


def test_the_sidecar_with_its_defaults_loads_no_torch_and_no_cuda() -> None:
    """Registering the arena with CUDA opened a context on GPU 0 at every start (the engine's
    memory, ~1 s per 4 GiB) for an hbm tier that is off by default. With the defaults the server
    never reaches that code: it does not even load torch, which this asserts on any machine."""
    server = ServerProcess({"dram.capacity_bytes": "32MiB", "nvme.capacity_bytes": "32MiB"})
    try:
        assert _gpu_libraries(server.pid) == []
    finally:
        server.stop()


@pytest.mark.gpu
def test_on_a_gpu_the_arena_is_pinned_only_for_the_hbm_tier(tmp_path: Path) -> None:
    base = {"data_dir": str(tmp_path), "dram.capacity_bytes": "64MiB", "dram.prefault": "false"}
    for hbm, pinned in (("false", False), ("true", True)):
        settings = load_settings(
            env={}, overrides={**base, "hbm.enabled": hbm, "hbm.capacity_bytes": "64MiB"}
        )
        tiers, _ = build_tiers(settings)
        try:
            dram = next(t for t in tiers if t.name == "dram")
            assert dram.pinned is pinned  # type: ignore[attr-defined]
        finally:
            for tier in tiers:
                tier.close()

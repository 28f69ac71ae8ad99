"""Settings: defaults, TOML, environment and flags, in that order of precedence."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.server.config import GiB, MiB, Settings, load_settings, parse_size
from tiers import Codec


def test_defaults_make_a_useful_sidecar() -> None:
    s = load_settings(env={})
    assert s.dram.capacity_bytes == 1 * GiB
    assert s.nvme.enabled and s.nvme.durability == "cache"
    assert not s.hbm.enabled
    assert s.nvme_path == Path(s.data_dir) / "nvme"


def test_sizes_parse_with_units() -> None:
    assert parse_size("4GiB") == 4 * GiB
    assert parse_size("512 MiB") == 512 * MiB
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("1234") == 1234
    with pytest.raises(InvalidArgument):
        parse_size("lots")


def test_flags_beat_environment_beat_toml(tmp_path: Path) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text(
        'data_dir = "/srv/kv"\n'
        '[dram]\ncapacity_bytes = "2GiB"\npage_bytes = 8388608\n'
        '[nvme]\ndurability = "durable"\ncapacity_bytes = "100GiB"\n'
        '[store]\nlease_ttl_s = 7.5\n[store.quota_bytes]\ntenant-a = "1GiB"\n'
    )
    env = {"KVSTORE_DRAM_CAPACITY_BYTES": "3GiB", "KVSTORE_NVME_DURABILITY": "cache", "HOME_UNRELATED": "x"}
    s = load_settings(toml, env=env, overrides={"dram.capacity_bytes": "4GiB"})
    assert s.data_dir == "/srv/kv"
    assert s.dram.capacity_bytes == 4 * GiB  # flag
    assert s.dram.page_bytes == 8 * MiB  # toml
    assert s.nvme.durability == "cache"  # environment over toml
    assert s.nvme.capacity_bytes == 100 * GiB
    assert s.store.lease_ttl_s == 7.5
    assert s.store.quota_bytes == {"tenant-a": 1 * GiB}


def test_environment_reaches_every_section() -> None:
    s = load_settings(
        env={
            "KVSTORE_DATA_DIR": "/d",
            "KVSTORE_HBM_ENABLED": "true",
            "KVSTORE_STORE_WRITE_THROUGH": "yes",
            "KVSTORE_STORE_QUOTA_BYTES": "a=1MiB,b=2MiB",
            "KVSTORE_NVME_CODEC": "zstd-byteplane",
        }
    )
    assert s.data_dir == "/d" and s.hbm.enabled and s.store.write_through
    assert s.store.quota_bytes == {"a": MiB, "b": 2 * MiB}
    assert s.nvme.codec is Codec.ZSTD_BYTEPLANE


@pytest.mark.parametrize(
    "overrides",
    [
        {"dram.capacity": "1GiB"},  # unknown field
        {"disk.size": "1"},  # unknown section
        {"nvme.durability": "sometimes"},  # not a choice
        {"hbm.enabled": "perhaps"},
        {"store.lease_ttl_s": "soon"},
        {"dram": "big"},  # a section given a value
    ],
)
def test_bad_settings_are_refused_with_the_name(overrides: dict[str, str]) -> None:
    with pytest.raises(InvalidArgument) as info:
        load_settings(env={}, overrides=overrides)
    assert str(info.value)


def test_settings_are_frozen() -> None:
    s = Settings()
    with pytest.raises(AttributeError):
        s.data_dir = "/elsewhere"  # type: ignore[misc]


def test_durations_take_units() -> None:
    s = load_settings(
        env={"KVSTORE_STORE_LEASE_TTL_S": "250ms"},
        overrides={"server.drain_grace_s": "2m", "nvme.sync_interval_s": "1.5"},
    )
    assert s.store.lease_ttl_s == 0.25
    assert s.server.drain_grace_s == 120.0
    assert s.nvme.sync_interval_s == 1.5
    with pytest.raises(InvalidArgument, match=r"server\.drain_grace_s"):
        load_settings(env={}, overrides={"server.drain_grace_s": "10 fortnights"})


def test_variables_that_name_no_setting_are_ignored_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {
        "KVSTORE_TOKEN": "abc",  # the client commands' own
        "KVSTORE_DEMO_DIR": "/tmp/x",  # scripts/demo.sh's own
        "KVSTORE_DRAM_CAPACITY": "1GiB",  # a typo: the field is capacity_bytes
        "KVSTORE_NOSUCH": "1",
        "KVSTORE_DRAM_CAPACITY_BYTES": "2GiB",
    }
    with caplog.at_level("WARNING"):
        s = load_settings(env=env)
    assert s.dram.capacity_bytes == 2 * GiB
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "KVSTORE_DRAM_CAPACITY," in warnings[0] and "KVSTORE_NOSUCH" in warnings[0]
    assert "KVSTORE_TOKEN" not in warnings[0] and "KVSTORE_DEMO_DIR" not in warnings[0]


def test_a_bad_environment_value_names_the_setting() -> None:
    with pytest.raises(InvalidArgument, match=r"dram\.capacity_bytes"):
        load_settings(env={"KVSTORE_DRAM_CAPACITY_BYTES": "lots"})


def test_retention_is_a_table_of_durations() -> None:
    s = load_settings(
        env={},
        overrides={"store.retention_s": "tenant-a=24h,tenant-b=90m", "store.default_retention_s": "7200"},
    )
    assert s.store.retention_s == {"tenant-a": 86400.0, "tenant-b": 5400.0}
    assert s.store.default_retention_s == 7200.0


def test_the_readme_example_toml_loads(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("**An example `kvstore.toml`**", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "kvstore.toml").write_text(block)
    s = load_settings(tmp_path / "kvstore.toml", env={})
    assert s.dram.capacity_bytes == 64 * GiB and s.server.drain_grace_s == 10.0

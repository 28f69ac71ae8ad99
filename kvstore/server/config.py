"""Configuration: parsed once at the edge into frozen dataclasses, one section per component.

Sources, lowest precedence first: embedded defaults, a TOML file, ``KVSTORE_*`` environment
variables, then command-line overrides (``section.field=value``). Every knob is a field of one
section below; an unknown section or field is an error, never silently ignored.

    [store]   StoreConfig (placement, leases, quotas)      KVSTORE_STORE_LEASE_TTL_S=10
    [dram]    tiers.dram.DramConfig (arena size, page size) KVSTORE_DRAM_CAPACITY_BYTES=8GiB
    [nvme]    tiers.nvme_config.NvmeConfig (LMDB folder, size) KVSTORE_NVME_DURABILITY=durable
    [hbm]     tiers.hbm.HbmConfig (GPU pool; off unless on) KVSTORE_HBM_ENABLED=true
    [server]  ServerSettings (listeners, tenants, metrics) KVSTORE_SERVER_TCP_ADDRESS=127.0.0.1:7070
    [remote]  tiers.remote.RemoteConfig (the shared tier)  KVSTORE_REMOTE_BACKEND=redis
    [events]  EventsSettings (vLLM-format KV events, ZMQ)   KVSTORE_EVENTS_PUBLISH_ADDRESS=tcp://127.0.0.1:5557
    data_dir  the folder persistent tiers live under       KVSTORE_DATA_DIR=/var/lib/kvstore

Sizes accept plain integers or units (``512MiB``, ``4GiB``, ``1.5GB``); durations (fields
ending in ``_s``) plain seconds or units (``250ms``, ``10s``, ``5m``, ``1h``). A ``KVSTORE_*``
variable that names no setting is reported in one warning and ignored (``KVSTORE_TOKEN`` and
``KVSTORE_ADDRESS`` belong to the client commands); a bad value is an error naming the setting.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvstore.address import parse_address
from kvstore.errors import InvalidArgument
from kvstore.store import StoreConfig
from tiers.dram import DramConfig
from tiers.hbm import HbmConfig
from tiers.nvme_config import NvmeConfig
from tiers.remote import RemoteConfig

GiB = 1 << 30
MiB = 1 << 20
log = logging.getLogger(__name__)
# Read by the client commands (stats, invalidate, demote) and scripts/demo.sh: not settings.
CLIENT_VARIABLES = frozenset(
    {
        "KVSTORE_TOKEN",
        "KVSTORE_ADDRESS",
        "KVSTORE_DEMO_DIR",
        "KVSTORE_TLS_CA",
        "KVSTORE_TLS_CERT",
        "KVSTORE_TLS_KEY",
    }
)


@dataclass(frozen=True)
class ServerSettings:
    """Listeners, tenants and their limits, TLS, the audit log and the metrics endpoint."""

    socket_path: str = ""  # default: <data_dir>/kvstore.sock, mode 0600
    tcp_address: str = ""  # host:port for the shared store; empty: no TCP listener
    data_address: str = "auto"  # raw data port: "auto" = tcp_address's host, any port; "" = off
    data_socket_path: str = "auto"  # its Unix twin: "auto" = <data_dir>/kvstore-data.sock; "" = off
    tokens: Mapping[str, str] = field(default_factory=dict)  # bearer token -> tenant
    tokens_file: str = ""  # lines "TOKEN=TENANT"; must not be readable by group or others
    # Every delete, invalidation, demotion and shred, fsynced before it takes effect (read it with
    # kvstore audit); "auto": <data_dir>/audit.log; "": off
    audit_log: str = "auto"
    tls_cert_file: str = ""  # PEM; with tls_key_file: TLS on every TCP listener
    tls_key_file: str = ""  # PEM private key of tls_cert_file
    tls_client_ca_file: str = ""  # PEM CA: clients must present a certificate it signed (mTLS)
    unix_tenant: str = "local"  # tenant of Unix-socket callers without a token
    admins: tuple[str, ...] = ("local",)  # tenants that may invalidate other tenants' blocks
    shared_scopes: Mapping[str, str] = field(default_factory=dict)  # scope -> "tenant-a,tenant-b"
    # Prometheus /metrics, with /healthz and /readyz for probes; "auto": 127.0.0.1:9464, or a free
    # port (logged, and listed by kvstore stats) when another server has 9464; "": off
    metrics_address: str = "auto"
    max_message_bytes: int = 64 * MiB  # largest gRPC message accepted
    drain_grace_s: float = 10.0  # how long in-flight requests get on SIGTERM
    workers: int = 16  # gRPC worker threads
    # One tenant's requests in flight at once; beyond: RESOURCE_EXHAUSTED (no tenant holds every worker)
    max_requests_per_tenant: int = 8
    stream_timeout_s: float = 60.0  # a Get or Put stream still open after this is cut (DEADLINE_EXCEEDED)
    data_spin_s: float = 0.002  # a same-host write between chunks: poll this long before sleeping; 0 = off


@dataclass(frozen=True)
class EventsSettings:
    # ZMQ PUB endpoint the sidecar binds to publish vLLM-format KV cache events of what it holds
    # (docs/events.md), e.g. tcp://127.0.0.1:5557 or ipc:///run/kvstore/events; "": off
    publish_address: str = ""
    topic: str = ""  # first frame of every message (vLLM's kv_events_config.topic); "" = vLLM's default
    max_queued: int = 65536  # store changes waiting for the publisher; beyond: dropped, counted
    send_hwm: int = 100_000  # batches ZMQ buffers per slow subscriber before it drops them


@dataclass(frozen=True)
class Settings:
    # The folder of the persistent tiers, the sockets, the lock (one server per folder) and models.json;
    # default: $XDG_DATA_HOME/kvstore, else ~/.local/share/kvstore
    data_dir: str = field(default_factory=lambda: default_data_dir())
    store: StoreConfig = field(default_factory=StoreConfig)
    dram: DramConfig = field(default_factory=DramConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    hbm: HbmConfig = field(default_factory=HbmConfig)
    server: ServerSettings = field(default_factory=ServerSettings)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    events: EventsSettings = field(default_factory=EventsSettings)

    @property
    def nvme_path(self) -> Path:
        return Path(self.nvme.path) if self.nvme.path else Path(self.data_dir) / "nvme"

    @property
    def socket_path(self) -> Path:
        return (
            Path(self.server.socket_path) if self.server.socket_path else Path(self.data_dir) / "kvstore.sock"
        )


_SECTIONS = ("store", "dram", "nvme", "hbm", "server", "remote", "events")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
_DURATIONS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0}


def enum_name(member: enum.Enum) -> str:
    """How a setting names an enum's member: ``Codec.ZSTD_BYTEPLANE`` is ``zstd-byteplane``."""
    return member.name.lower().replace("_", "-")


def default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "kvstore")


def parse_size(text: str | int, setting: str = "") -> int:
    """``4GiB`` -> 4294967296. Integers pass through."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        where = f"{setting}: " if setting else ""
        raise InvalidArgument(f"{where}not a size: {text!r} (use bytes or units like 512MiB, 4GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_duration(text: str | float, setting: str = "") -> float:
    """``250ms`` -> 0.25, ``5m`` -> 300.0; numbers are seconds. ``inf`` is not a duration."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _DURATIONS:
        where = f"{setting}: " if setting else ""
        raise InvalidArgument(f"{where}not a duration: {text!r} (use seconds or units like 250ms, 10s, 5m)")
    return float(match.group(1)) * _DURATIONS[match.group(2).lower()]


def load_settings(
    toml_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
) -> Settings:
    """Merge the sources in precedence order into one ``Settings``."""
    raw: dict[str, Any] = {}
    if toml_path is not None:
        _merge(raw, _read_toml(Path(toml_path)))
    from_env, ignored = _from_env(os.environ if env is None else env)
    if ignored:
        log.warning(
            "ignoring %s: no such setting (variables are KVSTORE_<SECTION>_<FIELD>, e.g. "
            "KVSTORE_DRAM_CAPACITY_BYTES)",
            ", ".join(sorted(ignored)),
        )
    _merge(raw, from_env)
    for dotted, value in (overrides or {}).items():
        _merge(raw, _nest(dotted, value))
    settings = _build(Settings, raw, "")
    _check(settings)
    return settings


def _check(settings: Settings) -> None:
    """What the parser of one field cannot check: listeners and nodes are host:port with a port
    that exists. Here, at parse time, so a mistake is one line at start rather than a traceback
    from the component that meets it. What a section can check alone, it checks itself (its
    ``__post_init__``: one validation per knob, with its declaration)."""
    s = settings.server
    listeners = {"server.tcp_address": s.tcp_address}
    listeners["server.metrics_address"] = "" if s.metrics_address == "auto" else s.metrics_address
    listeners["server.data_address"] = "" if s.data_address == "auto" else s.data_address
    for setting, address in listeners.items():
        if address:
            _check_address(address, setting, listener=True)
    events = settings.events.publish_address
    if events and not events.startswith(("tcp://", "ipc://")):
        raise InvalidArgument(f"events.publish_address is tcp://host:port or ipc:///path, not {events!r}")


def _check_address(address: str, setting: str, listener: bool) -> None:
    """The address parses as the server and its clients will parse it (``kvstore.address``)."""
    try:
        parse_address(address, setting, listener=listener)
    except InvalidArgument:
        raise InvalidArgument(
            f"{setting}: {address!r} is not HOST:PORT with a port from {0 if listener else 1} to 65535"
        ) from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise InvalidArgument(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise InvalidArgument(f"config file {path} is a folder, not a TOML file") from None
    except PermissionError:
        raise InvalidArgument(f"config file {path} is not readable by this user") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"config file {path} is not valid TOML: {exc}") from None


def _from_env(env: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The settings named by ``KVSTORE_*`` variables, and the variables that name none."""
    out: dict[str, Any] = {}
    ignored: list[str] = []
    top_level = {f.name for f in dataclasses.fields(Settings)} - set(_SECTIONS)
    for name, value in env.items():
        if not name.startswith("KVSTORE_") or name in CLIENT_VARIABLES:
            continue
        rest = name[len("KVSTORE_") :].lower()
        section = next((s for s in _SECTIONS if rest.startswith(s + "_")), None)
        hints = typing.get_type_hints(Settings)
        if section is not None:
            rest = rest[len(section) + 1 :]
            hints = typing.get_type_hints(hints[section])
        if rest not in hints or (section is None and rest not in top_level):
            ignored.append(name)
            continue
        dotted = f"{section}.{rest}" if section else rest
        # The value alone first, so a bad one is reported under the variable that holds it; what
        # a section checks across its fields waits for the other sources
        try:
            _coerce(hints[rest], value, dotted)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{name}: {exc}") from None
        _merge(out, _nest(dotted, value))
    return out, ignored


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    parts = dotted.split(".")
    out: dict[str, Any] = {parts[-1]: value}
    for part in reversed(parts[:-1]):
        out = {part: out}
    return out


def _merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for k, v in new.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = dict(v) if isinstance(v, Mapping) else v


T = typing.TypeVar("T")


def _build(cls: type[T], raw: Mapping[str, Any], where: str) -> T:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(raw) - known
    if unknown:
        raise InvalidArgument(
            f"unknown setting {where}{sorted(unknown)[0]}; known: {', '.join(sorted(known))}"
        )
    kwargs = {name: _coerce(hints[name], value, f"{where}{name}") for name, value in raw.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad settings in [{where.rstrip('.') or 'top'}]: {exc}") from exc


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise InvalidArgument(f"{where} is a section, not a value")
        return _build(hint, value, where + ".")  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        return _coerce(args[0], value, where)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise InvalidArgument(f"{where} must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if isinstance(hint, type) and issubclass(
        hint, enum.Enum
    ):  # by name: Codec.ZSTD_BYTEPLANE is zstd-byteplane
        if isinstance(value, hint):
            return value
        named = {enum_name(member): member for member in hint}
        if str(value) not in named:
            raise InvalidArgument(f"{where} must be one of {', '.join(named)}, got {value!r}")
        return named[str(value)]
    if origin in (Mapping, dict) or hint in (Mapping, dict) or origin is typing.Mapping:
        if isinstance(value, str):
            items = [item for item in value.split(",") if item]
            bad = next((i for i, item in enumerate(items, 1) if "=" not in item), None)
            if bad is not None:  # by position: the item may be a token, not to be echoed
                raise InvalidArgument(
                    f"{where}: item {bad} has no '=' (a comma-separated list of NAME=VALUE)"
                )
            value = dict(item.split("=", 1) for item in items)
        if not isinstance(value, Mapping):
            raise InvalidArgument(f"{where} must be a table of name = value")
        value_type = typing.get_args(hint)[1] if typing.get_args(hint) else str
        return {str(k): _coerce(value_type, v, f"{where}.{k}") for k, v in value.items()}
    if origin is tuple:
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise InvalidArgument(f"{where} must be a list")
        return tuple(_coerce(typing.get_args(hint)[0], v, where) for v in items)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise InvalidArgument(f"{where} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise InvalidArgument(f"{where} must be an integer")
        number = parse_size(value, where) if "_bytes" in where else _int(value, where)
        if number < 0 and "_bytes" in where:
            raise InvalidArgument(f"{where} must not be negative, got {value!r}")
        return number
    if hint is float:
        if where.endswith("_s") or "_s." in where:  # a duration, or a table of them
            seconds = parse_duration(value, where)
            if seconds < 0:
                raise InvalidArgument(f"{where} must not be negative, got {value!r}")
            return seconds
        try:
            return float(value)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"{where} must be a number, got {value!r}") from exc
    if hint is str:
        return str(value)
    return value


def _int(value: Any, where: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{where} must be an integer, got {value!r}") from exc

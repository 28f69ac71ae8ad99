"""What the ``kvstore`` subcommands share: the parent parsers of their common flags, the
settings they load, the client they connect, and how they print sizes and durations."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvstore.address import Address, UnixAddress, parse_address
from kvstore.errors import InvalidArgument
from kvstore.server.config import Settings, load_settings


def common_parser() -> argparse.ArgumentParser:
    """``--config``, ``--set``, ``--data-dir``, ``-v``: every subcommand that reads settings."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML configuration file")
    common.add_argument("--set", metavar="SECTION.FIELD=VALUE", action="append", help="override one setting")
    common.add_argument(
        "--data-dir", metavar="DIR", help="folder for the persistent tiers (overrides data_dir)"
    )
    common.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    return common


def remote_parser() -> argparse.ArgumentParser:
    """Where a running server is and how to reach it: every subcommand that calls one."""
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument(
        "--address",
        help="server address: unix:///path or host:port (default: $KVSTORE_ADDRESS, else the "
        "socket under the data folder)",
    )
    remote.add_argument("--token", help="bearer token (default: $KVSTORE_TOKEN)")
    remote.add_argument("--tls-ca", metavar="PEM", help="CA of a TLS server's certificate ($KVSTORE_TLS_CA)")
    remote.add_argument(
        "--tls-cert", metavar="PEM", help="client certificate for mutual TLS ($KVSTORE_TLS_CERT)"
    )
    remote.add_argument("--tls-key", metavar="PEM", help="its key ($KVSTORE_TLS_KEY)")
    return remote


def overrides(args: argparse.Namespace) -> dict[str, str]:
    """The ``--set`` and ``--data-dir`` flags as the loader's overrides."""
    out: dict[str, str] = {}
    for item in args.set or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgument(f"--set takes section.field=value, got {item!r}")
        out[name.strip()] = value.strip()
    if getattr(args, "data_dir", None):
        out["data_dir"] = args.data_dir
    return out


def settings(args: argparse.Namespace) -> Settings:
    return load_settings(args.config, overrides=overrides(args))


def address(args: argparse.Namespace) -> Address:
    """The server's address: --address, else $KVSTORE_ADDRESS, else this host's socket."""
    if args.address:
        return parse_address(str(args.address), "--address")
    if text := os.environ.get("KVSTORE_ADDRESS"):
        return parse_address(text, "KVSTORE_ADDRESS")
    return UnixAddress(str(settings(args).socket_path.absolute()))


def client(args: argparse.Namespace) -> Any:
    """A client of the server the flags name; the address tried is kept in
    ``args.tried_address`` for the line that says it cannot be reached."""
    from kvstore.client import connect

    args.tried_address = address(args)
    return connect(
        args.tried_address, token=token(args), timeout_s=10.0, tls=client_tls(args, args.tried_address)
    )


def token(args: argparse.Namespace) -> str | None:
    return str(args.token) if args.token else os.environ.get("KVSTORE_TOKEN")


def client_tls(args: argparse.Namespace, address: Address) -> Any:
    """The client's TLS for ``address`` from the flags or their variables; None on a Unix socket
    or without a CA or certificate."""
    from kvstore.tls import ClientTls

    ca = args.tls_ca or os.environ.get("KVSTORE_TLS_CA", "")
    cert = args.tls_cert or os.environ.get("KVSTORE_TLS_CERT", "")
    key = args.tls_key or os.environ.get("KVSTORE_TLS_KEY", "")
    return ClientTls(ca, cert, key) if (ca or cert) and not address.same_host else None


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def duration(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"

"""The ``kvstore`` console script: one dispatcher, one subcommand per job.

    kvstore serve                  the service: Unix socket sidecar, optional TCP shared store
    kvstore stats                  a running server's tiers, counters, connections (stats_cmd)
    kvstore invalidate             the kill switch: a fingerprint's blocks, or everything (admin_cmds)
    kvstore demote                 move blocks out of a tier into the next one (nothing dropped)
    kvstore shred --tenant T       crypto-shred a tenant now: its key file and every copy (admins)
    kvstore audit                  the audit log's records, torn or damaged lines skipped
    kvstore config                 every setting's effective value and its source (config_cmd)
    kvstore demo                   end-to-end demonstration of the store on this machine
    kvstore bench tiers [--quick]  per-tier throughput against memcpy and raw LMDB
    kvstore bench device [--quick] copies between the tiers and a GPU against torch's pinned copies
    kvstore bench service          data planes against raw TCP and memcpy, lookup latency, peers;
                                   --address ADDR: a running deployment instead (bench_cmds)
    kvstore bench crash            kill -9 under load: acknowledged blocks served after restart
    kvstore bench calibrate        prefill curve and tier restore costs -> the connector's calibration
    kvstore bench decisions        the connector's plan against all-restore and all-recompute
    kvstore bench replay           a trace through vLLM alone, with kvstore, and with other connectors

Every subcommand takes ``--config FILE`` (TOML) and ``--set section.field=value`` overrides;
``KVSTORE_*`` environment variables sit between the two (see ``kvstore.server.config``). Every
command that reports takes ``--json``. Benchmarks are imported lazily: only the CLI
(``bench_cmds``) reaches up into ``benchmarks/``.

An operator's mistake (a bad setting, a port in use, a server that is not running) ends with
one line on stderr saying what is wrong and what to do, and exit status 2; ``-v`` adds the
traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvstore import __version__
from kvstore.address import Address, UnixAddress
from kvstore.cli import admin_cmds, bench_cmds, config_cmd, stats_cmd
from kvstore.cli.common import common_parser, remote_parser, settings
from kvstore.errors import InvalidArgument, KvStoreError, Unavailable
from kvstore.extras import install_hint

log = logging.getLogger("kvstore.cli")


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.server.serve import serve

    overrides = []
    if args.tcp:
        overrides.append(f"server.tcp_address={args.tcp}")
    if args.socket:
        overrides.append(f"server.socket_path={args.socket}")
    args.set = (args.set or []) + overrides
    return serve(settings(args))


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.service:
        from kvstore.cli.demo_service import run_service_demo

        run_service_demo(args.service, args.tcp, args.token or os.environ.get("KVSTORE_TOKEN", ""))
        return 0
    from kvstore.cli.demo import run_demo

    run_demo(settings(args))
    return 0


def _cmd_route(args: argparse.Namespace) -> int:
    from kvstore.cli.route import read_keys_file, read_salt_secret, serve_router
    from kvstore.routing.http import FrontSettings
    from kvstore.tls import ServerTls

    if bool(args.tls_cert) != bool(args.tls_key):
        raise InvalidArgument("--tls-cert and --tls-key go together")

    try:
        return serve_router(
            args.backend,
            args.sidecar,
            Path(args.model),
            args.policy,
            args.listen,
            args.block_size,
            calibration=args.calibration,
            slack=args.slack,
            queue_penalty_s=args.queue_penalty_s,
            model_id=args.model_id,
            token=os.environ.get("KVSTORE_TOKEN"),
            prefix_tokens=args.prefix_tokens,
            sidecar_events=args.sidecar_events,
            front=FrontSettings(
                keys=read_keys_file(args.keys_file) if args.keys_file else {},
                ops_tenants=frozenset(args.ops_tenant),
                ops_loopback=args.ops_loopback,
                backend_key=os.environ.get("KVSTORE_BACKEND_KEY", ""),
                salt_secret=read_salt_secret(args.salt_secret_file, os.environ),
                header_timeout_s=args.header_timeout_s,
                body_timeout_s=args.body_timeout_s,
                max_body_bytes=args.max_body_bytes,
                connect_timeout_s=args.connect_timeout_s,
                upstream_timeout_s=args.upstream_timeout_s,
                probe_interval_s=args.probe_interval_s,
            ),
            tls=ServerTls(args.tls_cert, args.tls_key) if args.tls_cert else None,
        )
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    common = common_parser()

    parser = argparse.ArgumentParser(
        prog="kvstore", description="Tiered KV-cache offload storage for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    remote = remote_parser()

    serve = sub.add_parser("serve", parents=[common], help="run the service")
    serve.add_argument("--tcp", metavar="HOST:PORT", help="also listen on TCP (server.tcp_address)")
    serve.add_argument("--socket", metavar="PATH", help="Unix socket path (server.socket_path)")
    serve.set_defaults(func=_cmd_serve)

    stats_cmd.add_parser(sub, common, remote)
    admin_cmds.add_parsers(sub, common, remote)
    config_cmd.add_parser(sub, common)

    demo = sub.add_parser("demo", parents=[common], help="end-to-end demonstration of the store")
    demo.add_argument(
        "--service", metavar="UNIX_ADDRESS", help="run against a live server's Unix socket instead"
    )
    demo.add_argument("--tcp", metavar="HOST:PORT", help="with --service: the server's TCP listener")
    demo.add_argument("--token", help="with --service: the bearer token for --tcp")
    demo.set_defaults(func=_cmd_demo)

    route = sub.add_parser(
        "route", help="an OpenAI-compatible, cache-aware router in front of engine replicas"
    )
    route.add_argument("--backend", metavar="URL", action="append", default=[], help="a replica (repeat)")
    route.add_argument(
        "--sidecar", metavar="ADDRESS", action="append", default=[], help="its sidecar, in --backend order"
    )
    route.add_argument(
        "--sidecar-events",
        metavar="ENDPOINT",
        action="append",
        default=[],
        help="its sidecar's KV event feed (events.publish_address), in --sidecar order: "
        "follow the feeds instead of a lookup per prompt",
    )
    route.add_argument(
        "--model", metavar="DIR", required=True, help="the model's local folder (its tokenizer)"
    )
    route.add_argument("--policy", default="cost", help="cost (default), rendezvous, hash or round-robin")
    route.add_argument(
        "--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="default 127.0.0.1:8000"
    )
    route.add_argument("--block-size", type=int, default=16, help="the engines' tokens per KV block (16)")
    route.add_argument("--calibration", default="", metavar="FILE", help="kvstore bench calibrate's file")
    route.add_argument(
        "--slack",
        type=float,
        default=1.25,
        help="load bound: a replica holds at most slack x the mean in flight, rounded down, and at "
        "least the least-loaded replica's load plus one (1.25)",
    )
    route.add_argument("--queue-penalty-s", type=float, default=0.05, help="cost of one request ahead (0.05)")
    route.add_argument("--model-id", default="", help="which registered model to key prompts for")
    route.add_argument(
        "--prefix-tokens", type=int, default=256, help="the head a prompt is keyed by, in tokens (256)"
    )
    route.add_argument(
        "--keys-file",
        metavar="FILE",
        help="API keys, KEY=TENANT lines, mode 0600 (none: one anonymous tenant)",
    )
    route.add_argument(
        "--salt-secret-file",
        metavar="FILE",
        default="",
        help="keys each tenant's cache salt, mode 0600, the same on every router of the fleet "
        "(or $KVSTORE_ROUTE_SALT_SECRET); required with --keys-file",
    )
    route.add_argument(
        "--ops-tenant", metavar="TENANT", action="append", default=[], help="its keys open /metrics, /health"
    )
    route.add_argument("--ops-loopback", action="store_true", help="/metrics and /health open to loopback")
    route.add_argument("--tls-cert", metavar="PEM", default="", help="TLS on the listener: its certificate")
    route.add_argument("--tls-key", metavar="PEM", default="", help="and its key")
    route.add_argument("--header-timeout-s", type=float, default=15.0, help="a request's head (15)")
    route.add_argument("--body-timeout-s", type=float, default=30.0, help="a request's body (30)")
    route.add_argument("--max-body-bytes", type=int, default=16 << 20, help="larger bodies: 413 (16 MiB)")
    route.add_argument("--connect-timeout-s", type=float, default=5.0, help="to a replica (5)")
    route.add_argument("--upstream-timeout-s", type=float, default=600.0, help="a replica's answer (600)")
    route.add_argument("--probe-interval-s", type=float, default=2.0, help="replicas' /health (2)")
    route.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    route.set_defaults(func=_cmd_route)

    bench_cmds.add_parsers(sub, common, remote)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO if args.command == "serve" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.func(args)
    except Unavailable as exc:
        if getattr(args, "tried_address", None):
            return _fail(
                args,
                exc,
                f"cannot reach a kvstore server at {args.tried_address} "
                f"({_why_unreachable(args.tried_address, exc)}); "
                "is `kvstore serve` running there? (--address, or $KVSTORE_ADDRESS, names another)",
            )
        return _fail(args, exc, str(exc))
    except KvStoreError as exc:
        return _fail(args, exc, str(exc))
    except ModuleNotFoundError as exc:  # an optional feature's library: the extra to install
        hint = install_hint(exc.name or "")
        if hint is None:
            raise
        return _fail(args, exc, hint)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader stopped early (`| head`): end quietly, as rich does for its tables. stdout
        # goes to /dev/null so that the interpreter's flush at exit does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


def _fail(args: argparse.Namespace, exc: BaseException, line: str) -> int:
    if args.verbose:
        log.error("traceback", exc_info=exc)
    print(f"kvstore {args.command}: {line}", file=sys.stderr)
    return 2


def _why_unreachable(address: Address, exc: BaseException) -> str:
    if isinstance(address, UnixAddress) and not os.path.exists(address.path):
        return f"no socket at {address.path}"
    text = str(exc)
    for reason in ("Connection refused", "Permission denied", "deadline exceeded", "Deadline Exceeded"):
        if reason in text:
            return reason.lower()
    return text.strip().splitlines()[0][:160] if text.strip() else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())

"""The ``kvstore`` console script: one dispatcher, one subcommand per job.

    kvstore serve                  the service: Unix socket sidecar, optional TCP shared store
    kvstore stats                  a running server's tiers and counters (table or --json)
    kvstore invalidate             the kill switch: a fingerprint's blocks, or everything
    kvstore demote                 move blocks out of a tier into the next one (nothing dropped)
    kvstore shred --tenant T       crypto-shred a tenant now: its key file and every copy (admins)
    kvstore audit                  the audit log's records, torn or damaged lines skipped
    kvstore demo                   end-to-end demonstration of the store on this machine
    kvstore bench tiers [--quick]  per-tier throughput against memcpy and raw LMDB
    kvstore bench device [--quick] copies between the tiers and a GPU against torch's pinned copies
    kvstore bench service          data planes against raw TCP and memcpy, lookup latency, peers
    kvstore bench crash            kill -9 under load: acknowledged blocks served after restart
    kvstore bench calibrate        prefill curve and tier restore costs -> the connector's calibration
    kvstore bench decisions        the connector's plan against all-restore and all-recompute
    kvstore bench replay           a trace through vLLM alone, with kvstore, and with other connectors

Every subcommand takes ``--config FILE`` (TOML) and ``--set section.field=value`` overrides;
``KVSTORE_*`` environment variables sit between the two (see ``kvstore.server.config``). Benchmarks
are imported lazily: only this dispatcher reaches up into ``benchmarks/``.

An operator's mistake (a bad setting, a port in use, a server that is not running) ends with
one line on stderr saying what is wrong and what to do, and exit status 2; ``-v`` adds the
traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore import __version__
from kvstore.errors import InvalidArgument, KvStoreError, Unavailable
from kvstore.extras import install_hint
from kvstore.server.config import Settings, load_settings

log = logging.getLogger("kvstore.cli")


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, str] = {}
    for item in args.set or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgument(f"--set takes section.field=value, got {item!r}")
        overrides[name.strip()] = value.strip()
    if args.data_dir:
        overrides["data_dir"] = args.data_dir
    return load_settings(args.config, overrides=overrides)


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.server.serve import serve

    overrides = []
    if args.tcp:
        overrides.append(f"server.tcp_address={args.tcp}")
    if args.socket:
        overrides.append(f"server.socket_path={args.socket}")
    args.set = (args.set or []) + overrides
    return serve(_settings(args))


def _client(args: argparse.Namespace) -> Any:
    from kvstore.client import connect
    from kvstore.tls import ClientTls

    args.tried_address = _address(args)
    ca = args.tls_ca or os.environ.get("KVSTORE_TLS_CA", "")
    cert = args.tls_cert or os.environ.get("KVSTORE_TLS_CERT", "")
    key = args.tls_key or os.environ.get("KVSTORE_TLS_KEY", "")
    tls = ClientTls(ca, cert, key) if (ca or cert) and not args.tried_address.startswith("unix:") else None
    token = args.token or os.environ.get("KVSTORE_TOKEN")
    return connect(args.tried_address, token=token, timeout_s=10.0, tls=tls)


def _address(args: argparse.Namespace) -> str:
    return str(args.address or os.environ.get("KVSTORE_ADDRESS") or f"unix://{_settings(args).socket_path}")


def _cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    looked, hit = stats["lookup_tokens"], stats["hit_tokens"]
    ratio = f"{hit / looked:.1%} of {looked:,} tokens looked up" if looked else "no lookups yet"
    console.print(
        f"kvstore {escape(stats['version'])} up {_duration(stats['uptime_s'])}, tenant "
        f"{escape(stats['tenant'])}, token hit ratio {ratio}"
    )
    for address in stats["addresses"]:
        console.print(f"  listening: {escape(address)}")
    table = Table(title="tiers")
    for col in ("tier", "blocks", "used", "capacity", "fill", "checksum failures"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for t in stats["tiers"]:
        fill = t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else 0.0
        table.add_row(
            t["name"],
            f"{t['blocks']:,}",
            _size(t["used_bytes"]),
            _size(t["capacity_bytes"]),
            f"{fill:.0%}",
            str(t["checksum_failures"]),
        )
    console.print(table)
    for line in stats["absent_tiers"]:
        console.print(f"absent: {escape(line)}")
    if stats["fingerprints"]:
        # Plain lines, not a table: a 64-digit fingerprint must survive any terminal width whole,
        # ready to copy into `kvstore invalidate --fingerprint`.
        console.print("models (kvstore invalidate --model ID, or --fingerprint HEX or a unique prefix):")
        for f in stats["fingerprints"]:
            rank = f" tp rank {f['tp_rank']}/{f['tp_world_size']}," if f["tp_world_size"] > 1 else ""
            model = f["model_id"] or "(model not registered since the data folder was made)"
            print(f"  {f['fingerprint']}  {model},{rank} {f['blocks']:,} blocks, {_size(f['bytes'])}")
        sys.stdout.flush()
    if stats["counters"]:
        counters = Table(title="counters")
        counters.add_column("counter")
        counters.add_column("value", justify="right")
        for name, value in sorted(stats["counters"].items()):
            counters.add_row(name, f"{value:,}")
        console.print(counters)
    for namespace, nbytes in sorted(stats["tenant_bytes"].items()):
        console.print(f"{escape(namespace)}: {_size(nbytes)}")
    return 0


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _fingerprints(args: argparse.Namespace, client: Any) -> list[tuple[bytes, str]]:
    """The fingerprints ``--fingerprint HEX-OR-PREFIX`` or ``--model ID`` name, with their model
    ids; [] when neither was given. A prefix must name exactly one stored fingerprint."""
    if not args.fingerprint and not getattr(args, "model", None):
        return []
    text = (args.fingerprint or "").strip().lower()
    if text and (len(text) > 64 or any(c not in "0123456789abcdef" for c in text)):
        raise InvalidArgument(f"--fingerprint takes hex digits (all 64, or a unique prefix), got {text!r}")
    known = [(bytes.fromhex(f["fingerprint"]), f["model_id"]) for f in client.stats()["fingerprints"]]
    if getattr(args, "model", None):
        found = [(fp, model) for fp, model in known if model == args.model]
        if not found:
            models = sorted({m for _, m in known if m}) or ["none"]
            raise InvalidArgument(
                f"no stored blocks of model {args.model!r}; models with blocks: {', '.join(models)}"
            )
        return found
    if len(text) == 64:
        fingerprint = bytes.fromhex(text)
        return [(fingerprint, next((m for fp, m in known if fp == fingerprint), ""))]
    found = [(fp, model) for fp, model in known if fp.hex().startswith(text)]
    if len(found) != 1:
        what = "no stored fingerprint" if not found else f"{len(found)} fingerprints"
        raise InvalidArgument(
            f"{what} start with {text!r}; `kvstore stats` lists them (give more digits or all 64)"
        )
    return found


def _cmd_invalidate(args: argparse.Namespace) -> int:
    if (bool(args.fingerprint) + bool(args.model) + bool(args.everything)) != 1:
        print(
            "kvstore invalidate: give one of --fingerprint HEX, --model ID or --everything", file=sys.stderr
        )
        return 2
    if args.everything and not args.yes:
        whose = (
            "EVERY tenant's" if args.tenant == "*" else f"tenant {args.tenant!r}'s" if args.tenant else "your"
        )
        try:  # an answer piped in is an answer; no answer at all (no terminal, </dev/null) is a refusal
            answer = input(f"Remove all of {whose} cached blocks? Type 'yes' to confirm: ")
        except EOFError:
            raise InvalidArgument(
                "--everything asks for confirmation and standard input gave no answer: add --yes"
            ) from None
        if answer.strip().lower() != "yes":
            print("nothing removed")
            return 1
    with _client(args) as client:
        if args.everything:
            removed = client.invalidate(None, tenant=args.tenant, everything=True)
            print(f"removed {removed} blocks")
            return 0
        for fingerprint, model in _fingerprints(args, client):
            removed = client.invalidate(fingerprint, tenant=args.tenant)
            print(f"removed {removed} blocks of {fingerprint.hex()}" + (f" ({model})" if model else ""))
    return 0


def _cmd_demote(args: argparse.Namespace) -> int:
    with _client(args) as client:
        targets: list[tuple[bytes | None, str]] = [*_fingerprints(args, client)] or [(None, "")]
        for fingerprint, _ in targets:
            moved = client.demote(args.tier, fingerprint, tenant=args.tenant)
            print(
                f"moved {moved} blocks out of {args.tier}"
                + (f" ({fingerprint.hex()[:16]}…)" if fingerprint else "")
            )
    return 0


def _cmd_shred(args: argparse.Namespace) -> int:
    with _client(args) as client:
        removed, key_removed = client.shred(args.tenant)
    key = "key file deleted" if key_removed else "no key file (encryption at rest off, or none made yet)"
    print(f"shredded tenant {args.tenant}: {key}, {removed} blocks dropped")
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from kvstore.server.audit import read_audit

    settings = _settings(args)
    path = args.file or settings.server.audit_log
    if not path:
        raise InvalidArgument("server.audit_log is empty (no audit log): name one with --file")
    if path == "auto":
        path = str(Path(settings.data_dir) / "audit.log")
    try:
        read = read_audit(path)
    except OSError as exc:
        raise InvalidArgument(f"audit log {path}: {exc.strerror or exc}") from None
    for action in read.actions:
        print(json.dumps(action, sort_keys=True))
    if read.skipped:
        print(f"{read.skipped} torn or damaged records skipped", file=sys.stderr)
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.service:
        from kvstore.cli.demo_service import run_service_demo

        run_service_demo(args.service, args.tcp, args.token or os.environ.get("KVSTORE_TOKEN", ""))
        return 0
    from kvstore.cli.demo import run_demo

    run_demo(_settings(args))
    return 0


def _cmd_bench_tiers(args: argparse.Namespace) -> int:
    from benchmarks.tiers import run_tier_bench

    return run_tier_bench(quick=args.quick, json_path=args.json, data_dir=args.data_dir)


def _cmd_bench_device(args: argparse.Namespace) -> int:
    from benchmarks.device import run_device_bench

    return run_device_bench(quick=args.quick, json_path=args.json)


def _cmd_bench_service(args: argparse.Namespace) -> int:
    from benchmarks.service import run_service_bench

    return run_service_bench(
        quick=args.quick, json_path=args.json, with_peers=not args.no_peers, fairness_only=args.fairness
    )


def _cmd_bench_crash(args: argparse.Namespace) -> int:
    from benchmarks.crash import run_crash_bench

    return run_crash_bench(
        cycles=args.cycles or (5 if args.quick else 20), quick=args.quick, json_path=args.json
    )


def _cmd_bench_calibrate(args: argparse.Namespace) -> int:
    from benchmarks.calibrate import run_calibrate

    return run_calibrate(model=args.model, out_path=args.out, quick=args.quick)


def _cmd_bench_decisions(args: argparse.Namespace) -> int:
    from benchmarks.decisions import run_decisions

    return run_decisions(model=args.model, quick=args.quick, json_path=args.json, plot_path=args.plot)


def _cmd_bench_fleet(args: argparse.Namespace) -> int:
    from benchmarks.fleet import run_fleet

    return run_fleet(args.quick, args.json, args.calibration, args.plot)


def _cmd_bench_replay(args: argparse.Namespace) -> int:
    from benchmarks.replay import run_replay

    run_replay(
        model=args.model,
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        trace=args.trace,
        tokenizer=args.tokenizer,
        workloads=args.workloads.split(",") if args.workloads else None,
        peers=args.peers,
        configs=args.configs.split(",") if args.configs else None,
    )
    return 0


def _cmd_route(args: argparse.Namespace) -> int:
    from kvstore.cli.route import read_keys_file, serve_router
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
            front=FrontSettings(
                keys=read_keys_file(args.keys_file) if args.keys_file else {},
                ops_tenants=frozenset(args.ops_tenant),
                ops_loopback=args.ops_loopback,
                backend_key=os.environ.get("KVSTORE_BACKEND_KEY", ""),
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
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML configuration file")
    common.add_argument("--set", metavar="SECTION.FIELD=VALUE", action="append", help="override one setting")
    common.add_argument(
        "--data-dir", metavar="DIR", help="folder for the persistent tiers (overrides data_dir)"
    )
    common.add_argument("-v", "--verbose", action="store_true", help="log at debug level")

    parser = argparse.ArgumentParser(
        prog="kvstore", description="Tiered KV-cache offload storage for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

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

    serve = sub.add_parser("serve", parents=[common], help="run the service")
    serve.add_argument("--tcp", metavar="HOST:PORT", help="also listen on TCP (server.tcp_address)")
    serve.add_argument("--socket", metavar="PATH", help="Unix socket path (server.socket_path)")
    serve.set_defaults(func=_cmd_serve)

    stats = sub.add_parser("stats", parents=[common, remote], help="a running server's tiers and counters")
    stats.add_argument("--json", action="store_true", help="print JSON instead of tables")
    stats.set_defaults(func=_cmd_stats)

    invalidate = sub.add_parser("invalidate", parents=[common, remote], help="remove blocks now")
    invalidate.add_argument(
        "--fingerprint",
        metavar="HEX",
        help="every block of this fingerprint (64 hex digits or a unique prefix)",
    )
    invalidate.add_argument("--model", metavar="ID", help="every block of every fingerprint of this model id")
    invalidate.add_argument("--everything", action="store_true", help="every block (asks for confirmation)")
    invalidate.add_argument("--tenant", default="", help="another tenant's blocks, or '*' for all (admins)")
    invalidate.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    invalidate.set_defaults(func=_cmd_invalidate)

    demote = sub.add_parser(
        "demote", parents=[common, remote], help="move blocks out of a tier into the next one"
    )
    demote.add_argument("--tier", default="dram", help="the tier to empty (default dram)")
    demote.add_argument(
        "--fingerprint", metavar="HEX", help="only this fingerprint's blocks (or a unique prefix)"
    )
    demote.add_argument("--model", metavar="ID", help="only the blocks of this model id")
    demote.add_argument("--tenant", default="", help="another tenant's blocks, or '*' for all (admins)")
    demote.set_defaults(func=_cmd_demote)

    shred = sub.add_parser("shred", parents=[common, remote], help="crypto-shred a tenant now (admins)")
    shred.add_argument("--tenant", required=True, help="the tenant whose key and blocks go")
    shred.set_defaults(func=_cmd_shred)

    audit = sub.add_parser("audit", parents=[common], help="print the audit log, one action a line")
    audit.add_argument("--file", help="the audit log (default: server.audit_log)")
    audit.set_defaults(func=_cmd_audit)

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

    bench = sub.add_parser("bench", help="benchmarks measured on this machine")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tiers = bench_sub.add_parser("tiers", parents=[common], help="per-tier put/get throughput vs references")
    tiers.add_argument("--quick", action="store_true", help="fewer repetitions; under two minutes")
    tiers.add_argument("--json", metavar="PATH", help="write results as JSON")
    tiers.set_defaults(func=_cmd_bench_tiers)
    device = bench_sub.add_parser(
        "device",
        parents=[common],
        help="copies between the arena, the hbm tier and a GPU vs torch's pinned copies (CUDA)",
    )
    device.add_argument("--quick", action="store_true", help="a 256 MiB working set, fewer rounds")
    device.add_argument("--json", metavar="PATH", help="write results as JSON")
    device.set_defaults(func=_cmd_bench_device)
    service = bench_sub.add_parser(
        "service", parents=[common], help="the service against raw TCP, memcpy, peers"
    )
    service.add_argument("--quick", action="store_true", help="fewer blocks and rounds; under three minutes")
    service.add_argument("--json", metavar="PATH", help="write results as JSON")
    service.add_argument("--no-peers", action="store_true", help="skip Redis, Mooncake Store and LMCache")
    service.add_argument(
        "--fairness", action="store_true", help="only the row of a tenant's lookups beside a noisy tenant"
    )
    service.set_defaults(func=_cmd_bench_service)
    crash = bench_sub.add_parser(
        "crash", parents=[common], help="kill -9 under load: acknowledged blocks served after restart"
    )
    crash.add_argument("--quick", action="store_true", help="5 cycles instead of 20")
    crash.add_argument("--cycles", type=int, help="kill -9 cycles (default 20)")
    crash.add_argument("--json", metavar="PATH", help="write results as JSON")
    crash.set_defaults(func=_cmd_bench_crash)
    calibrate = bench_sub.add_parser(
        "calibrate",
        parents=[common],
        help="measure prefill and tier restore costs; write the calibration file",
    )
    calibrate.add_argument(
        "--model", metavar="DIR", help="a local HF model folder (default: a tiny random Llama)"
    )
    calibrate.add_argument("--out", metavar="PATH", default="calibration.json", help="where to write it")
    calibrate.add_argument("--quick", action="store_true", help="fewer lengths and repetitions")
    calibrate.set_defaults(func=_cmd_bench_calibrate)
    decisions = bench_sub.add_parser(
        "decisions", parents=[common], help="the plan against all-restore and all-recompute"
    )
    decisions.add_argument(
        "--model", metavar="DIR", help="a local HF model folder (default: a tiny random Llama)"
    )
    decisions.add_argument("--quick", action="store_true", help="a smaller sweep (about five minutes here)")
    decisions.add_argument("--json", metavar="PATH", help="write results as JSON")
    decisions.add_argument("--plot", metavar="PNG", help="draw the three curves per tier and throttle")
    decisions.set_defaults(func=_cmd_bench_decisions)
    fleet = bench_sub.add_parser(
        "fleet",
        parents=[common],
        help="remote tiers measured, routing policies simulated for 4 and 64 replicas",
    )
    fleet.add_argument("--quick", action="store_true", help="fewer blocks and sessions (a few minutes)")
    fleet.add_argument("--json", metavar="PATH", help="write results as JSON")
    fleet.add_argument("--plot", metavar="PNG", help="draw hit rates per policy, workload and remote tier")
    fleet.add_argument(
        "--calibration", default="", metavar="FILE", help="prefill curve from kvstore bench calibrate"
    )
    fleet.set_defaults(func=_cmd_bench_fleet)
    replay = bench_sub.add_parser(
        "replay", parents=[common], help="a trace through vLLM alone, with kvstore, and with the peers"
    )
    replay.add_argument("--model", help="a local model folder (default: a random Llama built on the spot)")
    replay.add_argument("--quick", action="store_true", help="two short workloads, no peers (a few minutes)")
    replay.add_argument("--json", metavar="PATH", help="write results as JSON")
    replay.add_argument(
        "--plot", metavar="PNG", help="draw hit rate and p95 TTFT per workload and configuration"
    )
    replay.add_argument(
        "--trace", metavar="JSONL", help="your own trace (format: benchmarks/replay_traces.py)"
    )
    replay.add_argument("--tokenizer", metavar="DIR", help='tokenizer for "text" lines (default: the model)')
    replay.add_argument(
        "--workloads", help="comma list of agent, chats, rag, tenants (default: all; quick: two)"
    )
    replay.add_argument(
        "--configs", help="comma list of vllm, kvstore-dram, kvstore-nvme, example (default: all)"
    )
    replay.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="try every other vLLM KV connector and report which start (default: on, off with --quick)",
    )
    replay.set_defaults(func=_cmd_bench_replay)
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
    return code


def _fail(args: argparse.Namespace, exc: BaseException, line: str) -> int:
    if args.verbose:
        log.error("traceback", exc_info=exc)
    print(f"kvstore {args.command}: {line}", file=sys.stderr)
    return 2


def _why_unreachable(address: str, exc: BaseException) -> str:
    if address.startswith("unix:"):
        path = address.removeprefix("unix:").removeprefix("//")
        if not os.path.exists(path):
            return f"no socket at {path}"
    text = str(exc)
    for reason in ("Connection refused", "Permission denied", "deadline exceeded", "Deadline Exceeded"):
        if reason in text:
            return reason.lower()
    return text.strip().splitlines()[0][:160] if text.strip() else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())

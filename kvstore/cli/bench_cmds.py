"""``kvstore bench ...``: the benchmarks, imported lazily (only the CLI reaches up into
``benchmarks/``, and only when one is asked for).

``bench service`` starts servers of its own, unless ``--address`` names a running one: then it
measures that deployment (``benchmarks.deployment``) and starts nothing. It installs nothing
either, unless ``--install-peers`` says so: without it a peer that is missing is a row saying
what is missing and the flag that installs it.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvstore.address import parse_address
from kvstore.cli.common import client_tls, token
from kvstore.errors import InvalidArgument


def add_parsers(sub: Any, common: argparse.ArgumentParser, remote: argparse.ArgumentParser) -> None:
    bench = sub.add_parser("bench", help="benchmarks measured on this machine")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tiers = bench_sub.add_parser("tiers", parents=[common], help="per-tier put/get throughput vs references")
    tiers.add_argument("--quick", action="store_true", help="fewer repetitions; under two minutes")
    tiers.add_argument("--json", metavar="PATH", help="write results as JSON")
    tiers.set_defaults(func=_tiers)
    device = bench_sub.add_parser(
        "device",
        parents=[common],
        help="copies between the arena, the hbm tier and a GPU vs torch's pinned copies (CUDA)",
    )
    device.add_argument("--quick", action="store_true", help="a 256 MiB working set, fewer rounds")
    device.add_argument("--json", metavar="PATH", help="write results as JSON")
    device.set_defaults(func=_device)
    _add_service(bench_sub, common, remote)
    crash = bench_sub.add_parser(
        "crash", parents=[common], help="kill -9 under load: acknowledged blocks served after restart"
    )
    crash.add_argument("--quick", action="store_true", help="5 cycles instead of 20")
    crash.add_argument("--cycles", type=int, help="kill -9 cycles (default 20)")
    crash.add_argument("--json", metavar="PATH", help="write results as JSON")
    crash.set_defaults(func=_crash)
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
    calibrate.set_defaults(func=_calibrate)
    decisions = bench_sub.add_parser(
        "decisions", parents=[common], help="the plan against all-restore and all-recompute"
    )
    decisions.add_argument(
        "--model", metavar="DIR", help="a local HF model folder (default: a tiny random Llama)"
    )
    decisions.add_argument("--quick", action="store_true", help="a smaller sweep (about five minutes here)")
    decisions.add_argument("--json", metavar="PATH", help="write results as JSON")
    decisions.add_argument("--plot", metavar="PNG", help="draw the three curves per tier and throttle")
    decisions.add_argument(
        "--converge",
        metavar="TXT",
        nargs="?",
        const="-",
        help="instead: a plan from a wrong calibration, with and without exploring, until it decides "
        "right (seconds; writes TXT if named)",
    )
    decisions.set_defaults(func=_decisions)
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
    fleet.add_argument(
        "--trace",
        metavar="JSONL",
        help="only this Mooncake or chat trace (format: benchmarks/traces.py): local caches vs a "
        "shared tier, simulated and through real sidecars",
    )
    fleet.add_argument(
        "--tokens-per-id", type=int, default=16, help="tokens per Mooncake hash id (default 16: one block)"
    )
    fleet.add_argument(
        "--speedup",
        type=float,
        default=0.0,
        help="send each request at its timestamp divided by this (default 0: back to back)",
    )
    fleet.set_defaults(func=_fleet)
    _add_replay(bench_sub, common)


def _add_service(bench_sub: Any, common: argparse.ArgumentParser, remote: argparse.ArgumentParser) -> None:
    service = bench_sub.add_parser(
        "service",
        parents=[common, remote],
        help="the service against raw TCP, memcpy, peers; or, with --address, a running deployment",
        description="Without --address: servers of its own, against raw TCP, memcpy and the peers. "
        "With --address (the flag itself; $KVSTORE_ADDRESS does not switch modes): the server "
        "running there, measured from here, nothing started.",
    )
    service.add_argument("--quick", action="store_true", help="fewer blocks and rounds; under three minutes")
    service.add_argument("--json", metavar="PATH", help="write results as JSON")
    service.add_argument("--no-peers", action="store_true", help="skip Redis, Mooncake Store and LMCache")
    service.add_argument(
        "--install-peers",
        action="store_true",
        help="install the peers that are missing (Debian packages with apt-get when root, a venv per "
        "peer under .kvstore/peers); without it a missing peer is only reported",
    )
    service.add_argument(
        "--fairness", action="store_true", help="only the row of a tenant's lookups beside a noisy tenant"
    )
    service.add_argument(
        "--blocks",
        type=int,
        help="with --address: 2 MiB blocks per round (default 64, 16 with --quick); they are "
        "written under a model of the benchmark's own and invalidated at the end",
    )
    service.set_defaults(func=_service)


def _add_replay(bench_sub: Any, common: argparse.ArgumentParser) -> None:
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
        "--trace",
        metavar="JSONL",
        help="your own trace, or a Mooncake or chat one (formats: benchmarks/replay_traces.py, traces.py)",
    )
    replay.add_argument(
        "--tokenizer", metavar="DIR", help='tokenizer for "text" lines and chat traces (default: the model)'
    )
    replay.add_argument(
        "--tokens-per-id", type=int, default=32, help="tokens per Mooncake hash id (default 32: one block)"
    )
    replay.add_argument("--limit", type=int, metavar="N", help="only the first N requests of --trace")
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
    replay.add_argument(
        "--concurrency",
        action="store_true",
        help="instead: restores from a throttled nvme beside other requests, loads beside and inside the "
        "step against vLLM alone (benchmarks/replay_concurrency.py)",
    )
    replay.set_defaults(func=_replay)


def _tiers(args: argparse.Namespace) -> int:
    from benchmarks.tiers import run_tier_bench

    return run_tier_bench(quick=args.quick, json_path=args.json, data_dir=args.data_dir)


def _device(args: argparse.Namespace) -> int:
    from benchmarks.device import run_device_bench

    return run_device_bench(quick=args.quick, json_path=args.json)


def _service(args: argparse.Namespace) -> int:
    with_address = {"--fairness": args.fairness, "--install-peers": args.install_peers}
    if args.address and (clash := [flag for flag, given in with_address.items() if given]):
        raise InvalidArgument(f"{clash[0]} is for the servers bench service starts, not for --address")
    if args.blocks is not None and (not args.address or args.blocks < 1):
        raise InvalidArgument("--blocks takes a count of at least 1, with --address")
    if args.address:
        from benchmarks.deployment import run_deployment_bench

        address = parse_address(args.address, "--address")
        args.tried_address = address  # an unreachable one is named in the error line
        return run_deployment_bench(
            address,
            token=token(args),
            tls=client_tls(args, address),
            blocks=args.blocks or (16 if args.quick else 64),
            rounds=3 if args.quick else 7,
            json_path=args.json,
        )
    from benchmarks.service import run_service_bench

    return run_service_bench(
        quick=args.quick,
        json_path=args.json,
        with_peers=not args.no_peers,
        fairness_only=args.fairness,
        install_peers=args.install_peers,
    )


def _crash(args: argparse.Namespace) -> int:
    from benchmarks.crash import run_crash_bench

    return run_crash_bench(
        cycles=args.cycles or (5 if args.quick else 20), quick=args.quick, json_path=args.json
    )


def _calibrate(args: argparse.Namespace) -> int:
    from benchmarks.calibrate import run_calibrate

    return run_calibrate(model=args.model, out_path=args.out, quick=args.quick)


def _decisions(args: argparse.Namespace) -> int:
    if args.converge:
        from benchmarks.decisions_converge import run_converge

        return run_converge(None if args.converge == "-" else args.converge)
    from benchmarks.decisions import run_decisions

    return run_decisions(model=args.model, quick=args.quick, json_path=args.json, plot_path=args.plot)


def _fleet(args: argparse.Namespace) -> int:
    if args.trace:
        from pathlib import Path

        from benchmarks.fleet_traces import run_trace

        return run_trace(Path(args.trace), args.tokens_per_id, args.speedup, args.quick, args.json)
    from benchmarks.fleet import run_fleet

    return run_fleet(args.quick, args.json, args.calibration, args.plot)


def _replay(args: argparse.Namespace) -> int:
    if args.concurrency:
        from benchmarks.replay_concurrency import run_concurrency_bench

        run_concurrency_bench(model=args.model, quick=args.quick, json_path=args.json)
        return 0
    from benchmarks.replay import run_replay

    run_replay(
        model=args.model,
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        trace=args.trace,
        tokenizer=args.tokenizer,
        tokens_per_id=args.tokens_per_id,
        limit=args.limit,
        workloads=args.workloads.split(",") if args.workloads else None,
        peers=args.peers,
        configs=args.configs.split(",") if args.configs else None,
    )
    return 0

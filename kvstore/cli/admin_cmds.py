"""``kvstore invalidate``, ``demote``, ``shred`` and ``audit``: what an operator does to a
running server's blocks, and the record of it. Each reports what it did as a line, or with
``--json`` as one JSON object on stdout (questions and refusals go to stderr)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvstore.cli.common import client, settings
from kvstore.errors import InvalidArgument

_JSON_HELP = "print what was done as one JSON object"


def add_parsers(sub: Any, common: argparse.ArgumentParser, remote: argparse.ArgumentParser) -> None:
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
    invalidate.add_argument("--json", action="store_true", help=_JSON_HELP)
    invalidate.set_defaults(func=run_invalidate)

    demote = sub.add_parser(
        "demote", parents=[common, remote], help="move blocks out of a tier into the next one"
    )
    demote.add_argument("--tier", default="dram", help="the tier to empty (default dram)")
    demote.add_argument(
        "--fingerprint", metavar="HEX", help="only this fingerprint's blocks (or a unique prefix)"
    )
    demote.add_argument("--model", metavar="ID", help="only the blocks of this model id")
    demote.add_argument("--tenant", default="", help="another tenant's blocks, or '*' for all (admins)")
    demote.add_argument("--json", action="store_true", help=_JSON_HELP)
    demote.set_defaults(func=run_demote)

    shred = sub.add_parser("shred", parents=[common, remote], help="crypto-shred a tenant now (admins)")
    shred.add_argument("--tenant", required=True, help="the tenant whose key and blocks go")
    shred.add_argument("--json", action="store_true", help=_JSON_HELP)
    shred.set_defaults(func=run_shred)

    audit = sub.add_parser("audit", parents=[common], help="print the audit log, one action a line")
    audit.add_argument("--file", help="the audit log (default: server.audit_log)")
    audit.add_argument(
        "--json",
        action="store_true",
        help='one JSON object {"records": [...], "skipped": N} instead of lines',
    )
    audit.set_defaults(func=run_audit)


def fingerprints(args: argparse.Namespace, kv: Any) -> list[tuple[bytes, str]]:
    """The fingerprints ``--fingerprint HEX-OR-PREFIX`` or ``--model ID`` name, with their model
    ids; [] when neither was given. A prefix must name exactly one stored fingerprint."""
    if not args.fingerprint and not getattr(args, "model", None):
        return []
    text = (args.fingerprint or "").strip().lower()
    if text and (len(text) > 64 or any(c not in "0123456789abcdef" for c in text)):
        raise InvalidArgument(f"--fingerprint takes hex digits (all 64, or a unique prefix), got {text!r}")
    known = [(bytes.fromhex(f["fingerprint"]), f["model_id"]) for f in kv.stats()["fingerprints"]]
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


def run_invalidate(args: argparse.Namespace) -> int:
    if (bool(args.fingerprint) + bool(args.model) + bool(args.everything)) != 1:
        print(
            "kvstore invalidate: give one of --fingerprint HEX, --model ID or --everything", file=sys.stderr
        )
        return 2
    if args.everything and not args.yes and not _confirmed(args):
        print("nothing removed", file=sys.stderr if args.json else sys.stdout)
        return 1
    with client(args) as kv:
        if args.everything:
            removed = kv.invalidate(None, tenant=args.tenant, everything=True)
            _report(args, f"removed {removed} blocks", {"removed": removed, "everything": True})
            return 0
        done = []
        for fingerprint, model in fingerprints(args, kv):
            removed = kv.invalidate(fingerprint, tenant=args.tenant)
            done.append({"fingerprint": fingerprint.hex(), "model_id": model, "removed": removed})
            if not args.json:
                print(f"removed {removed} blocks of {fingerprint.hex()}" + (f" ({model})" if model else ""))
    if args.json:
        print(json.dumps({"removed": sum(int(d["removed"]) for d in done), "fingerprints": done}))
    return 0


def _confirmed(args: argparse.Namespace) -> bool:
    whose = "EVERY tenant's" if args.tenant == "*" else f"tenant {args.tenant!r}'s" if args.tenant else "your"
    question = f"Remove all of {whose} cached blocks? Type 'yes' to confirm: "
    try:  # an answer piped in is an answer; no answer at all (no terminal, </dev/null) is a refusal
        if args.json:  # stdout carries the JSON alone
            print(question, end="", file=sys.stderr, flush=True)
            answer = input()
        else:
            answer = input(question)
    except EOFError:
        raise InvalidArgument(
            "--everything asks for confirmation and standard input gave no answer: add --yes"
        ) from None
    return answer.strip().lower() == "yes"


def run_demote(args: argparse.Namespace) -> int:
    with client(args) as kv:
        targets: list[tuple[bytes | None, str]] = [*fingerprints(args, kv)] or [(None, "")]
        done = []
        for fingerprint, model in targets:
            moved = kv.demote(args.tier, fingerprint, tenant=args.tenant)
            done.append(
                {"fingerprint": fingerprint.hex() if fingerprint else None, "model_id": model, "moved": moved}
            )
            if not args.json:
                print(
                    f"moved {moved} blocks out of {args.tier}"
                    + (f" ({fingerprint.hex()[:16]}…)" if fingerprint else "")
                )
    if args.json:
        print(
            json.dumps({"tier": args.tier, "moved": sum(int(d["moved"]) for d in done), "fingerprints": done})
        )
    return 0


def run_shred(args: argparse.Namespace) -> int:
    with client(args) as kv:
        removed, key_removed = kv.shred(args.tenant)
    key = "key file deleted" if key_removed else "no key file (encryption at rest off, or none made yet)"
    line = f"shredded tenant {args.tenant}: {key}, {removed} blocks dropped"
    _report(args, line, {"tenant": args.tenant, "removed": removed, "key_removed": key_removed})
    return 0


def run_audit(args: argparse.Namespace) -> int:
    from kvstore.server.audit import read_audit

    loaded = settings(args)
    path = args.file or loaded.server.audit_log
    if not path:
        raise InvalidArgument("server.audit_log is empty (no audit log): name one with --file")
    if path == "auto":
        path = str(Path(loaded.data_dir) / "audit.log")
    try:
        read = read_audit(path)
    except OSError as exc:
        raise InvalidArgument(f"audit log {path}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps({"records": list(read.actions), "skipped": read.skipped}, sort_keys=True))
        return 0
    for action in read.actions:
        print(json.dumps(action, sort_keys=True))
    if read.skipped:
        print(f"{read.skipped} torn or damaged records skipped", file=sys.stderr)
    return 0


def _report(args: argparse.Namespace, line: str, figures: dict[str, Any]) -> None:
    print(json.dumps(figures) if args.json else line)

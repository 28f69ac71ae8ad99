"""``kvstore route``: the router process (on the command-line floor, so it may read the
connector's calibration file). It builds the policy (tier and prefill figures from a calibration
file, or the cost model's defaults), learns the engines' fingerprint from their sidecars once an
engine has registered (until then prompts are routed without asking them), and serves
``kvstore.routing.http`` until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvstore.cost_model import DEFAULT_PREFILL, DEFAULT_TIERS
from kvstore.errors import InvalidArgument
from kvstore.extras import require
from kvstore.keys import Fingerprint
from kvstore.model_folder import block_bytes_of
from kvstore.routing.http import SALT_SECRET_VARIABLE, FrontSettings, build_app, run, tokenizer_for
from kvstore.routing.policies import BoundedRendezvous, ConsistentHash, CostAware, RoundRobin
from kvstore.routing.router import Policy, Router, SidecarProbe
from kvstore.secret_files import read_secret_file
from kvstore.server.auth import read_tokens_file
from kvstore.tls import ServerTls

log = logging.getLogger("kvstore.route")

POLICIES = ("cost", "rendezvous", "hash", "round-robin")
MIN_SALT_SECRET_CHARS = 16  # a shorter one could be guessed offline, tenant names being known
_REDISCOVER_S = 2.0


def read_keys_file(path: str) -> dict[str, str]:
    """``--keys-file``: ``KEY=TENANT`` lines, refused unless only its owner can read it, as the
    server's tokens file (the same parser)."""
    return read_tokens_file(path, setting="--keys-file")


def read_salt_secret(path: str, environ: Mapping[str, str]) -> bytes:
    """The key of every tenant's cache salt: ``--salt-secret-file`` (refused unless 0600, as every
    secret file) or ``$KVSTORE_ROUTE_SALT_SECRET`` (a Kubernetes Secret's usual way in); b"" when
    neither is given. Raises ``FailedPrecondition`` or ``InvalidArgument``, naming where, never
    the secret."""
    variable = environ.get(SALT_SECRET_VARIABLE, "").strip()
    if path and variable:
        raise InvalidArgument(f"--salt-secret-file and ${SALT_SECRET_VARIABLE} are both set: give one")
    if path:
        secret, where = read_secret_file(path, "--salt-secret-file"), f"--salt-secret-file {path}"
    elif variable:
        secret, where = variable, f"${SALT_SECRET_VARIABLE}"
    else:
        return b""
    if len(secret) < MIN_SALT_SECRET_CHARS:
        raise InvalidArgument(
            f"{where}: a salt secret of {len(secret)} characters could be guessed; "
            f"give at least {MIN_SALT_SECRET_CHARS} (e.g. `openssl rand -hex 32`)"
        )
    return secret.encode()


def build_policy(
    name: str,
    replicas: Sequence[str],
    model_dir: Path,
    block_size: int,
    calibration: str,
    slack: float,
    queue_penalty_s: float,
) -> Policy:
    if name == "round-robin":
        return RoundRobin(replicas)
    if name == "hash":
        return ConsistentHash(replicas)
    if name == "rendezvous":
        return BoundedRendezvous(replicas, slack)
    if name != "cost":
        raise ValueError(f"--policy is one of {', '.join(POLICIES)}, got {name!r}")
    tiers, prefill = dict(DEFAULT_TIERS), DEFAULT_PREFILL
    if calibration:
        from engine_plugin.calibration import Calibration

        snap = Calibration.load(calibration).snapshot()
        tiers.update(snap.tiers)
        prefill = snap.prefill
    block_bytes = block_bytes_of(model_dir, block_size)
    return CostAware(replicas, tiers, prefill, block_bytes, block_size, queue_penalty_s, slack)


class _Discovered:
    """The engines' fingerprint, asked of the sidecars until one answers, then kept."""

    def __init__(self, probe: SidecarProbe | None, model_id: str) -> None:
        self._probe = probe
        self._model_id = model_id
        self._found: Fingerprint | None = None
        self._asked_at = -_REDISCOVER_S
        self._lock = threading.Lock()

    def __call__(self) -> Fingerprint | None:
        if self._found is not None or self._probe is None:
            return self._found
        with self._lock:
            if self._found is None and time.monotonic() - self._asked_at >= _REDISCOVER_S:
                self._asked_at = time.monotonic()
                self._found = self._probe.fingerprint(self._model_id)
            return self._found


def _probe(sidecars: Sequence[str], events: Sequence[str], token: str | None) -> SidecarProbe | None:
    """How the router learns what each sidecar holds: a lookup per prompt, or (``events``,
    ``--sidecar-events``) their KV event feeds (kvstore.routing.events)."""
    if not events:
        return SidecarProbe(sidecars, token=token) if sidecars else None
    for module in ("zmq", "msgspec"):
        require(module, "--sidecar-events")
    from kvstore.routing.events import FollowedProbe

    return FollowedProbe(sidecars, events, token=token)


def serve_router(
    backends: Sequence[str],
    sidecars: Sequence[str],
    model_dir: Path,
    policy_name: str,
    listen: str,
    block_size: int,
    calibration: str = "",
    slack: float = 1.25,
    queue_penalty_s: float = 0.05,
    prefix_tokens: int = 256,
    model_id: str = "",
    token: str | None = None,
    front: FrontSettings | None = None,
    tls: ServerTls | None = None,
    sidecar_events: Sequence[str] = (),
) -> int:
    if not backends:
        raise ValueError("kvstore route needs at least one --backend URL")
    if sidecars and len(sidecars) != len(backends):
        raise ValueError(
            f"one --sidecar per --backend: {len(sidecars)} sidecars for {len(backends)} backends"
        )
    if not (model_dir / "config.json").is_file():
        raise ValueError(
            f"--model {model_dir}: no config.json there (give the model's local folder, with its tokenizer)"
        )
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--listen {listen!r} is not HOST:PORT with a port from 0 to 65535")
    # replicas are named r0, r1, ... in /metrics and /health; their URLs stay in this log
    names = [f"r{i}" for i in range(len(backends))]
    for name, url in zip(names, backends, strict=True):
        log.info("replica %s is %s", name, url)
    try:
        policy = build_policy(policy_name, names, model_dir, block_size, calibration, slack, queue_penalty_s)
    except KeyError as exc:
        raise ValueError(
            f"{model_dir / 'config.json'} has no {exc} (not a Hugging Face model config?)"
        ) from None
    probe = _probe(sidecars, sidecar_events, token)
    router = Router(
        names, policy, _Discovered(probe, model_id), block_size, probe=probe, prefix_tokens=prefix_tokens
    )
    front = front or FrontSettings()
    context = tls.ssl_context() if tls is not None else None
    app = build_app(backends, router, tokenizer_for(model_dir), front)
    try:
        run(app, front, host or "127.0.0.1", int(port), context)
    except OSError as exc:  # the port in use, or not an address of this machine
        raise ValueError(f"cannot listen on {listen} ({exc.strerror or exc}): change --listen") from None
    finally:
        if probe is not None:
            probe.close()
    return 0

"""Calibration: the measured inputs of the cost model, loaded from a file and kept current.

A ``Calibration`` holds one ``TierCost`` per tier and a ``PrefillModel``. It starts from the file
``kvstore bench calibrate`` writes (JSON) and is updated online from what really happened:

- ``observe_transfer(tier, bytes, seconds)`` keeps the tier's latest restores and, once their
  sizes differ enough to tell a fixed cost from a per-byte one, fits both, latency and bandwidth,
  by least squares weighted towards the latest (``fit_transfer``; a changed disk or a busy link
  shows up within a few restores). Restores of one size cannot tell them apart: the bandwidth
  then moves towards the observed one (exponentially weighted), the latency kept. A restore
  pays 2-4 ms whatever its size on vLLM CPU: most of a small one's time, which a calibrated
  0.5 ms under-predicts;
- ``observe_prefill(prefix, suffix, seconds)`` keeps the latest observations and refits the
  three prefill coefficients by non-negative least squares over them and the file's measured
  points (those stay: they span prompt shapes a busy engine may not see for a while). Before
  there are enough points for that fit, the first observations already correct the starting
  curve (the file's, or the defaults, 3-7x off for the tiny test model on CPU): with prompts
  of one size seen, the curve is scaled by the median of measured over predicted; with two
  sizes at least 2x apart, its fixed and per-token parts are fitted;
- ``start_from_probe(per_token_s)`` sets the starting curve's per-token cost to the one the
  worker measured at start, for the requests before any of that (no file only);
- ``reload_if_changed()`` re-reads the file when it was rewritten (a new ``kvstore bench
  calibrate`` run reaches running engines); the online observations start over then.

Threads: one lock guards updates; ``snapshot()`` returns immutable values safe to use anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from kvstore.cost_model import PrefillModel, TierCost

FORMAT_VERSION = 1
MIN_FIT_POINTS = 8
ONLINE_POINTS = 64
TRANSFER_POINTS = 32  # a tier's latest restores kept for the latency and bandwidth fit
TRANSFER_DECAY = 0.85  # an older restore's weight per newer one: the last ~10 count the most
TRANSFER_SPAN = 1.5  # the largest restore this many times the smallest at least, to fit latency

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    tiers: dict[str, TierCost]
    prefill: PrefillModel


class Calibration:
    def __init__(
        self,
        tiers: dict[str, TierCost],
        prefill: PrefillModel,
        points: list[tuple[int, int, float]] | None = None,
        ewma_weight: float = 0.2,
    ) -> None:
        if not 0 < ewma_weight <= 1:
            raise ValueError("ewma_weight must be in (0, 1]")
        self._tiers = dict(tiers)
        self._prefill = prefill
        self._prior = prefill  # the starting curve, scaled by the first observations until a fit
        self._anchors = [(int(p), int(s), float(t)) for p, s, t in points or []]
        self._weight = ewma_weight
        self._points: deque[tuple[int, int, float]] = deque(maxlen=ONLINE_POINTS)
        self._transfers: dict[str, deque[tuple[int, float]]] = {}
        self._lock = threading.Lock()
        self.path: Path | None = None
        self._stamp: tuple[int, int] | None = None

    # ----------------------------------------------------------------- persistence

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        stamp = _stamp(path)
        tiers, prefill, points = _read(path)
        calibration = cls(tiers, prefill, points)
        calibration.path, calibration._stamp = Path(path), stamp
        return calibration

    def reload_if_changed(self) -> bool:
        """Re-read the file this came from if it changed since; True when it did. A file that
        is gone or unreadable keeps the current figures (and is logged once per change)."""
        if self.path is None:
            return False
        try:
            stamp = _stamp(self.path)
            if stamp == self._stamp:
                return False
            tiers, prefill, points = _read(self.path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if self._stamp is not None:
                log.warning("calibration %s unreadable (%s); keeping the current figures", self.path, exc)
            self._stamp = None
            return False
        with self._lock:
            self._tiers, self._prefill, self._anchors = tiers, prefill, points
            self._prior = prefill
            self._points.clear()
            self._transfers.clear()
            self._stamp = stamp
        log.info("calibration %s changed: reloaded", self.path)
        return True

    def save(self, path: str | Path, extra: dict[str, object] | None = None) -> None:
        snap = self.snapshot()
        doc: dict[str, object] = {
            "version": FORMAT_VERSION,
            "tiers": {name: _finite(asdict(cost)) for name, cost in snap.tiers.items()},
            "prefill": asdict(snap.prefill),
            "prefill_points": self._anchors,
        }
        doc.update(extra or {})
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(dict(self._tiers), self._prefill)

    # ----------------------------------------------------------------- online updates

    def observe_transfer(self, tier: str, nbytes: int, seconds: float) -> None:
        """Fold one measured restore from ``tier`` into its latency and bandwidth."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            cost = self._tiers.get(tier)
            if cost is None:
                return
            seen = self._transfers.setdefault(tier, deque(maxlen=TRANSFER_POINTS))
            seen.append((nbytes, seconds))
            fitted = fit_transfer(list(seen))
            if fitted is not None:
                latency_s, bandwidth = fitted
                self._tiers[tier] = replace(cost, latency_s=latency_s, bandwidth_bytes_per_s=bandwidth)
                return
            spent = max(seconds - cost.latency_s, seconds * 0.1)
            observed = nbytes / spent
            blended = (1 - self._weight) * cost.bandwidth_bytes_per_s + self._weight * observed
            self._tiers[tier] = replace(cost, bandwidth_bytes_per_s=blended)

    def start_from_probe(self, per_token_s: float) -> None:
        """Take the per-token cost the worker's probe measured at start (engine_plugin.
        prefill_probe) into the starting curve, for the engine's first requests: the built-in
        one is 3-20x off by model and device. A calibration file's curve, measured on this
        machine, stands; timed prefills already seen keep correcting the new curve."""
        if self.path is not None or not per_token_s > 0:
            return
        with self._lock:
            self._prior = replace(self._prior, per_token_s=per_token_s)
            if not self._points:
                self._prefill = self._prior
        log.info("prefill curve from the probe at start: %.3g ms a token", per_token_s * 1e3)

    def observe_prefill(self, prefix_tokens: int, suffix_tokens: int, seconds: float) -> None:
        """Record one measured prefill; refit the model once the points span enough shapes."""
        if suffix_tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self._points.append((prefix_tokens, suffix_tokens, seconds))
            points = self._anchors + list(self._points)
            suffixes = [s for _, s, _ in points]
            if len(points) >= MIN_FIT_POINTS and len({(p, s) for p, s, _ in points}) >= 3:
                self._prefill = fit_prefill(points)
            else:
                # Two sizes whose times a noisy stretch inverted fit no per-token cost at all,
                # and a curve without one never restores: the scaled curve then stands.
                two = fit_prefill(points, terms=2) if max(suffixes) >= 2 * min(suffixes) else None
                if two is not None and two.per_token_s > 0:
                    self._prefill = two
                else:
                    self._prefill = scale_prefill(self._prior, list(self._points))


def fit_transfer(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(latency_s, bandwidth) fitted to ``points`` (bytes, seconds), oldest first: least squares
    of seconds = latency + bytes / bandwidth, each point weighted TRANSFER_DECAY per newer one.
    None where the sizes do not span TRANSFER_SPAN (a fixed and a per-byte cost cannot be told
    apart) or the larger restores were not the slower (noise: no per-byte cost fits). The
    latency is floored at zero: a negative one would make a restore of one block free."""
    sizes = [b for b, _ in points]
    if len(points) < 4 or max(sizes) < TRANSFER_SPAN * min(sizes):
        return None
    weights = [TRANSFER_DECAY ** (len(points) - 1 - i) for i in range(len(points))]
    total = sum(weights)
    mean_b = sum(w * b for w, (b, _) in zip(weights, points, strict=True)) / total
    mean_s = sum(w * t for w, (_, t) in zip(weights, points, strict=True)) / total
    spread = sum(w * (b - mean_b) ** 2 for w, (b, _) in zip(weights, points, strict=True))
    if spread <= 0:
        return None
    together = sum(w * (b - mean_b) * (t - mean_s) for w, (b, t) in zip(weights, points, strict=True))
    per_byte = together / spread
    latency = mean_s - per_byte * mean_b
    if latency < 0:  # the floor: through the origin, all of it per byte
        latency = 0.0
        per_byte = sum(w * b * t for w, (b, t) in zip(weights, points, strict=True)) / sum(
            w * b * b for w, (b, _) in zip(weights, points, strict=True)
        )
    if not per_byte > 0:
        return None
    return latency, 1.0 / per_byte


def fit_prefill(points: list[tuple[int, int, float]], terms: int = 3) -> PrefillModel:
    """Least-squares fit of (fixed, per_token, per_token_context) to (prefix, suffix, seconds),
    with every coefficient kept non-negative (a negative one would reward longer prompts);
    ``terms=2`` leaves the context term out (too few shapes to tell it from the others)."""
    rows = np.array([[1.0, s, s * (2 * p + s) / 2] for p, s, _ in points])
    times = np.array([t for _, _, t in points])
    active = list(range(terms))
    coef = np.zeros(3)
    while active:
        solution, *_ = np.linalg.lstsq(rows[:, active], times, rcond=None)
        if (solution >= 0).all():
            coef[:] = 0
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return PrefillModel(float(coef[0]), float(coef[1]), float(coef[2]))


def scale_prefill(prior: PrefillModel, points: list[tuple[int, int, float]]) -> PrefillModel:
    """``prior`` with every coefficient multiplied by the median of measured over predicted
    seconds of ``points``: its shape kept, its speed this engine's."""
    ratios = sorted(t / prior.seconds(p, s) for p, s, t in points if prior.seconds(p, s) > 0)
    if not ratios:
        return prior
    r = ratios[len(ratios) // 2]
    return PrefillModel(prior.fixed_s * r, prior.per_token_s * r, prior.per_token_context_s * r)


def _stamp(path: str | Path) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_mtime_ns, info.st_size


def _read(path: str | Path) -> tuple[dict[str, TierCost], PrefillModel, list[tuple[int, int, float]]]:
    doc = json.loads(Path(path).read_text())
    if doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: calibration format {doc.get('version')!r}, expected {FORMAT_VERSION}")
    tiers = {name: TierCost(**fields) for name, fields in doc["tiers"].items()}
    points = [(int(p), int(s), float(t)) for p, s, t in doc.get("prefill_points", [])]
    return tiers, PrefillModel(**doc["prefill"]), points


def _finite(fields: dict[str, float]) -> dict[str, float]:
    """JSON has no infinity: leave an infinite (absent) decode speed out of the file."""
    return {k: v for k, v in fields.items() if np.isfinite(v)}

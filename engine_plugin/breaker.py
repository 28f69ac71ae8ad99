"""A circuit breaker: after a sidecar call fails, stop calling for a while.

A hung or unreachable sidecar costs each call its full deadline; the breaker makes it cost one.

    closed  -- failed() -->  open for backoff_s (first_backoff_s, doubling up to max_backoff_s)
    open    -- the period ends, allow() -->  one call probes (others are refused meanwhile)
    probing -- succeeded() --> closed (the backoff starts over)
            -- failed()    --> open again, for twice as long

Order of calls: ``allow()`` before each call; when it says True, ``succeeded()`` or ``failed()``
after it. A probe that never reports is not fatal: its period ends and another call probes.

Thread rules: none; each connector side owns one and calls it from its own thread. The clock is
injected (``time.monotonic`` by default) so that tests step it instead of sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(
        self,
        first_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < first_backoff_s <= max_backoff_s:
            raise ValueError(
                f"need 0 < first_backoff_s <= max_backoff_s, got {first_backoff_s}, {max_backoff_s}"
            )
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._backoff_s = 0.0  # 0: closed
        self._open_until = 0.0

    @property
    def is_closed(self) -> bool:
        return self._backoff_s == 0.0

    @property
    def backoff_s(self) -> float:
        """The current period (0 while closed)."""
        return self._backoff_s

    def allow(self) -> bool:
        """Whether a call may go to the sidecar now."""
        if self._backoff_s == 0.0:
            return True
        now = self._clock()
        if now < self._open_until:
            return False
        # This call probes; until it reports (or another period passes) the others wait.
        self._open_until = now + self._backoff_s
        return True

    def succeeded(self) -> None:
        self._backoff_s = 0.0
        self._open_until = 0.0

    def failed(self) -> None:
        self._backoff_s = (
            self.first_backoff_s if self._backoff_s == 0.0 else min(self.max_backoff_s, 2 * self._backoff_s)
        )
        self._open_until = self._clock() + self._backoff_s

"""The connector's link to its sidecar: deadlines, the one reconnect, the breaker — on a fake
client and a clock the test steps."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from engine_plugin.breaker import CircuitBreaker
from engine_plugin.sidecar import (
    CONNECT_S,
    DEADLINE_FLOOR_S,
    LOOKUP_CAP_S,
    SidecarLink,
    load_deadline_s,
    lookup_deadline_s,
    save_deadline_s,
)
from kvstore.errors import DeadlineExceeded, LeaseExpired, StoreFull, Unavailable
from tests.service_fixtures import MODEL


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeClient:
    """Records what the link asks of it; ``fail_register`` makes registration raise."""

    def __init__(self, fail_register: Exception | None = None) -> None:
        self.deadlines: list[float] = []
        self.registered: list[object] = []
        self.released: list[int] = []
        self.closed = False
        self._fail_register = fail_register

    @contextlib.contextmanager
    def deadline(self, timeout_s: float) -> Iterator[None]:
        self.deadlines.append(timeout_s)
        yield

    def register(self, identity: object) -> None:
        if self._fail_register is not None:
            raise self._fail_register
        self.registered.append(identity)

    def release(self, lease_id: int, wait: bool = True) -> None:  # as Client.release
        if lease_id == 13:
            raise LeaseExpired("lease 13 expired")
        self.released.append(lease_id)

    def close(self) -> None:
        self.closed = True


class Harness:
    def __init__(self, *clients: FakeClient) -> None:
        self.clients = list(clients)
        self.made: list[FakeClient] = []
        self.unreachable: list[str] = []
        self.clock = Clock()
        self.link = SidecarLink(
            "unix:///fake.sock",
            self._connect,
            [MODEL],
            self.unreachable.append,
            CircuitBreaker(1.0, 30.0, self.clock),
        )

    def _connect(self) -> Any:
        client = self.clients.pop(0) if self.clients else FakeClient()
        self.made.append(client)
        return client


def calls(*outcomes: object) -> tuple[Callable[[Any], object], list[int]]:
    """A call that raises or returns each outcome in turn, and the list counting its runs."""
    runs: list[int] = []

    def fn(kv: Any) -> object:
        runs.append(1)
        outcome = outcomes[min(len(runs), len(outcomes)) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return fn, runs


def test_deadlines_follow_what_the_call_saves() -> None:
    assert lookup_deadline_s(0.001) == DEADLINE_FLOOR_S  # a loaded CI host must not trip it
    assert lookup_deadline_s(0.6) == 0.6
    assert lookup_deadline_s(60.0) == LOOKUP_CAP_S
    assert load_deadline_s(0.01) == DEADLINE_FLOOR_S and load_deadline_s(7.5) == 7.5
    assert save_deadline_s(200_000_000) == pytest.approx(DEADLINE_FLOOR_S + 2.0)


def test_the_first_call_registers_within_its_deadline_plus_the_connect_allowance() -> None:
    h = Harness()
    fn, _ = calls("hit")
    assert h.link.call("lookup", 0.5, fn) == "hit"
    (client,) = h.made
    assert client.registered == [MODEL]
    assert client.deadlines[0] == pytest.approx(0.5 + CONNECT_S, abs=0.05)
    assert h.link.call("lookup", 0.5, fn) == "hit"  # registered: no allowance, no new client
    assert client.deadlines[1] == pytest.approx(0.5, abs=0.05) and len(h.made) == 1


def test_a_timeout_is_not_retried_and_opens_the_breaker() -> None:
    h = Harness()
    fn, runs = calls(DeadlineExceeded("deadline exceeded"), "hit")
    assert h.link.call("lookup", 0.3, fn) is None
    assert len(runs) == 1  # no second wait
    assert h.unreachable == ["lookup"]
    assert not h.made[0].closed  # the channel is sound; the client dropped the data connection
    # Open for 1 s: calls are refused without touching the sidecar, and counted.
    assert h.link.call("load", 0.3, fn) is None and h.link.call("save", 0.3, fn) is None
    assert len(runs) == 1 and h.unreachable == ["lookup", "load", "save"]
    h.clock.now += 1.0
    assert h.link.call("lookup", 0.3, fn) == "hit"  # the probe: back
    assert h.link.breaker.is_closed and len(h.made) == 1


def test_a_broken_connection_is_retried_once_on_a_new_client() -> None:
    h = Harness()
    fn, runs = calls(Unavailable("connection reset"), "hit")
    assert h.link.call("load", 0.3, fn) == "hit"  # the sidecar restarted: reconnected, served
    assert len(runs) == 2 and h.unreachable == []
    first, second = h.made
    assert first.closed and not second.closed
    assert second.registered == [MODEL]  # a new client registers again


def test_a_second_failure_opens_the_breaker() -> None:
    h = Harness()
    fn, runs = calls(Unavailable("refused"), Unavailable("refused"), "hit")
    assert h.link.call("lookup", 0.3, fn) is None
    assert len(runs) == 2 and h.unreachable == ["lookup"] and len(h.made) == 2
    assert not h.link.breaker.is_closed
    h.clock.now += 1.0
    fn_down, _ = calls(DeadlineExceeded("still hung"))
    assert h.link.call("lookup", 0.3, fn_down) is None  # the probe fails: twice as long now
    assert h.link.breaker.backoff_s == 2.0


def test_registration_that_times_out_is_a_failure_and_is_redone() -> None:
    h = Harness(FakeClient(fail_register=DeadlineExceeded("hung")))
    fn, runs = calls("hit")
    assert h.link.call("lookup", 0.3, fn) is None and runs == []
    h.clock.now += 1.0
    h.made[0]._fail_register = None
    assert h.link.call("lookup", 0.3, fn) == "hit"
    assert h.made[0].registered == [MODEL] and len(h.made) == 1


def test_a_refusal_is_an_answer() -> None:
    h = Harness()
    fn, runs = calls(StoreFull("everything is pinned"), "stored")
    assert h.link.call("save", 0.3, fn) is None  # this save is lost ...
    assert h.link.breaker.is_closed and h.unreachable == []  # ... but the sidecar is there
    assert h.link.call("save", 0.3, fn) == "stored" and len(runs) == 2


def test_release_skips_unknown_leases_and_needs_no_new_client() -> None:
    h = Harness()
    h.link.release([1, 2])  # no client yet: nothing of ours is pinned there
    assert h.made == []
    fn, _ = calls("hit")
    h.link.call("lookup", 0.3, fn)
    h.link.release([1, 13, 2])  # 13 expired meanwhile: no error, the others go
    assert h.made[0].released == [1, 2] and h.link.breaker.is_closed
    h.link.close()
    assert h.made[0].closed

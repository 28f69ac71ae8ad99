"""The connector's circuit breaker, on a clock the test steps (no sleeps)."""

from __future__ import annotations

import pytest

from engine_plugin.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_closed_until_a_failure_then_open_for_the_backoff() -> None:
    clock = Clock()
    breaker = CircuitBreaker(1.0, 30.0, clock)
    assert breaker.allow() and breaker.allow()  # closed: every call goes
    breaker.succeeded()
    breaker.failed()  # a timeout: open for 1 s
    assert not breaker.is_closed and breaker.backoff_s == 1.0
    clock.now += 0.99
    assert not breaker.allow()
    clock.now += 0.01
    assert breaker.allow()  # the period is over: this call probes
    assert not breaker.allow()  # the others wait for the probe
    breaker.succeeded()
    assert breaker.is_closed and breaker.allow() and breaker.allow()


def test_failed_probes_double_the_backoff_up_to_the_cap() -> None:
    clock = Clock()
    breaker = CircuitBreaker(1.0, 30.0, clock)
    breaker.failed()
    periods = []
    for _ in range(7):
        clock.now += breaker.backoff_s
        assert breaker.allow()  # the probe
        breaker.failed()  # still down
        periods.append(breaker.backoff_s)
    assert periods == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    clock.now += 29.9
    assert not breaker.allow()
    clock.now += 0.1
    assert breaker.allow()
    breaker.succeeded()  # back: the next failure starts over at 1 s
    breaker.failed()
    assert breaker.backoff_s == 1.0


def test_a_probe_that_never_reports_lets_another_probe_later() -> None:
    clock = Clock()
    breaker = CircuitBreaker(2.0, 8.0, clock)
    breaker.failed()
    clock.now += 2.0
    assert breaker.allow()  # probes, but its outcome is lost
    clock.now += 1.0
    assert not breaker.allow()
    clock.now += 1.0
    assert breaker.allow()  # another period has passed: the next call probes
    assert breaker.backoff_s == 2.0  # no failure was reported: the period did not grow


def test_bad_periods_are_refused() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(0.0, 1.0)
    with pytest.raises(ValueError):
        CircuitBreaker(2.0, 1.0)

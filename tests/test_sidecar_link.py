"""The connector's link to its sidecar: deadlines, the one reconnect, the breaker — on a fake
client and a clock the test steps; and where the sidecar is (address, token, TLS), as both
engine plugins parse it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_plugin.breaker import CircuitBreaker
from engine_plugin.sidecar import (
    CONNECT_S,
    DEADLINE_FLOOR_S,
    LOOKUP_CAP_S,
    SidecarLink,
    SidecarSettings,
    load_deadline_s,
    lookup_deadline_s,
    save_deadline_s,
)
from kvstore.address import TcpAddress, UnixAddress, parse_address
from kvstore.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    LeaseExpired,
    StoreFull,
    Unavailable,
)
from kvstore.tls import ClientTls
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
            UnixAddress("/fake.sock"),
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


# ----------------------------------------------------------------- where the sidecar is

ENV_TOKEN = "env-token-3f9c"


def secret_file(folder: Path, text: str, mode: int) -> Path:
    path = folder / "token"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def test_addresses_are_parsed_once_into_their_kind() -> None:
    assert parse_address("unix:///run/kv.sock") == UnixAddress("/run/kv.sock")
    assert parse_address("10.0.0.7:50051") == TcpAddress("10.0.0.7", 50051)
    assert parse_address("[::1]:9000").target == "[::1]:9000"
    assert UnixAddress("/run/kv.sock").same_host and not TcpAddress("h", 1).same_host
    for bad in ("unix:relative.sock", "unix://relative", "host", "host:0", "host:port", "tcp://h:1", ":80"):
        with pytest.raises(InvalidArgument, match="unix:///absolute/path or host:port"):
            parse_address(bad, "x 'address'")


def test_address_and_token_come_from_the_environment_and_the_config_beats_it() -> None:
    env = {"KVSTORE_ADDRESS": "unix:///env.sock", "KVSTORE_TOKEN": ENV_TOKEN}
    settings = SidecarSettings.parse({}, "cfg", env)
    assert settings.address == UnixAddress("/env.sock") and settings.token == ENV_TOKEN
    assert settings.tls is None
    assert ENV_TOKEN not in repr(settings)  # a traceback or a debug line shows no token
    mine = SidecarSettings.parse({"address": "h:7"}, "cfg", env)
    assert mine.address == TcpAddress("h", 7) and mine.token == ENV_TOKEN
    with pytest.raises(ValueError, match=r"cfg needs 'address'.*\$KVSTORE_ADDRESS"):
        SidecarSettings.parse({}, "cfg", {})


def test_a_token_file_only_its_owner_can_read_is_used(tmp_path: Path) -> None:
    path = secret_file(tmp_path, "file-token-81d2", 0o600)
    settings = SidecarSettings.parse({"address": "h:7", "token_file": str(path)}, "cfg", {})
    assert settings.token == "file-token-81d2"
    by_env = SidecarSettings.parse({"address": "h:7"}, "cfg", {"KVSTORE_TOKEN_FILE": str(path)})
    assert by_env.token == "file-token-81d2"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_token_file_group_or_others_can_read_is_refused_like_ssh_refuses_a_key(
    tmp_path: Path, mode: int
) -> None:
    path = secret_file(tmp_path, "leaked-token-77aa", mode)
    with pytest.raises(FailedPrecondition) as refused:
        SidecarSettings.parse({"address": "h:7", "token_file": str(path)}, "cfg", {})
    message = str(refused.value)
    assert str(path) in message and f"mode {mode:o}" in message and "chmod 600" in message
    assert "leaked-token-77aa" not in message
    with pytest.raises(FailedPrecondition, match=r"\$KVSTORE_TOKEN_FILE"):
        SidecarSettings.parse({"address": "h:7"}, "cfg", {"KVSTORE_TOKEN_FILE": str(path)})


def test_a_missing_or_empty_token_file_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match=r"cfg 'token_file' .*nope"):
        SidecarSettings.parse({"address": "h:7", "token_file": str(tmp_path / "nope")}, "cfg", {})
    empty = secret_file(tmp_path, "", 0o600)
    with pytest.raises(FailedPrecondition, match="is empty"):
        SidecarSettings.parse({"address": "h:7", "token_file": str(empty)}, "cfg", {})


def test_a_token_in_the_config_works_with_a_warning_that_the_engine_logs_it(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    with caplog.at_level(logging.WARNING):
        settings = SidecarSettings.parse({"address": "h:7", "token": "cfg-token-5e"}, "cfg", {})
    assert settings.token == "cfg-token-5e"
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "writes its configuration" in warning.getMessage() and "$KVSTORE_TOKEN" in warning.getMessage()
    assert "cfg-token-5e" not in caplog.text
    path = secret_file(tmp_path, "file-token", 0o600)
    with pytest.raises(ValueError, match="both 'token' and 'token_file'"):
        SidecarSettings.parse({"address": "h:7", "token": "x", "token_file": str(path)}, "cfg", {})


def test_tls_is_for_tcp_and_defaults_to_the_commands_environment() -> None:
    env = {"KVSTORE_TLS_CA": "/ca.pem", "KVSTORE_TLS_CERT": "/c.pem", "KVSTORE_TLS_KEY": "/k.pem"}
    tcp = SidecarSettings.parse({"address": "h:7"}, "cfg", env)
    assert tcp.tls == ClientTls("/ca.pem", "/c.pem", "/k.pem")
    mine = SidecarSettings.parse({"address": "h:7", "tls_ca_file": "/mine.pem"}, "cfg", env)
    assert mine.tls is not None and mine.tls.ca_file == "/mine.pem"
    assert SidecarSettings.parse({"address": "unix:///s.sock"}, "cfg", env).tls is None  # plain socket

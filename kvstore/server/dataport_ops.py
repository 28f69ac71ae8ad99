"""The data port's operations (``kvstore.wire``'s opcodes), each served over the data plane once
its connection's hello is past: the request read, the plane asked, the answer sent. A caller who
hung up while the store worked is freed of what it was about to be handed (a lease released, a
reservation aborted). The connections themselves (accepting, the hello, the loop and the workers
that bring each request here) are ``kvstore.server.dataport``'s; the head request is
``kvstore.server.head_op``'s."""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
from dataclasses import dataclass, field

from kvstore import wire
from kvstore.errors import FailedPrecondition, InvalidArgument, KvStoreError
from kvstore.keys import BlockKey
from kvstore.server.auth import Caller
from kvstore.server.dataplane import DataPlane
from kvstore.server.head_op import serve_heads
from kvstore.store import Scope
from kvstore.stream import Stream
from kvstore.wire import (
    BLOCKS_END,
    OK_FRAME,
    OP_ABORT,
    OP_COMMIT,
    OP_GET,
    OP_LEASE_HELD,
    OP_LOOKUP,
    OP_LOOKUP_SLOTS,
    OP_PUT,
    OP_RELEASE,
    OP_RELEASE_NOWAIT,
    OP_RESERVE,
    OP_RESOLVE,
    read_id,
    read_keys,
    read_ttl,
)

log = logging.getLogger(__name__)

MAX_BLOCKS_PER_REQUEST = 65536
MAX_TRACKED_RESERVATIONS = 64  # per connection, for the spin between a write's chunks


@dataclass
class Session:
    """What a connection's hello established, for each of its requests."""

    caller: Caller
    namespace: str
    peer: str  # for the log
    reserved: set[int] = field(default_factory=set)  # reservations granted here, not committed or aborted


class AnswerCut(Exception):
    """A failure after an answer's blocks began: no status frame can follow, only the close."""


def serve_op(op: int, stream: Stream, session: Session, plane: DataPlane) -> None:
    """Serve one request whose operation ``op`` has been read; the rest of it is read here."""
    if op == OP_LOOKUP:
        _lookup(stream, session, plane)
    elif op == OP_LOOKUP_SLOTS:
        _lookup(stream, session, plane, slots=True)
    elif op == OP_LEASE_HELD:
        lease_id = read_id(stream.read)
        stream.send(wire.held_answer(plane.lease_held(session.caller, lease_id)))
    elif op == OP_RESOLVE:
        _resolve(stream, session, plane)
    elif op == OP_RELEASE:
        plane.release(session.caller, read_id(stream.read))
        stream.send(OK_FRAME)
    elif op == OP_RELEASE_NOWAIT:  # no answer: nothing to fail the connection for
        lease_id = read_id(stream.read)
        try:
            plane.release(session.caller, lease_id)
        except KvStoreError as exc:
            log.debug("a release without answer of lease %d: %s", lease_id, exc)
    elif op == OP_RESERVE:
        _reserve(stream, session, plane)
    elif op == OP_COMMIT:
        reservation_id = read_id(stream.read)
        checksums = wire.read_commit_tail(stream.read, MAX_BLOCKS_PER_REQUEST)
        session.reserved.discard(reservation_id)
        stream.send(wire.stored_answer(plane.commit(session.caller, reservation_id, checksums)))
    elif op == OP_ABORT:
        reservation_id = read_id(stream.read)
        session.reserved.discard(reservation_id)
        plane.abort(session.caller, reservation_id)
        stream.send(OK_FRAME)
    elif op == OP_GET:
        _get(stream, session, plane)
    elif op == OP_PUT:
        _put(stream, session, plane)
    elif op == wire.OP_HEAD:
        serve_heads(stream, plane, session.namespace, MAX_BLOCKS_PER_REQUEST)
    else:
        raise InvalidArgument(f"unknown data port operation {op}")


def _resolve(stream: Stream, session: Session, plane: DataPlane) -> None:
    """Same-host restore: arena slots of the present prefix, pinned under a lease."""
    fingerprint, keys = read_keys(stream.read, MAX_BLOCKS_PER_REQUEST)
    ttl_s = read_ttl(stream.read)
    if stream.sock.family != socket.AF_UNIX:
        raise FailedPrecondition("resolve hands out arena slots: same-host clients on the Unix socket only")
    scope = Scope(session.namespace, fingerprint)
    resolved = plane.resolve(session.caller, scope, keys, ttl_s if ttl_s > 0 else None)
    name = plane.arena().arena.name.encode()
    lease_id = resolved.lease.lease_id if resolved.lease else 0
    answer = wire.resolve_answer(name, resolved.slots, resolved.tiers, lease_id)
    if resolved.lease is not None and _caller_left(stream, session, plane, lease_id):
        return
    stream.send(answer)


def _caller_left(stream: Stream, session: Session, plane: DataPlane, lease_id: int) -> bool:
    """Whether the client hung up while the store worked: its deadline passed (a client
    closes a connection whose call failed), say while a restore promoted blocks from a slow
    tier. It never learns the lease, so it can release nothing, and the pins would hold the
    blocks in place, against eviction and demotion, until their TTL. Release them now; the
    session ends at its next read."""
    gone = _gone(stream)
    if gone:
        with contextlib.suppress(KvStoreError):  # it expired meanwhile: nothing left to free
            plane.release(session.caller, lease_id)
        log.info("a caller left before its answer (its deadline passed): lease %d released", lease_id)
    return gone


def _reserve(stream: Stream, session: Session, plane: DataPlane) -> None:
    """Same-host store: arena slots to fill in place, then ``commit`` (or ``abort``)."""
    fingerprint, keys = read_keys(stream.read, MAX_BLOCKS_PER_REQUEST)
    parent, ttl_s, sizes = wire.read_reserve_tail(stream.read, len(keys))
    if stream.sock.family != socket.AF_UNIX:
        raise FailedPrecondition("reserve hands out arena slots: same-host clients on the Unix socket only")
    scope = Scope(session.namespace, fingerprint)
    reservation = plane.reserve(session.caller, scope, keys, sizes, parent, ttl_s if ttl_s > 0 else None)
    if _gone(stream):  # its deadline passed while the store made room: nobody will commit
        with contextlib.suppress(KvStoreError):
            plane.abort(session.caller, reservation.reservation_id)
        log.info("a caller left before its answer: reservation %d aborted", reservation.reservation_id)
        return
    if len(session.reserved) < MAX_TRACKED_RESERVATIONS:  # the rest run out with their lease
        session.reserved.add(reservation.reservation_id)
    name = plane.arena().arena.name.encode()
    stream.send(wire.reserve_answer(name, reservation.reservation_id, reservation.slots))


def _lookup(stream: Stream, session: Session, plane: DataPlane, slots: bool = False) -> None:
    """A lookup; ``slots``: also where each pinned hit lies in the arena (Unix socket only)."""
    fingerprint, keys = read_keys(stream.read, MAX_BLOCKS_PER_REQUEST)
    pin_ttl_s = read_ttl(stream.read)
    if slots and stream.sock.family != socket.AF_UNIX:
        raise FailedPrecondition("arena slots are for same-host clients on the Unix socket only")
    scope = Scope(session.namespace, fingerprint)
    result = plane.lookup(session.caller, scope, keys, pin_ttl_s if pin_ttl_s > 0 else None, slots=slots)
    lease_id = result.lease.lease_id if result.lease else 0
    if lease_id and _caller_left(stream, session, plane, lease_id):
        return
    if not slots:
        stream.send(wire.lookup_answer(result.hit_blocks, result.tiers, lease_id))
        return
    name = plane.arena().arena.name.encode() if result.slots else b""
    stream.send(wire.lookup_answer(result.hit_blocks, result.tiers, lease_id, result.slots, name))


def _get(stream: Stream, session: Session, plane: DataPlane) -> None:
    fingerprint, keys = read_keys(stream.read, MAX_BLOCKS_PER_REQUEST)
    scope = Scope(session.namespace, fingerprint)
    plane.arena()
    stream.send(OK_FRAME)  # from here on a failure can only close the connection

    def send(key: BlockKey, payload: memoryview, checksum: int) -> None:  # out of the pinned slot
        stream.send_parts(wire.block_head(len(payload), checksum), payload)

    try:
        for _ in plane.read(session.caller, scope, keys, send):
            pass
    except Exception as exc:
        # A status frame here would be read as the next block's size (a client once took an
        # error's bytes for a block of petabytes): the connection ends instead, which the
        # client reads as the answer cut short.
        raise AnswerCut(f"a get ended after its blocks began: {exc!r}") from exc
    stream.send(BLOCKS_END)


def _put(stream: Stream, session: Session, plane: DataPlane) -> None:
    fingerprint, parent, keys, sizes = wire.read_put_head(stream.read, MAX_BLOCKS_PER_REQUEST)
    scope = Scope(session.namespace, fingerprint)
    stored = plane.write(session.caller, scope, parent, keys, sizes, lambda i, view: stream.read_into(view))
    stream.send(wire.stored_answer(stored))


def _gone(stream: Stream) -> bool:
    """Whether the client's end is closed, without waiting: readable with nothing to read (a
    pipelined next request would be bytes to peek at). Never under TLS: no peeking there (the
    same-host calls that ask are never on TLS)."""
    conn = stream.sock
    if isinstance(conn, ssl.SSLSocket):
        return False
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True

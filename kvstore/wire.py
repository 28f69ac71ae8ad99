"""The data port's protocol, defined once: every message's opcode and layout, and the functions
both ends encode and decode them with (``kvstore.server.dataport``, ``dataport_ops`` and ``answering`` serve it,
``kvstore.client.dataport`` speaks it, through a ``kvstore.stream.Stream``). No other module
packs or unpacks these bytes (``tests/test_wire.py`` checks it, and round-trips every message).

Framing (little-endian), one request at a time per connection:

    hello    client: b"KVD3" u16 len + bearer token, u16 len + scope   server: status
    resolve  client: u8 4, fingerprint[32], u32 n, n x key[32], f64 ttl_s      (Unix socket only)
             server: status, u16 len + arena name, u32 hit, hit x (u64 offset, u64 size, u8 tier),
                     u64 lease id
    release  client: u8 5, u64 lease id                                       server: status
             (u8 9, u64 lease id: the same without an answer; a lease the server cannot
             release, expired or unknown, is ignored)
    reserve  client: u8 6, fingerprint[32], u32 n, n x key[32], u8 has_parent, parent[32],
                     f64 ttl_s, n x u64 size                                  (Unix socket only)
             server: status, u16 len + arena name, u64 reservation id,
                     n x (u8 present, u64 offset, u64 size)
    commit   client: u8 7, u64 reservation id, u32 n, n x u64 xxh3-64 of each given slot's
                     block in order (n 0: none taken; the server hashes them)  server: status, u32 stored
    abort    client: u8 8, u64 reservation id                                 server: status
    lookup   client: u8 3, fingerprint[32], u32 n, n x key[32], f64 pin_ttl_s
             server: status, u32 hit, hit x u8 tier (1 hbm, 2 dram, 3 nvme, 4 remote), u64 lease id
    lookup with slots (Unix socket only): client as lookup, with u8 10
             server: status, u32 hit, hit x u8 tier, u64 lease id, u16 len + arena name,
                     hit x (u64 offset, u64 size): the slot of each pinned hit the arena holds
                     (size 0: none; the reader copies the rest through resolve)
    lease held  client: u8 11, u64 lease id             server: status, u8 1 held / 0 not
    get      client: u8 1, fingerprint[32], u32 n, n x key[32]
             server: status; per block of the present prefix: u64 size, u64 xxh3-64 of the
                     bytes (checked by the server before it sends them, by the client after it
                     receives them), the bytes; u64 END; status
    put      client: u8 2, fingerprint[32], u8 has_parent, parent[32], u32 n, n x (key[32], u64 size),
                     then the n payloads back to back
             server: status, u32 stored
    head     client: u8 12, fingerprint[32], u32 n, n x key[32], u32 head_bytes (<= MAX_HEAD_BYTES)
             server: status, u32 hit, hit x u32 length, the hit heads back to back: the first
                     head_bytes (or fewer: a shorter block) of each block of the present prefix
    status   u8 gRPC status code (0 = OK, ``kvstore.status.Status``), u32 len + UTF-8 message

A request that fails is answered with its status and the connection closes. The message of a
failure starts with its detail in brackets, ``[LeaseExpired] lease 7 expired ...``: the name of
the error class the server raised (``kvstore.status``), which the client raises again. A client
that knows no details reads the code alone, as before, and shows the bracket as part of the text.

Encoders return the bytes of a whole message (an answer's with its OK status in front), for one
send. Decoders read a message's fields after its first byte (the op, or the status the reader
checked) through ``read(n)``, a ``Stream.read``: a few reads of fixed parts, so a small message
is parsed from the one recv that brought it.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from struct import Struct
from typing import Protocol, cast

from kvstore.errors import InvalidArgument, KvStoreError
from kvstore.keys import BlockKey, Fingerprint
from kvstore.status import Status, error_for, status_of
from kvstore.stream import Stream, recv_exact

MAGIC = b"KVD3"  # 2: a get's blocks carry their checksum; 3: a commit, its blocks' checksums
OP_GET, OP_PUT, OP_LOOKUP, OP_RESOLVE, OP_RELEASE = 1, 2, 3, 4, 5
OP_RESERVE, OP_COMMIT, OP_ABORT, OP_RELEASE_NOWAIT = 6, 7, 8, 9
OP_LOOKUP_SLOTS, OP_LEASE_HELD, OP_HEAD = 10, 11, 12
OP_NAMES = {
    OP_GET: "Get",
    OP_PUT: "Put",
    OP_LOOKUP: "Lookup",
    OP_LOOKUP_SLOTS: "Lookup",
    OP_LEASE_HELD: "LeaseHeld",
    OP_RESOLVE: "Resolve",
    OP_RELEASE: "Release",
    OP_RELEASE_NOWAIT: "Release",
    OP_RESERVE: "Reserve",
    OP_COMMIT: "Commit",
    OP_ABORT: "Abort",
    OP_HEAD: "Heads",
}
KEYS_OPS = frozenset((OP_GET, OP_LOOKUP, OP_LOOKUP_SLOTS, OP_RESOLVE))  # keys_request's
ID_OPS = frozenset((OP_RELEASE, OP_RELEASE_NOWAIT, OP_LEASE_HELD, OP_ABORT))  # id_request's
TIER_CODES = {"hbm": 1, "dram": 2, "nvme": 3, "remote": 4}  # the Tier enum of the proto
TIER_NAMES = {v: k for k, v in TIER_CODES.items()}
END = (1 << 64) - 1  # the size that ends a get's blocks
IDLE_S = 600.0  # the server closes a connection idle between requests longer than this
KEY_BYTES = 32  # a key, a fingerprint, a parent: no length on the wire
MAX_HEAD_BYTES = 4096  # a head asks at most this of each block (a remote value's header is 71)

# Every layout, once. A request's op byte comes first and is read alone by the server.
STATUS = Struct("<BI")  # code, message length; the UTF-8 message follows
OK_FRAME = STATUS.pack(Status.OK, 0)  # the usual answer's start: OK, no message
LENGTH = Struct("<H")  # a hello's token or scope, an arena's name: its length, then its bytes
KEYS_HEAD = Struct("<32sI")  # fingerprint, key count; the keys follow, then the op's tail
TTL = Struct("<d")  # the tail of a lookup or resolve: ttl_s (0: none)
RESERVE_TAIL = Struct("<B32sd")  # has parent, parent, ttl_s; a u64 size per key follows
ID = Struct("<Q")  # a lease or reservation id
COUNT = Struct("<I")  # hit blocks; stored blocks
RESOLVED = Struct("<QQB")  # offset, size, tier code
RESERVED = Struct("<BQQ")  # given, offset, size (all 0: no slot, nothing to write)
PLACE = Struct("<QQ")  # offset, size in the arena (all 0: none)
BLOCK_HEAD = Struct("<QQ")  # size, xxh3-64 of the bytes; a size of END alone ends the blocks
SIZE = Struct("<Q")
PUT_HEAD = Struct("<32sB32sI")  # fingerprint, has parent, parent, key count
PUT_RECORD = Struct("<32sQ")  # key, size: one per block, before the payloads

_OP_KEYS_HEAD = Struct("<B" + KEYS_HEAD.format[1:])
_OP_ID = Struct("<B" + ID.format[1:])
_OP_PUT_HEAD = Struct("<B" + PUT_HEAD.format[1:])
_ID_LENGTH = Struct("<" + ID.format[1:] + LENGTH.format[1:])  # a lookup's lease id, then the name
_NO_SLOT = RESERVED.pack(0, 0, 0)
_NO_PLACE = PLACE.pack(0, 0)
BLOCKS_END = SIZE.pack(END) + OK_FRAME  # after a get's last block

Read = Callable[[int], bytes]  # ``Stream.read``: exactly n bytes
MalformedMessage = struct.error  # what a decoder raises on bytes that fit no layout


class Place(Protocol):
    """A slot in the arena, as an answer names it."""

    @property
    def offset(self) -> int: ...

    @property
    def size_bytes(self) -> int: ...


# ------------------------------------------------------------------ status frames


def error_frame(error: KvStoreError) -> bytes:
    """The status frame of a failure: its code and, before its message, its detail."""
    code, detail = status_of(error)
    body = f"[{detail}] {error}".encode()
    return STATUS.pack(code, len(body)) + body


def send_error(sock: socket.socket, error: KvStoreError) -> None:
    sock.sendall(error_frame(error))


def read_status(sock: socket.socket, deadline: float | None = None) -> tuple[int, str]:
    """The code (a ``Status`` number) and message of a status frame, the detail left in."""
    code, length = STATUS.unpack(recv_exact(sock, STATUS.size, deadline))
    return code, recv_exact(sock, length, deadline).decode(errors="replace")


def read_stream_status(stream: Stream) -> tuple[int, str]:
    """``read_status`` through a stream's buffer."""
    frame = stream.read(STATUS.size)
    if frame == OK_FRAME:  # the usual answer: one compare, nothing unpacked
        return Status.OK, ""
    code, length = STATUS.unpack(frame)
    return code, stream.read(length).decode(errors="replace") if length else ""


def status_error(code: int, message: str) -> KvStoreError:
    """The exception for a failed status frame: the detail taken off the message."""
    detail, sep, rest = message[1:].partition("] ") if message.startswith("[") else ("", "", "")
    if sep and detail.isidentifier():
        return error_for(code, rest, detail)
    return error_for(code, message)


# ------------------------------------------------------------------ requests: the client encodes


def check_ids(fingerprint: bytes, keys: Sequence[bytes]) -> None:
    """The framing has no lengths for ids: refuse a wrong one before it desynchronizes the stream."""
    if len(fingerprint) != KEY_BYTES or not set(map(len, keys)) <= {KEY_BYTES}:
        raise InvalidArgument("keys and fingerprints are 32 bytes")


def hello(token: bytes, scope: bytes) -> bytes:
    return b"".join([MAGIC, LENGTH.pack(len(token)), token, LENGTH.pack(len(scope)), scope])


def keys_request(op: int, fingerprint: bytes, keys: Sequence[bytes], ttl_s: float | None = None) -> bytes:
    """A get (no ``ttl_s``), a lookup, a lookup with slots (``ttl_s``: the pin's) or a resolve."""
    check_ids(fingerprint, keys)
    head = _OP_KEYS_HEAD.pack(op, fingerprint, len(keys))
    return b"".join([head, *keys] if ttl_s is None else [head, *keys, TTL.pack(ttl_s)])


def reserve_request(
    fingerprint: bytes, keys: Sequence[bytes], sizes: Sequence[int], parent: bytes | None, ttl_s: float
) -> bytes:
    if len(sizes) != len(keys):
        raise InvalidArgument(f"{len(sizes)} sizes for {len(keys)} keys")
    if parent is not None and len(parent) != KEY_BYTES:
        raise InvalidArgument("parent must be a 32-byte key")
    check_ids(fingerprint, keys)
    tail = RESERVE_TAIL.pack(parent is not None, parent or bytes(KEY_BYTES), ttl_s) + _u64s(len(sizes)).pack(
        *sizes
    )
    return b"".join([_OP_KEYS_HEAD.pack(OP_RESERVE, fingerprint, len(keys)), *keys, tail])


def id_request(op: int, id_: int) -> bytes:
    """A release (answered or not), a lease check or an abort."""
    return _OP_ID.pack(op, id_)


def lookup_slots_request(fingerprint: bytes, keys: Sequence[bytes], pin_ttl_s: float) -> bytes:
    """A pinning lookup that names the arena slots of its hits (answered by its own layout)."""
    return keys_request(OP_LOOKUP_SLOTS, fingerprint, keys, pin_ttl_s)


def commit_request(reservation_id: int, checksums: Sequence[int] = ()) -> bytes:
    """A commit, with the xxh3-64 of each block the writer copied into its given slots (or none)."""
    return (
        _OP_ID.pack(OP_COMMIT, reservation_id)
        + COUNT.pack(len(checksums))
        + _u64s(len(checksums)).pack(*checksums)
    )


def release_request(lease_id: int) -> bytes:
    """A release the server does not answer."""
    return _OP_ID.pack(OP_RELEASE_NOWAIT, lease_id)


def head_request(fingerprint: bytes, keys: Sequence[bytes], head_bytes: int) -> bytes:
    """The first ``head_bytes`` of each block of the present prefix of ``keys``."""
    check_ids(fingerprint, keys)
    if not 0 <= head_bytes <= MAX_HEAD_BYTES:
        raise InvalidArgument(f"a head asks 0 to {MAX_HEAD_BYTES} bytes of a block, got {head_bytes}")
    return b"".join([_OP_KEYS_HEAD.pack(OP_HEAD, fingerprint, len(keys)), *keys, COUNT.pack(head_bytes)])


def put_head(fingerprint: bytes, keys: Sequence[bytes], sizes: Sequence[int], parent: bytes | None) -> bytes:
    """A put up to its payloads, which follow back to back."""
    check_ids(fingerprint, keys if parent is None else [*keys, parent])
    head = [_OP_PUT_HEAD.pack(OP_PUT, fingerprint, parent is not None, parent or b"", len(keys))]
    head.extend(PUT_RECORD.pack(key, size) for key, size in zip(keys, sizes, strict=True))
    return b"".join(head)


# ------------------------------------------------------------------ requests: the server decodes


def read_op(read: Read) -> int:
    """A request's first byte."""
    return read(1)[0]


def read_hello(read: Read) -> tuple[str, str]:
    """(token, scope) of a hello, its magic first."""
    if read(len(MAGIC)) != MAGIC:
        raise InvalidArgument("not a kvstore data port client (bad magic)")
    (token_len,) = LENGTH.unpack(read(LENGTH.size))
    token = read(token_len).decode(errors="replace")
    (scope_len,) = LENGTH.unpack(read(LENGTH.size))
    return token, read(scope_len).decode(errors="replace")


def read_keys(read: Read, max_keys: int) -> tuple[Fingerprint, list[BlockKey]]:
    """The fingerprint and keys of a ``keys_request`` or ``reserve_request``: each key a slice
    of the one read of them all."""
    fingerprint, n = KEYS_HEAD.unpack(read(KEYS_HEAD.size))
    if n > max_keys:
        raise InvalidArgument(f"at most {max_keys} blocks per request, got {n}")
    return Fingerprint(fingerprint), _split_keys(read(KEY_BYTES * n), n)


def read_ttl(read: Read) -> float:
    ttl_s: float = TTL.unpack(read(TTL.size))[0]
    return ttl_s


def read_head_bytes(read: Read) -> int:
    """What a head asks of each block, after its keys."""
    head_bytes: int = COUNT.unpack(read(COUNT.size))[0]
    if head_bytes > MAX_HEAD_BYTES:
        raise InvalidArgument(f"a head asks at most {MAX_HEAD_BYTES} bytes of a block, got {head_bytes}")
    return head_bytes


def read_reserve_tail(read: Read, n_keys: int) -> tuple[BlockKey | None, float, list[int]]:
    """(parent, ttl_s, sizes) after a reserve's keys."""
    has_parent, parent, ttl_s = RESERVE_TAIL.unpack(read(RESERVE_TAIL.size))
    sizes = list(_u64s(n_keys).unpack(read(SIZE.size * n_keys)))
    return (BlockKey(parent) if has_parent else None), ttl_s, sizes


def read_id(read: Read) -> int:
    id_: int = ID.unpack(read(ID.size))[0]
    return id_


def read_commit_tail(read: Read, max_keys: int) -> list[int]:
    """The checksums after a commit's reservation id (``read_id``): one per given slot, or none."""
    (n,) = COUNT.unpack(read(COUNT.size))
    if n > max_keys:
        raise InvalidArgument(f"at most {max_keys} blocks per request, got {n} checksums")
    return list(_u64s(n).unpack(read(SIZE.size * n))) if n else []


def read_put_head(
    read: Read, max_keys: int
) -> tuple[Fingerprint, BlockKey | None, list[BlockKey], list[int]]:
    """(fingerprint, parent, keys, sizes) of a put, up to its payloads."""
    fingerprint, has_parent, parent, n = PUT_HEAD.unpack(read(PUT_HEAD.size))
    if n > max_keys:
        raise InvalidArgument(f"at most {max_keys} blocks per request, got {n}")
    fields = _records(PUT_RECORD.format[1:], read(PUT_RECORD.size * n), n)  # key, size, key, ...
    keys = cast(list[BlockKey], list(fields[0::2]))
    return Fingerprint(fingerprint), (BlockKey(parent) if has_parent else None), keys, list(fields[1::2])


def small_request_size(buffered: memoryview) -> int:
    """The size of the ``id_request`` or lookup (``keys_request`` with a pin) at the front of
    ``buffered``; -1 when more bytes must come to know."""
    if buffered[0] in ID_OPS:
        return _OP_ID.size
    if len(buffered) < _OP_KEYS_HEAD.size:
        return -1
    n: int = COUNT.unpack_from(buffered, _OP_KEYS_HEAD.size - COUNT.size)[0]
    return _OP_KEYS_HEAD.size + KEY_BYTES * n + TTL.size


# ------------------------------------------------------------------ answers: the server encodes


def resolve_answer(name: bytes, slots: Sequence[Place], tiers: Sequence[str], lease_id: int) -> bytes:
    body = [OK_FRAME, LENGTH.pack(len(name)), name, COUNT.pack(len(slots))]
    body.extend(
        RESOLVED.pack(slot.offset, slot.size_bytes, TIER_CODES[tier])
        for slot, tier in zip(slots, tiers, strict=True)
    )
    body.append(ID.pack(lease_id))
    return b"".join(body)


def reserve_answer(name: bytes, reservation_id: int, slots: Iterable[Place | None]) -> bytes:
    body = [OK_FRAME, LENGTH.pack(len(name)), name, ID.pack(reservation_id)]
    body.extend(_NO_SLOT if s is None else RESERVED.pack(1, s.offset, s.size_bytes) for s in slots)
    return b"".join(body)


def stored_answer(stored: int) -> bytes:
    """A commit's or a put's: how many blocks it stored."""
    return OK_FRAME + COUNT.pack(stored)


def lookup_answer(
    hit: int,
    tiers: Sequence[str],
    lease_id: int,
    slots: Sequence[Place | None] | None = None,
    name: bytes = b"",
) -> bytes:
    """A lookup's; with ``slots`` (one per hit at most, the rest none), a lookup with slots'."""
    codes = bytes([TIER_CODES[t] for t in tiers])
    body = [OK_FRAME, COUNT.pack(hit), codes, ID.pack(lease_id)]
    if slots is not None:
        body += [LENGTH.pack(len(name)), name]
        body.extend(_NO_PLACE if s is None else PLACE.pack(s.offset, s.size_bytes) for s in slots)
        body.append(_NO_PLACE * (hit - len(slots)))
    return b"".join(body)


def heads_answer(heads: Sequence[bytes | memoryview]) -> bytes:
    """A head's: each block's first bytes, their lengths first."""
    lengths = _lengths(len(heads)).pack(*map(len, heads))
    return b"".join([OK_FRAME, COUNT.pack(len(heads)), lengths, *heads])


def held_answer(held: bool) -> bytes:
    return OK_FRAME + bytes([held])


def block_head(size: int, checksum: int) -> bytes:
    """Before each block of a get's answer (its status went first; ``BLOCKS_END`` after them)."""
    return BLOCK_HEAD.pack(size, checksum)


# ------------------------------------------------------------------ answers: the client decodes
# (each after the answer's status, which the reader checked)


def read_resolve_answer(read: Read) -> tuple[str, list[tuple[int, int]], tuple[str, ...], int]:
    """(arena name, (offset, size) of each block of the present prefix, their tiers, lease id)."""
    (name_len,) = LENGTH.unpack(read(LENGTH.size))
    name = read(name_len).decode()
    (hit,) = COUNT.unpack(read(COUNT.size))
    raw = read(RESOLVED.size * hit + ID.size)
    slots, tiers = [], []
    for offset, size, tier in RESOLVED.iter_unpack(raw[: RESOLVED.size * hit]):
        slots.append((offset, size))
        tiers.append(TIER_NAMES.get(tier, "unknown"))
    (lease_id,) = ID.unpack_from(raw, RESOLVED.size * hit)
    return name, slots, tuple(tiers), int(lease_id)


def read_reserve_answer(
    read: Read, n_keys: int
) -> tuple[str, int, Sequence[int], Sequence[int], Sequence[int]]:
    """(arena name, reservation id, and per key: given (0: no slot), offset, size)."""
    (name_len,) = LENGTH.unpack(read(LENGTH.size))
    raw = read(name_len + ID.size + RESERVED.size * n_keys)  # name, id and records: one read
    (reservation_id,) = ID.unpack_from(raw, name_len)
    fields = _records(RESERVED.format[1:], raw, n_keys, name_len + ID.size)
    return raw[:name_len].decode(), int(reservation_id), fields[0::3], fields[1::3], fields[2::3]


def read_stored(read: Read) -> int:
    stored: int = COUNT.unpack(read(COUNT.size))[0]
    return stored


def read_lookup_answer(read: Read) -> tuple[int, bytes, int]:
    """(hit blocks, the tier code of each hit (``TIER_NAMES``), lease id or 0)."""
    (hit,) = COUNT.unpack(read(COUNT.size))
    tiers = read(hit)
    (lease_id,) = ID.unpack(read(ID.size))
    return hit, tiers, lease_id


def read_lookup_slots_answer(read: Read) -> tuple[int, bytes, int, str, Sequence[int], Sequence[int]]:
    """(hit, tier codes, lease id, arena name, and per hit: offset, size (0: no slot))."""
    (hit,) = COUNT.unpack(read(COUNT.size))
    tiers = read(hit)
    lease_id, name_len = _ID_LENGTH.unpack(read(_ID_LENGTH.size))
    name = read(name_len).decode()
    fields = _records(PLACE.format[1:], read(PLACE.size * hit), hit)
    return hit, tiers, lease_id, name, fields[0::2], fields[1::2]


def read_heads_answer(read: Read) -> list[bytes]:
    """The first bytes of each block of the present prefix (a ``heads_answer``)."""
    (hit,) = COUNT.unpack(read(COUNT.size))
    lengths = _lengths(hit).unpack(read(COUNT.size * hit))
    raw = memoryview(read(sum(lengths)))
    out, at = [], 0
    for n in lengths:
        out.append(bytes(raw[at : at + n]))
        at += n
    return out


def read_held(read: Read) -> bool:
    return bool(read(1)[0])


def read_block_head(read: Read) -> tuple[int, int] | None:
    """(size, checksum) of a get's next block, or None after its last (its status follows)."""
    (size,) = SIZE.unpack(read(SIZE.size))
    if size == END:
        return None
    (checksum,) = SIZE.unpack(read(SIZE.size))
    return size, checksum


# ------------------------------------------------------------------ many records in one call

RECORDS_PER_STRUCT = 1024  # records are unpacked by cached structs of up to this many


def _records(fields: str, raw: bytes, count: int, start: int = 0) -> Sequence[int]:
    """The fields of ``count`` little-endian records of ``fields`` in ``raw`` from ``start``, in
    order: one unpack per RECORDS_PER_STRUCT records (~1 us for 32 where ``iter_unpack`` and a
    tuple a record took ~3)."""
    if count <= RECORDS_PER_STRUCT:
        return _repeated(fields, count).unpack_from(raw, start)
    out: list[int] = []
    record = struct.calcsize("<" + fields)
    for first in range(0, count, RECORDS_PER_STRUCT):
        n = min(RECORDS_PER_STRUCT, count - first)
        out.extend(_repeated(fields, n).unpack_from(raw, start + first * record))
    return out


def _split_keys(raw: bytes, n: int) -> list[BlockKey]:
    """The ``n`` keys of ``raw``: in one C call for the usual request (a lookup's keys are most
    of its work on the server), by slicing for a huge one."""
    if n <= RECORDS_PER_STRUCT:
        return list(_repeated("32s", n).unpack(raw))
    return [BlockKey(raw[i : i + KEY_BYTES]) for i in range(0, KEY_BYTES * n, KEY_BYTES)]


@lru_cache(maxsize=128)  # each at most ~100 KiB
def _repeated(fields: str, count: int) -> Struct:
    return Struct("<" + fields * count)


@lru_cache(maxsize=128)
def _u64s(count: int) -> Struct:
    """``count`` u64s in a row (sizes, checksums): one field with a repeat count, small however many."""
    return Struct(f"<{count}{SIZE.format[1:]}")


@lru_cache(maxsize=128)
def _lengths(count: int) -> Struct:
    """``count`` u32 lengths in a row: a head's answer."""
    return Struct(f"<{count}{COUNT.format[1:]}")

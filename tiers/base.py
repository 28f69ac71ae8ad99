"""The contract every storage tier keeps.

A tier stores opaque keys (``TierKey``, at most ``MAX_KEY_BYTES``) mapped to payload bytes plus
the fingerprint id of the model that produced them. It knows nothing of tenants, chains or
eviction policy: the tiered store above decides what lives where and tells the tier.

Calls:
    can_store(size)      -> whether put() of that size would succeed now, without evicting
    put(key, payload, fp, meta)
                          stores a copy of ``payload`` with the caller's ``meta`` (at most
                          MAX_META_BYTES, returned by scan()); overwrites an existing key.
                          Raises TierFull (evict, then retry) or BlockTooLarge (never fits).
    get_into(key, out)   -> bytes written into ``out`` (a writable buffer at least as long as
                          the payload), or None for a miss. A block failing its checksum is
                          deleted, counted in ``usage().checksum_failures`` and is a miss.
    size_of(key)         -> payload length in bytes, or None for a miss.
    delete(key)          -> whether the key was present.
    scan()               -> every stored block (key, fingerprint, size); how the store rebuilds
                          its index after a restart.
    usage()              -> capacity, bytes and blocks held, counters.
    flush()              -> blocks put so far are on the medium (a no-op for volatile tiers).
    close()              -> releases the medium; later calls raise TierClosed.

What a tier says about itself:
    persistent           its blocks outlive the process (the store spills to it on close,
                         writes through or behind to it, and rebuilds its index from it).
    as_arena()           -> the tier as an ``InPlaceTier`` when other processes can map its
                         slots and read and write them in place (the `dram` arena), else None.
    write_queue()        -> the tier as a ``WriteQueue`` when a writer thread commits its puts
                         after they return (`nvme`), else None.

Threads: every method may be called from any thread. The caller must not put and delete the
same key concurrently; the tiered store guarantees that by holding its own index lock.

Buffers: ``put`` copies the payload before it returns (or holds an immutable ``bytes`` object),
so the caller may reuse its buffer. ``get_into`` copies out; nothing returned aliases the
medium.
"""

from __future__ import annotations

import contextlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NewType, Protocol

import xxhash

TierKey = NewType("TierKey", bytes)
"""A tier's storage key: opaque bytes chosen by the store."""

BytesLike = bytes | bytearray | memoryview
"""Anything exposing a contiguous byte buffer."""

MAX_KEY_BYTES = 511  # LMDB's default key limit; every tier accepts the same keys.
MAX_META_BYTES = 64  # small caller metadata kept with a block (the store keeps chain links)
FINGERPRINT_BYTES = 32


class Codec(IntEnum):
    """How a stored payload is encoded on the medium."""

    NONE = 0
    ZSTD = 1
    ZSTD_BYTEPLANE = 2  # 16-bit elements split into byte planes, high plane compressed


@dataclass(frozen=True)
class BlockHeader:
    """The small header stored in front of every block on a persistent or remote medium.

    ``payload_len`` is the logical (decoded) length; ``stored_len`` is what follows the header
    on the medium; ``checksum`` is ``bound_checksum(key, xxh3-64 of the stored bytes)``, which
    ties the value to the tier key it was stored under (namespace, fingerprint and block key):
    the same header and bytes under another key fail their check. ``meta`` is the caller's
    metadata, packed after the fixed fields.

    Version 2 binds the key; a version-1 header (checksum of the bytes alone) does not parse, so
    a block written before is a miss (the nvme tier drops it at open, a remote tier deletes it
    when read). Version 3 adds ``born_s``: when the block was first stored (wall clock, seconds),
    so a remote copy carries its age to whoever reads it (retention, ``tiers.remote``). A
    version-2 header still parses, its birth unknown (0.0).
    """

    fingerprint: bytes
    payload_len: int
    stored_len: int
    codec: Codec
    checksum: int
    version: int = 3
    meta: bytes = b""
    born_s: float = 0.0  # first stored (time.time()); 0.0: unknown (a version-2 header)

    _FORMAT = struct.Struct("<4sHB32sQQQ")
    _BORN = struct.Struct("<d")  # version 3: after the fixed fields, before the meta
    _MAGIC = b"KVSB"
    SIZE = _FORMAT.size

    def pack(self) -> bytes:
        return (
            self._FORMAT.pack(
                self._MAGIC,
                3,
                int(self.codec),
                self.fingerprint,
                self.payload_len,
                self.stored_len,
                self.checksum,
            )
            + self._BORN.pack(self.born_s)
            + self.meta
        )

    @classmethod
    def unpack(cls, raw: BytesLike) -> BlockHeader | None:
        """Parse a header; None when ``raw`` is not a header this version understands."""
        if len(raw) < cls.SIZE:
            return None
        magic, version, codec, fingerprint, payload_len, stored_len, checksum = cls._FORMAT.unpack_from(raw)
        if magic != cls._MAGIC or version not in (2, 3) or codec not in Codec._value2member_map_:
            return None
        start, born_s = cls.SIZE, 0.0
        if version == 3:
            if len(raw) < start + cls._BORN.size:
                return None
            (born_s,) = cls._BORN.unpack_from(raw, start)
            start += cls._BORN.size
        meta = bytes(raw[start:])
        if len(meta) > MAX_META_BYTES:
            return None
        return cls(bytes(fingerprint), payload_len, stored_len, Codec(codec), checksum, version, meta, born_s)


def key_digest(key: BytesLike) -> int:
    """xxh3-64 of a tier key: what binds a block's checksum to its key (``bound_checksum``)."""
    return xxhash.xxh3_64_intdigest(key)


def bound_checksum(key: BytesLike, bytes_checksum: int) -> int:
    """The checksum a header or slot keeps for bytes whose xxh3-64 is ``bytes_checksum``, stored
    under ``key``: the two xor-ed. Checking it is ``bound_checksum(key, stored) == xxh3-64 of
    the bytes read`` (xor is its own inverse), so the readers' hash of the bytes, C's fused
    copy-and-hash included, is unchanged and the binding costs one hash of a ~70-byte key. A value
    moved under another key matches only if the two keys' digests collide (2**-64). Like the
    checksum itself this catches mistakes, stale copies and moves, not a forger who can write
    the medium (xxh3 has no key): against that, the AEAD of ``tiers.cipher``."""
    return bytes_checksum ^ key_digest(key)


@dataclass(frozen=True, slots=True)
class Slot:
    """A place in a memory tier's region: ``offset`` and the ``size_bytes`` of the block it holds."""

    offset: int
    size_bytes: int


@dataclass(frozen=True)
class StoredBlock:
    """One block as a tier reports it from scan()."""

    key: TierKey
    fingerprint: bytes
    size_bytes: int
    meta: bytes = b""


@dataclass(frozen=True)
class TierUsage:
    """A point-in-time view of a tier's occupancy and counters."""

    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    checksum_failures: int = 0
    stored_bytes: int = 0  # bytes on the medium after the codec; equals used_bytes without one
    degraded: bool = False  # takes no writes now (a full or read-only file system): nvme
    write_failures: int = 0  # blocks that could not be written (dropped or refused): nvme
    damaged_moved: int = 0  # damaged environments moved aside at open: nvme


class Tier(ABC):
    """One storage medium. See the module docstring for the contract."""

    name: str
    persistent: bool = False

    @abstractmethod
    def can_store(self, size_bytes: int) -> bool: ...

    @abstractmethod
    def put(self, key: TierKey, payload: BytesLike, fingerprint: bytes, meta: bytes = b"") -> None: ...

    @abstractmethod
    def get_into(self, key: TierKey, out: memoryview) -> int | None: ...

    def get_into_many(
        self, keys: Sequence[TierKey], outs: Sequence[memoryview], sizes: list[int | None]
    ) -> None:
        """``get_into`` of each key into its buffer, appending each length (None for a miss) to
        ``sizes`` as it ends: after an exception, ``len(sizes)`` says which copies ran."""
        for key, out in zip(keys, outs, strict=True):
            sizes.append(self.get_into(key, out))

    @abstractmethod
    def size_of(self, key: TierKey) -> int | None: ...

    @abstractmethod
    def delete(self, key: TierKey) -> bool: ...

    @abstractmethod
    def scan(self) -> Iterator[StoredBlock]: ...

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def flush(self) -> None:  # noqa: B027 - volatile tiers have nothing to flush
        """Make every completed put durable on the medium; volatile tiers have nothing to do."""

    @abstractmethod
    def close(self) -> None: ...

    def as_arena(self) -> InPlaceTier | None:
        """This tier as a region other processes map, or None (see the module docstring)."""
        return None

    def write_queue(self) -> WriteQueue | None:
        """This tier's write queue, or None when a put is done when it returns."""
        return None


class MappedRegion(Protocol):
    """The shared memory an arena tier's slots live in, as its clients find and map it."""

    @property
    def name(self) -> str: ...

    @property
    def size_bytes(self) -> int: ...

    @property
    def view(self) -> memoryview: ...


class InPlaceTier(Protocol):
    """A memory tier whose slots other processes map (same-host reads and writes in place).

    Two-phase writes: ``reserve`` a slot readers cannot see (``reserve_many`` several, stopping
    where the tier is full), fill ``slot_view(slot)``, then
    ``commit`` (publishes it; ``commit_many`` several at once, all or none) or ``abort`` (gives
    it back). ``locate`` finds a committed block's
    slot; its view stays valid while the caller keeps the block from being deleted.

    Retired slots: ``retire(key, mark)`` takes a block out of the tier as ``delete`` does, but
    its slot (and the arena journal's record of it) stays taken until ``settle(m)`` with
    ``m >= mark``: the block's copy below is still in a write queue, and a crash meanwhile must
    find its bytes here. ``retiring_mark(n)``: the smallest mark whose settling frees ``n``
    bytes of retired slots (all of them if fewer retire; 0 when none do).

    Checksums: ``commit_many``'s ``checksums`` give each block the xxh3-64 of the bytes its
    writer put in its slot (the server's copy of a remote put, a same-host client's copy);
    ``verified_checksum`` checks a committed block's bytes against it before they leave
    the process (and takes the checksum then for a block that has none: ``tiers.slab``).

    ``frees_batched()``: a context in which what the arena records of the slots it frees may be
    written once at its end (its journal: one write for an eviction pass, not one a victim).
    """

    @property
    def name(self) -> str: ...

    @property
    def arena(self) -> MappedRegion: ...

    @property
    def pinned(self) -> bool: ...

    def reserve(self, key: TierKey, size_bytes: int, fingerprint: bytes, meta: bytes = b"") -> Slot: ...

    def reserve_many(self, items: Sequence[tuple[TierKey, int]], fingerprint: bytes) -> list[Slot | None]: ...

    def room_for(self, size_bytes: int, count: int) -> int: ...

    def commit(self, key: TierKey, meta: bytes | None = None) -> None: ...

    def commit_many(
        self, items: Sequence[tuple[TierKey, bytes | None]], checksums: Sequence[int | None] | None = None
    ) -> None: ...

    def abort(self, key: TierKey) -> bool: ...

    def verified_checksum(self, key: TierKey, slot: Slot, view: memoryview) -> int | None: ...

    def locate(self, key: TierKey) -> Slot | None: ...

    def locate_many(self, keys: Sequence[TierKey]) -> list[Slot | None]: ...

    def slot_view(self, slot: Slot) -> memoryview: ...

    def retire(self, key: TierKey, mark: int) -> bool: ...

    def settle(self, mark: int) -> int: ...

    def retiring_mark(self, nbytes: int) -> int: ...

    def frees_batched(self) -> contextlib.AbstractContextManager[None]: ...


class WriteQueue(Protocol):
    """A tier whose puts a writer thread commits after they return (`nvme`): what the store
    needs to keep that queue from stalling its lock and from losing a block in a crash.

    ``put_nowait`` is ``put`` that never waits for room in the queue: it raises TierBusy while
    the queue is full (the medium is behind). The store places blocks under its lock, where a
    wait on the disk would stall every caller; ``wait_for_queue_room(n, timeout_s)`` waits,
    outside it, until a ``put_nowait`` of n bytes would not find the queue full (whether it
    would not); ``queue_capacity_bytes`` is what the queue holds at most.

    Marks: ``unwritten_mark(key)`` is where the key's put stands in the queue (0 when none is
    queued); ``written_mark()`` passes it once the medium holds the block (a crash of the
    process can no longer lose it), or once nothing more will be written (``sys.maxsize``);
    ``wait_written(mark, timeout_s)`` waits until it has (whether it has). The arena's retired
    slots are settled by these marks (``InPlaceTier.retire``).

    Threads: every method may be called from any thread.
    """

    @property
    def queue_capacity_bytes(self) -> int: ...

    def put_nowait(self, key: TierKey, payload: BytesLike, fingerprint: bytes, meta: bytes = b"") -> None: ...

    def wait_for_queue_room(self, nbytes: int, timeout_s: float) -> bool: ...

    def unwritten_mark(self, key: TierKey) -> int: ...

    def written_mark(self) -> int: ...

    def wait_written(self, mark: int, timeout_s: float) -> bool: ...


def check_key(key: bytes) -> None:
    """Raise ValueError for a key no tier can store."""
    if not key or len(key) > MAX_KEY_BYTES:
        raise ValueError(f"tier key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


def check_meta(meta: bytes) -> None:
    if len(meta) > MAX_META_BYTES:
        raise ValueError(f"block metadata must be at most {MAX_META_BYTES} bytes, got {len(meta)}")


def check_fingerprint(fingerprint: bytes) -> None:
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")

"""Same-host writes and reads pipelined over one data-port connection.

A write in place is reserve, copy into the arena, commit. Done once for a whole chain, the
server's reserve and commit work (tens of microseconds a block in Python) adds to the copy.
Cut into chunks, it overlaps instead: reserves run AHEAD chunks ahead of the copy, and each
chunk's commit goes out in the same send as the reserve of the chunk AHEAD past the next, so
the server works on them, on another core, while this process copies, and each step costs one
send (one wakeup of the server) rather than two. What stays on the critical path is the first
chunk's reserve and the last one's commit, so those chunks are the small ones (``chunks``).
The first reserve goes out before anything else is done (its chunk found from the first
blocks alone, ``first_chunk_end``), and every later request is built while its answer comes:
the server's wake from idle (~0.1-0.2 ms here) is the one wait nothing else can fill.
Each block is hashed as it is copied (``scatter_hashed``), and its chunk's commit carries the
checksums, so the server keeps them from the commit on without reading the bytes again.
With AHEAD = 3:

    sends, in order:    R0 | R1 R2 | C0 R3 | C1 R4 | ... | C(m-2) | C(m-1)
    step k:             copy chunk k; send C(k) with R(k+3); read the answers up to R(k+1)'s

The server answers one request at a time, in order, so the answers are read in the order the
requests went out. Two chunks of copying (about 1.5 ms at 8 MiB) stand between a reserve going
out and its answer being needed: a server thread descheduled for less than that costs nothing.
With one chunk between (AHEAD = 2) a 512 x 256 KiB write ran 2% slower here, in each of three
runs measured against a copy into the very slots it used.

A reserve reaches the server before the chunks before it are committed, so it cannot hold its
parent (not stored yet); the server takes the depth of a chain's blocks from the parent at
commit time, when it is there (``kvstore.store.arena``).

On a failure the reservations whose answer was read but whose commit was not confirmed are left
in ``unconfirmed`` for the caller to abort (one of them may have been committed already: its
abort then finds nothing). A copy that fails (this process's error) first reads the answers
still coming, so the reservations sent ahead are among them; after a failure of the stream
itself one sent ahead may be unknown and runs out with its lease. The connection pool drops the
connection after any failure.

A read in place is a pinning lookup that names the slots, the copy out of them, a release
(unanswered). For one lookup of a whole chain the server's work on every key (about a
microsecond and a half each) comes before the first byte is copied. ``read_pipelined`` asks for
a small first chunk, then chunks READ_GROWTH times the one before, one ahead of the copy: the
lookup of chunk k+1 runs on the server while chunk k is copied, and chunk k's release goes out
in the same send as the lookup of chunk k+2; a release with no lookup left to go with waits for
the next send, the last one's (a send wakes the server: 25-120 us of this thread's time here).
Each chunk's pin covers its own copy. A chunk that ends short (a miss) ends the prefix; a lookup
already sent past it is read and its pin released.
"""

from __future__ import annotations

import contextlib
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from typing import cast

import numpy as np
import xxhash

from kvstore.client.dataport import DataPortClient, Spans
from kvstore.errors import LeaseExpired
from kvstore.wire import commit_request, lookup_slots_request, release_request, reserve_request

try:
    from tiers import _gather  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: the copies run in Python, block by block
    _gather = None

# The chunks of a write: the first FIRST_CHUNK_BYTES, each next one twice the one before up to
# CHUNK_BYTES, and the last ones halving down to LAST_CHUNK_BYTES; at least one block each.
# The first reserve's answer and the last commit's are waited for with nothing to copy
# meanwhile, and the server's work on each is some microseconds a block: small chunks there,
# large ones between, where the server works while this process copies (a 512 x 256 KiB
# write 2% faster than in even 8 MiB chunks).
FIRST_CHUNK_BYTES = 1 << 20
CHUNK_BYTES = 8 << 20
LAST_CHUNK_BYTES = 1 << 20
AHEAD = 3  # chunks reserved ahead of the one being copied
READ_AHEAD = 2  # lookups out before the first copy: the one copied and the next

Regions = Callable[[str], memoryview]  # the mapping of the arena of that name
Data = bytes | bytearray | memoryview
Slots = Sequence[tuple[int, int]]  # (offset, size) in the arena


def first_chunk_end(sizes: Iterable[int]) -> int:
    """The end of a write's first chunk: its first blocks up to FIRST_CHUNK_BYTES, at least one
    (from the first blocks alone, so that its reserve goes out before the rest is looked at)."""
    done = count = 0
    for size in sizes:
        done += size
        count += 1
        if done >= FIRST_CHUNK_BYTES:
            break
    return count


def chunks(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(first, end) of each chunk of a write of blocks of ``sizes``."""
    if not sizes:
        return []
    ends = list(accumulate(sizes))  # bytes up to the end of each block
    total = ends[-1]
    first = first_chunk_end(sizes)
    out: list[tuple[int, int]] = [(0, first)]
    done = ends[first - 1]
    want = min(CHUNK_BYTES, 2 * FIRST_CHUNK_BYTES)
    while first < len(sizes):
        left = total - done
        if left < 2 * CHUNK_BYTES:  # near the end: at most half of what is left
            want = min(want, max(LAST_CHUNK_BYTES, left // 2))
        end = min(len(sizes), max(first + 1, bisect_left(ends, done + want) + 1))
        out.append((first, end))
        first, done = end, ends[end - 1]
        want = min(CHUNK_BYTES, 2 * want)
    return out


def write_pipelined(
    conn: DataPortClient,
    region_of: Regions,
    fingerprint: bytes,
    keys: Sequence[bytes],
    blocks: Sequence[Data],
    parent: bytes | None,
    ttl_s: float,
    unconfirmed: list[int],
) -> tuple[int, list[int]]:
    """Write a chain in place in the chunks of ``chunks``; (blocks stored, indices of the blocks
    given no slot). ``unconfirmed``: the reservations read whose commit answer is not, kept up
    to date for the caller to abort after a failure. The first chunk's reserve goes out before
    anything else is done: the server wakes meanwhile."""
    if not blocks:
        return 0, []
    first_end = first_chunk_end(map(len, blocks))
    conn.send(
        [reserve_request(fingerprint, keys[:first_end], [len(b) for b in blocks[:first_end]], parent, ttl_s)]
    )
    sizes = [len(b) for b in blocks]
    parts = chunks(sizes)
    stored = 0
    skipped: list[int] = []
    coming: list[int] = []  # the answers not read yet, in order: chunk k's reserve, or -1
    answers: dict[int, tuple[str, int, Spans]] = {}
    regions: dict[str, memoryview] = {}

    def reserve_bytes(k: int) -> bytes:
        first, end = parts[k]
        return reserve_request(
            fingerprint, keys[first:end], sizes[first:end], parent if first == 0 else keys[first - 1], ttl_s
        )

    def read_next() -> None:
        nonlocal stored
        k = coming.pop(0)
        if k < 0:
            stored += conn.read_commit()
            unconfirmed.pop(0)
        else:
            answers[k] = conn.read_reserve_spans(parts[k][1] - parts[k][0])
            unconfirmed.append(answers[k][1])

    first_sends = min(AHEAD, len(parts))
    coming.append(0)
    if first_sends > 1:
        conn.send([reserve_bytes(k) for k in range(1, first_sends)])
        coming.extend(range(1, first_sends))
    # While the server wakes for the first answer: every later request, and the chunks' blocks.
    requests: list[bytes | None] = [None] * first_sends + [
        reserve_bytes(k) for k in range(first_sends, len(parts))
    ]
    chunk_blocks = [list(blocks[first:end]) for first, end in parts]
    for k in range(len(parts)):
        first = parts[k][0]
        while k not in answers:
            read_next()
        name, reservation_id, spans = answers.pop(k)
        try:
            if spans.missing:
                skipped.extend(first + i for i in spans.missing)
                given = [blocks[first + i] for i in spans.given()]
            else:
                given = chunk_blocks[k]
            region = regions.get(name)
            if region is None:
                region = regions[name] = region_of(name)
            checksums = scatter_hashed(region, spans.offsets, spans.sizes, given)
        except BaseException:
            # A failure here, not on the stream: read what is still coming, so that the
            # reservations sent ahead are known and can be given back. (A stream that fails
            # meanwhile leaves the copy's error the one raised.)
            with contextlib.suppress(Exception):
                while coming:
                    read_next()
            raise
        coming.append(-1)
        ahead = requests[k + AHEAD] if k + AHEAD < len(parts) else None
        if ahead is not None:
            conn.send([commit_request(reservation_id, checksums), ahead])
            coming.append(k + AHEAD)
        else:
            conn.send([commit_request(reservation_id, checksums)])
    while coming:
        read_next()
    return stored, skipped


FIRST_READ_KEYS = 16  # the first chunk of a pipelined read
# Each next chunk this many times the one before: a get of 512 x 256 KiB in chunks of 16, 128 and
# 368 blocks ran at 0.91-0.92x of its copy alone here, in 16, 64, 256 and 176 at 0.90-0.91x (three
# runs each, interleaved): a chunk less is a send and an answer less. The server's lookup of the
# next chunk (~1 us a key) still ends well inside the copy of this one (~20 us a block).
READ_GROWTH = 8


def read_chunks(n_keys: int) -> list[tuple[int, int]]:
    """(first, end) of each chunk of a pipelined read of ``n_keys`` keys."""
    out: list[tuple[int, int]] = []
    first, size = 0, FIRST_READ_KEYS
    while first < n_keys:
        out.append((first, min(n_keys, first + size)))
        first, size = first + size, READ_GROWTH * size
    return out


Buffers = Callable[[int, list[int]], Sequence[memoryview]]


def read_pipelined(
    conn: DataPortClient,
    region_of: Regions,
    fingerprint: bytes,
    keys: Sequence[bytes],
    pin_s: float,
    margin_s: float,
    buffers: Buffers,
    meanwhile: Callable[[], object] | None = None,
) -> int | None:
    """Copy the present prefix of ``keys`` out of the arena, in chunks of ``read_chunks``, into
    ``buffers(first, sizes)`` (a buffer for each block of the chunk starting at block ``first``,
    of these sizes, or fewer: the first ones); how many blocks are present. ``meanwhile``: work
    of the caller's run while the first lookups are on their way (the server's answer to the
    first takes 0.1-0.25 ms here, most of it waking its thread). Each chunk is pinned for ``pin_s``
    and its copy must end ``margin_s`` before that (LeaseExpired otherwise: a slot reused since
    would have given another block's bytes). None when a block of the prefix is in a tier below
    the arena: the caller reads the way that brings it up."""
    parts = read_chunks(len(keys))
    coming: deque[tuple[int, float]] = deque()  # (chunk, when its lookup went out), not read yet
    hit = 0
    ended = False  # the prefix ended, or left the arena: no more lookups, the rest released
    below = False

    def lookup(k: int) -> bytes:
        first, end = parts[k]
        coming.append((k, time.monotonic()))
        return lookup_slots_request(fingerprint, keys[first:end], pin_s)

    def drain(releases: list[bytes]) -> None:
        """Read the answers still coming, releasing their pins with ``releases``."""
        while coming:
            coming.popleft()
            lease_id = conn.read_lookup_spans()[2]
            if lease_id:
                releases.append(release_request(lease_id))
        if releases:
            conn.send(releases)

    conn.send([lookup(k) for k in range(min(READ_AHEAD, len(parts)))])
    sent = len(coming)
    if meanwhile is not None:
        meanwhile()
    out: list[bytes] = []  # what goes out next: releases wait for a lookup to go with, or the end
    while coming:
        k, asked = coming.popleft()
        first, end = parts[k]
        asking = False
        n, _, lease_id, name, spans = conn.read_lookup_spans()
        if lease_id:
            out.append(release_request(lease_id))
        if not ended and spans.missing:
            below = ended = True
        if not ended:
            if n:
                try:
                    bufs = buffers(first, spans.sizes)
                    m = len(bufs)
                    _copy_spans(region_of(name), spans.offsets[:m], spans.sizes[:m], bufs, into_region=False)
                    if time.monotonic() - asked > pin_s - margin_s:
                        raise LeaseExpired(f"the copy outlasted its {pin_s:g} s pin; read again")
                except BaseException:
                    with contextlib.suppress(Exception):
                        drain(out)  # the pins sent ahead go back too
                    raise
            hit += n
            ended = n < end - first  # a miss, even at the chunk's first key, ends the prefix
            if not ended and sent < len(parts):
                out.append(lookup(sent))
                sent += 1
                asking = True
        if out and (asking or not coming):
            conn.send(out)
            out = []
    return None if below else hit


def scatter_into_slots(region: memoryview, slots: Slots, blocks: Sequence[Data]) -> None:
    """Each block into its slot of ``region`` (a block at most its slot's size)."""
    _copy_slots(region, slots, blocks, into_region=True)


def gather_from_slots(region: memoryview, slots: Slots, outs: Sequence[memoryview]) -> None:
    """Each slot of ``region`` into its buffer (at least the slot's size)."""
    _copy_slots(region, slots, outs, into_region=False)


def scatter_hashed(
    region: memoryview, offsets: list[int], sizes: list[int], bufs: Sequence[Data]
) -> list[int]:
    """Each buffer (exactly its slot's size) into the slot at its offset, hashed on the way: the
    xxh3-64 of each block, for its commit to carry. One native call without the GIL when
    ``tiers._gather`` is built, reading each block once (about the speed of the copy alone:
    ``tiers/native/gather.c``); otherwise a copy and a hash a block."""
    if _gather is not None:
        digests: list[int] = _gather.scatter_hashed(
            region, offsets, sizes, bufs if isinstance(bufs, list) else list(bufs)
        )
        return digests
    for offset, size, buf in zip(offsets, sizes, bufs, strict=True):
        if offset + size > len(region):
            raise ValueError(f"a {size} B slot at {offset} lies outside the {len(region)} B region")
        if len(buf) != size:
            raise ValueError(f"a buffer of {len(buf)} B is not the {size} B slot at {offset}")
    out = []
    for offset, size, buf in zip(offsets, sizes, bufs, strict=True):
        copy_into(region[offset : offset + size], buf)
        out.append(xxhash.xxh3_64_intdigest(buf))
    return out


def copy_hashed(view: memoryview, block: Data) -> int:
    """``block`` into ``view`` (a slot of exactly its size), hashed on the way (``scatter_hashed``)."""
    return scatter_hashed(view, [0], [len(view)], [block])[0]


def _copy_slots(region: memoryview, slots: Slots, bufs: Sequence[Data], into_region: bool) -> None:
    _copy_spans(region, [offset for offset, _ in slots], [size for _, size in slots], bufs, into_region)


def _copy_spans(
    region: memoryview, offsets: list[int], sizes: list[int], bufs: Sequence[Data], into_region: bool
) -> None:
    """Each buffer into (or out of) the slot at its offset and size. One native call without
    the GIL when ``tiers._gather`` is built (~2 us a block less than numpy's views); otherwise
    block by block, everything checked before a byte moves as there."""
    if _gather is not None:
        (_gather.scatter if into_region else _gather.gather)(
            region, offsets, sizes, bufs if isinstance(bufs, list) else list(bufs)
        )
        return
    for offset, size, buf in zip(offsets, sizes, bufs, strict=True):
        if offset + size > len(region) or (len(buf) > size if into_region else len(buf) < size):
            raise ValueError(f"a buffer of {len(buf)} B does not fit the {size} B slot at {offset}")
    for offset, size, buf in zip(offsets, sizes, bufs, strict=True):
        if into_region:
            copy_into(region[offset : offset + size], buf)
        else:
            copy_into(cast(memoryview, buf), region[offset : offset + size])


def copy_into(dst: memoryview | bytearray, src: Data) -> None:
    # numpy releases the GIL for the copy, so other client threads keep going meanwhile
    np.copyto(np.frombuffer(dst, dtype=np.uint8)[: len(src)], np.frombuffer(src, dtype=np.uint8))

"""Same-host writes pipelined over one data-port connection.

A write in place is reserve, copy into the arena, commit. Done once for a whole chain, the
server's reserve and commit work (tens of microseconds a block in Python) adds to the copy.
Cut into chunks, it overlaps instead: the reserve of chunk k+1 and the commit of chunk k-1 go
out before chunk k is copied, so the server works on them, on another core, while this process
copies. What stays on the critical path is the first chunk's reserve and the last one's commit.

    requests, in the order sent:  R0 | R1 C0 | R2 C1 | R3 C2 | ... | C(m-1)
    step k (R(k)'s answer read):  send R(k+1); copy chunk k; send C(k); read C(k-1); read R(k+1)

The server answers one request at a time, in order, so the answers are read in the order the
requests went out.

The reserve of chunk k+1 reaches the server before chunk k is committed, so it cannot hold its
parent (not stored yet); the server takes the depth of a chain's blocks from the parent at
commit time, when it is there (``kvstore.store.arena``).

On a failure the reservations whose answer was read but whose commit was not confirmed are left
in ``unconfirmed`` for the caller to abort (one of them may have been committed already: its
abort then finds nothing). A copy that fails (this process's error) first reads the answers
still coming, so the reservation sent ahead is among them; after a failure of the stream itself
one sent ahead may be unknown and runs out with its lease. The connection pool drops the
connection after any failure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.client.dataport import DataPortClient

CHUNK_BYTES = 8 << 20  # a chunk of the pipeline: at least this many bytes, and CHUNK_MIN_BLOCKS
CHUNK_MIN_BLOCKS = 4

Views = Callable[[str, Sequence[tuple[int, int] | None]], list[memoryview | None]]
Data = bytes | bytearray | memoryview


def chunks(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(first, end) of each chunk of a write of blocks of ``sizes``."""
    out: list[tuple[int, int]] = []
    first = total = 0
    for i, size in enumerate(sizes):
        total += size
        if total >= CHUNK_BYTES and i + 1 - first >= CHUNK_MIN_BLOCKS:
            out.append((first, i + 1))
            first, total = i + 1, 0
    if first < len(sizes):
        out.append((first, len(sizes)))
    return out


def write_pipelined(
    conn: DataPortClient,
    views_of: Views,
    fingerprint: bytes,
    keys: Sequence[bytes],
    blocks: Sequence[Data],
    sizes: Sequence[int],
    parts: Sequence[tuple[int, int]],
    parent: bytes | None,
    ttl_s: float,
    unconfirmed: list[int],
) -> tuple[int, list[int]]:
    """Write a chain in place in the chunks ``parts`` (of ``chunks(sizes)``); (blocks stored,
    indices of the blocks given no slot). ``unconfirmed``: the reservations read whose commit
    answer is not, kept up to date for the caller to abort after a failure."""
    stored = 0
    skipped: list[int] = []

    def send_reserve(k: int) -> None:
        first, end = parts[k]
        conn.send_reserve(
            fingerprint, keys[first:end], sizes[first:end], parent if first == 0 else keys[first - 1], ttl_s
        )

    send_reserve(0)
    answer = conn.read_reserve(parts[0][1] - parts[0][0])
    for k, (first, _) in enumerate(parts):
        name, reservation_id, slots = answer
        unconfirmed.append(reservation_id)
        if k + 1 < len(parts):
            send_reserve(k + 1)
        try:
            for i, view in enumerate(views_of(name, slots)):
                if view is None:
                    skipped.append(first + i)
                else:
                    copy_into(view, blocks[first + i])
        except BaseException:
            # A failure here, not on the stream: read what is still coming, so that the
            # reservation sent ahead is known and can be given back. (A stream that fails
            # meanwhile leaves the copy's error the one raised.)
            with contextlib.suppress(Exception):
                if k > 0:
                    conn.read_commit()
                    unconfirmed.pop(0)
                if k + 1 < len(parts):
                    unconfirmed.append(conn.read_reserve(parts[k + 1][1] - parts[k + 1][0])[1])
            raise
        conn.send_commit(reservation_id)
        if k > 0:
            stored += conn.read_commit()
            unconfirmed.pop(0)
        if k + 1 < len(parts):
            answer = conn.read_reserve(parts[k + 1][1] - parts[k + 1][0])
    stored += conn.read_commit()
    unconfirmed.pop(0)
    return stored, skipped


def copy_into(dst: memoryview | bytearray, src: Data) -> None:
    # numpy releases the GIL for the copy, so other client threads keep going meanwhile
    np.copyto(np.frombuffer(dst, dtype=np.uint8)[: len(src)], np.frombuffer(src, dtype=np.uint8))

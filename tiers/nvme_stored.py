"""The ``nvme`` tier's stored values: how put() makes a block's header and stored bytes, what the
index keeps of each header, and how a read checks a value against it while copying it out of
the LMDB map.

Every read verifies the xxh3-64 checksum of the stored bytes named in the header, bound to the
block's key (``tiers.base.bound_checksum``); the index keeps it unbound (``Entry.checksum``), so
every read path, C's included, compares the bytes' plain hash. A warm read pays for that check
on every read, which ``verified_copy`` hides by reading the map once: each stripe is hashed and
stored in one pass (``tiers._verify``, in C with xxHash's own kernels; in Python, hashing a chunk
and then copying it, where no C compiler built it). The figures against raw LMDB with the same
flags: ``kvstore bench tiers`` (``bench-results/tiers-quick.txt``).

Values are read from views of the map that are valid only inside their read transaction; the
functions here copy out of them and keep nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import lmdb
import numpy as np
import xxhash

from tiers.base import BlockHeader, BytesLike, Codec, TierKey, bound_checksum
from tiers.cipher import OVERHEAD_BYTES, BlockCipher
from tiers.codec import CodecError, byte_view, decode_into, encode

if TYPE_CHECKING:
    from tiers.nvme_queue import PutOp


class Entry(NamedTuple):
    """What the index keeps of a header: enough to read and verify without fetching it.

    ``tiers._verify.read_plain`` reads these fields by position (1, 2, 4 and 5)."""

    fingerprint: bytes
    payload_len: int
    stored_len: int
    meta: bytes
    codec: Codec
    checksum: int  # xxh3-64 of the stored bytes (unbound from the key: ``NvmeIndex.add``)


@dataclass(frozen=True)
class Corrupt:
    """A committed block whose stored bytes fail their header."""


def make_stored(
    key: TierKey,
    payload: BytesLike,
    view: memoryview,
    fingerprint: bytes,
    meta: bytes,
    codec: Codec,
    zstd_level: int,
    cipher: BlockCipher | None,
    take: Callable[[int], bytearray],
) -> tuple[BlockHeader, bytes | bytearray]:
    """The header and stored bytes of a block: encoded (kept raw where compression does not pay),
    then sealed. A plain ``bytes`` payload is stored as it is; anything else is copied. Sealed
    values and copies go into ``take(size)``'s buffers, recycled from committed blocks: fresh
    memory faults in at a fraction of memcpy speed. ``view``: ``byte_view(payload)``."""
    payload_len = len(view)
    stored: bytes | bytearray = b""
    if codec is not Codec.NONE:
        stored = encode(codec, view, zstd_level)
        if len(stored) >= payload_len:
            codec = Codec.NONE  # compression did not pay
    if cipher is not None:
        plain = byte_view(stored) if codec is not Codec.NONE else view
        sealed = take(len(plain) + OVERHEAD_BYTES)
        cipher.seal_into(key, plain, memoryview(sealed))
        stored = sealed
    elif codec is Codec.NONE:
        if isinstance(payload, bytes):
            stored = payload
        else:
            stored = take(payload_len)
            # numpy releases the GIL for the copy, so the writer thread keeps committing meanwhile
            np.copyto(np.frombuffer(stored, dtype=np.uint8), np.frombuffer(view, dtype=np.uint8))
    checksum = bound_checksum(key, xxhash.xxh3_64_intdigest(stored))
    return BlockHeader(fingerprint, payload_len, len(stored), codec, checksum, meta=bytes(meta)), stored


def copy_committed(
    txn: lmdb.Transaction[memoryview],
    payloads: lmdb._Database,
    cipher: BlockCipher | None,
    key: TierKey,
    dst: memoryview,
    entry: Entry,
) -> int | Corrupt | None:
    """Copy one committed block into ``dst`` and verify it against the header ``entry`` the
    index holds (read at open or written by put), so a read fetches only the payload; None
    when the block was deleted since the index lookup."""
    n = entry.payload_len
    stored = txn.get(key, db=payloads)
    if stored is None:
        return None  # deleted since the index lookup
    if len(stored) != entry.stored_len:
        return Corrupt()
    if cipher is not None:
        if xxhash.xxh3_64_intdigest(stored) != entry.checksum:
            return Corrupt()
        opened = open_sealed(cipher, key, stored, dst, entry.codec, n)
        return Corrupt() if opened is None else opened
    if entry.codec is Codec.NONE:
        return n if verified_copy(stored, dst, entry.checksum) else Corrupt()
    if xxhash.xxh3_64_intdigest(stored) != entry.checksum:
        return Corrupt()
    try:
        return decode_into(entry.codec, stored, dst, n)
    except CodecError:
        return Corrupt()


def read_batch(
    txn: lmdb.Transaction[memoryview],
    payloads: lmdb._Database,
    cipher: BlockCipher | None,
    batch: list[TierKey],
    entries: Sequence[Entry | None],
    ops: Sequence[PutOp | None],
    dsts: Sequence[memoryview],
    sizes: list[int | None],
    corrupt: list[tuple[TierKey, Entry]],
) -> None:
    """Each block of ``batch`` into its buffer in ``dsts``, in the read transaction ``txn`` begun
    on ``payloads``: from its pinned pending put in ``ops`` where it has one, else committed.
    Appends each length (None for a miss) to ``sizes`` and each block failing its header to
    ``corrupt``. Runs of plain blocks (committed, no codec, no cipher) are read by
    ``tiers._verify.read_plain`` where it is built: the same steps as ``copy_committed`` without
    the interpreter between blocks."""
    limit = len(batch)
    plain = native is not None and cipher is None
    i = 0
    while i < limit:
        if plain:  # the plain blocks from i on in C, up to one it hands back
            bad: list[int] = []
            i = native.read_plain(txn.get, batch, entries, ops, dsts, Codec.NONE, i, sizes, bad)
            corrupt += [(batch[j], cast(Entry, entries[j])) for j in bad]
            if i == limit:
                break
        key, entry, op, dst = batch[i], entries[i], ops[i], dsts[i]
        if entry is None:
            sizes.append(None)
        elif op is not None:
            sizes.append(read_pending(cipher, key, op, dst))
        else:
            result = copy_committed(txn, payloads, cipher, key, dst, entry)
            if isinstance(result, Corrupt):
                corrupt.append((key, entry))
                result = None
            sizes.append(result)
        i += 1


def read_pending(cipher: BlockCipher | None, key: TierKey, op: PutOp, dst: memoryview) -> int | None:
    """Copy a queued put's bytes into ``dst`` (the caller holds a pin on ``op``)."""
    # Queued bytes are private to this tier and were made by put(): nothing to verify.
    if cipher is not None:
        return open_sealed(cipher, key, memoryview(op.stored), dst, op.header.codec, op.header.payload_len)
    return decode_into(op.header.codec, op.stored, dst, op.header.payload_len)


def open_sealed(
    cipher: BlockCipher, key: TierKey, sealed: memoryview, dst: memoryview, codec: Codec, n: int
) -> int | None:
    """Decrypt (straight into ``dst`` without a codec) and decode; None when it does not
    open: a shredded or wrong key, or tampered bytes."""
    if codec is Codec.NONE:
        return n if cipher.open_into(key, sealed, dst) == n else None
    plain = bytearray(len(sealed) - OVERHEAD_BYTES)
    if cipher.open_into(key, sealed, memoryview(plain)) is None:
        return None
    try:
        return decode_into(codec, plain, dst, n)
    except CodecError:
        return None


VERIFY_CHUNK_BYTES = 1 << 20  # hashed, then copied while the hash left it in cache (L2 2 MiB here)


def verified_copy_py(stored: memoryview, dst: memoryview, checksum: int) -> bool:
    """Copy ``stored`` into ``dst``; whether its xxh3-64 is ``checksum``. The fallback of
    ``tiers._verify.verified_copy`` (tiers/native/verify.c), which hashes and stores each
    stripe in one pass without the GIL; this one is the slower of the two.

    Each chunk is hashed first and copied right after, from the cache the hash just filled
    (copying first and hashing the copy was slower). A block of one chunk that fails is not
    copied at all. It verifies what reaches
    ``dst`` because the bytes hashed and the bytes copied are the same pages of one read
    transaction: LMDB never rewrites a page a live reader sees (copy-on-write), and no other
    process writes the folder (its flock). The codec and cipher paths read the map the same
    way: hash, then decode or decrypt.
    """
    n = len(stored)
    if n <= VERIFY_CHUNK_BYTES:
        if xxhash.xxh3_64_intdigest(stored) != checksum:
            return False
        dst[:n] = stored
        return True
    hasher = xxhash.xxh3_64()  # streamed, the digest equals the one-shot one put() stored
    for start in range(0, n, VERIFY_CHUNK_BYTES):
        chunk = stored[start : start + VERIFY_CHUNK_BYTES]
        hasher.update(chunk)
        dst[start : start + len(chunk)] = chunk
    return hasher.intdigest() == checksum


try:
    from tiers import _verify  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler
    _verify = None
    verified_copy = verified_copy_py
else:
    verified_copy = _verify.verified_copy
# ``tiers._verify`` (tiers/native/verify.c), None where it is not built: also the tier's batched
# loop over plain blocks, ``read_plain``.
native = _verify

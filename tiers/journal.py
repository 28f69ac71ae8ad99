"""The arena journal: which slots of a shared-memory arena hold committed blocks.

An arena lives in ``/dev/shm``, so it outlives a server killed with SIGKILL. The journal, a file
beside it (``<arena>.journal``, mode 0600), makes its contents usable afterwards: the tier
appends a ``commit`` record (slot, key, fingerprint, meta, checksum) after a block's bytes are in its slot
and before the block is visible, and a ``free`` record before a slot can be handed out again. A
block whose bytes a same-host client wrote in place is committed without a checksum; the tier's
hasher takes it just after and appends a ``summed`` record (slot, key, checksum) that replay
joins to the slot's commit.
Replaying the journal of a dead server's arena (``salvage``) therefore names exactly the slots
that held acknowledged blocks at the moment of the crash, each with the bytes it was committed
with: a slot reserved but never committed has no record, a freed one has its ``free``. A record
torn by the crash fails its CRC and ends the replay there (it was never acknowledged). The
checksum is the xxh3-64 of the bytes the block was committed with (``tiers.slab``): salvage
copies only a slot whose bytes still match it (a process that mapped the arena may have written
there since).

Record: u32 length of the rest, u8 kind (3 commit, 2 free, 4 summed: no fingerprint or meta; kind
1, a commit without its checksum, is an older layout and ends the replay), u64 offset, u64 size, u16 key length + key,
fingerprint[32], u16 meta length + meta, u8 whether a checksum follows, u64 checksum, u32 CRC32
of everything before it.

The file grows by one record per commit and per free; when it passes ``compact_bytes``, or
twice its size after the last rewrite if that is more (so a large live set is not rewritten at
every commit), the tier rewrites it from its live index (``rewrite``: a new file renamed over
the old, atomic). Its live size is about 0.4 KiB per block in the arena.

Thread rules: not thread-safe; the tier calls it under its own lock.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

COMMIT, FREE, SUMMED = 3, 2, 4
_HEAD = struct.Struct("<IBQQ")  # length, kind, offset, size
_CRC = struct.Struct("<I")
_SUM = struct.Struct("<BQ")  # whether a checksum was taken, the checksum
DEFAULT_COMPACT_BYTES = 64 << 20


class JournalRecord(NamedTuple):  # a tuple: one is built for every block committed
    offset: int
    size_bytes: int
    key: bytes
    fingerprint: bytes
    meta: bytes
    checksum: int | None = None  # xxh3-64 of the committed bytes; None: none was taken


_LAYOUTS: dict[tuple[int, int], struct.Struct] = {}  # (key length, meta length) -> the record


def _layout(key_len: int, meta_len: int) -> struct.Struct:
    """The whole record but its CRC, as one struct: one pack for a record of these lengths."""
    layout = _LAYOUTS.get((key_len, meta_len))
    if layout is None:
        if len(_LAYOUTS) > 256:  # lengths a deployment uses are few; never let it grow without end
            _LAYOUTS.clear()
        layout = _LAYOUTS[key_len, meta_len] = struct.Struct(f"<IBQQH{key_len}s32sH{meta_len}sBQ")
    return layout


Fields = tuple[int, int, bytes, bytes, bytes, int | None]  # a JournalRecord's, in a plain tuple

_FREE_RECORD = _layout(0, 0)  # a free record: no key, fingerprint or meta (a victim's, each)
_NO_FINGERPRINT = bytes(32)


def _encode_records(kind: int, records: Iterable[Fields]) -> bytes:
    """Records of ``kind`` for ``records`` (offset, size, key, fingerprint, meta, checksum), one after the
    other; the layout looked up once for a run of equal lengths (a commit's blocks all have them)."""
    out: list[bytes] = []
    append, crc, pack_crc = out.append, zlib.crc32, _CRC.pack
    lengths: tuple[int, int] | None = None
    layout = _HEAD  # replaced at the first record
    for offset, size, key, fingerprint, meta, checksum in records:
        if len(fingerprint) != 32:
            fingerprint = fingerprint.ljust(32, b"\0")[:32]
        if lengths != (len(key), len(meta)):
            lengths = (len(key), len(meta))
            layout = _layout(*lengths)
        summed = checksum is not None
        record = layout.pack(
            layout.size,
            kind,
            offset,
            size,
            lengths[0],
            key,
            fingerprint,
            lengths[1],
            meta,
            summed,
            checksum or 0,
        )
        append(record)
        append(pack_crc(crc(record)))
    return b"".join(out)


def _encode(
    kind: int,
    offset: int,
    size: int,
    key: bytes,
    fingerprint: bytes,
    meta: bytes,
    checksum: int | None = None,
) -> bytes:
    return _encode_records(kind, ((offset, size, key, fingerprint, meta, checksum),))


class Journal:
    def __init__(self, path: str, compact_bytes: int = DEFAULT_COMPACT_BYTES) -> None:
        self.path = path
        self.compact_bytes = compact_bytes
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        self._size = 0
        self._rewritten_size = 0  # the file's size right after the last rewrite
        self._frees: list[bytes] = []  # free records not written yet (free(later=True))

    @property
    def needs_compaction(self) -> bool:
        return self._size > max(self.compact_bytes, 2 * self._rewritten_size)

    def commit(self, record: JournalRecord) -> None:
        self.commit_many([record])

    def commit_many(self, records: Sequence[Fields]) -> None:
        """One commit record per block (a ``JournalRecord`` or a plain tuple of its fields),
        appended in one write (O_APPEND keeps them together), after the frees kept for later."""
        self._append(b"".join(self._frees) + _encode_records(COMMIT, records))
        self._frees.clear()

    def summed_many(self, sums: Sequence[tuple[int, bytes, int]]) -> None:
        """A summed record for each (slot offset, key, checksum): the checksum the hasher took of
        a block committed without one, appended in one write."""
        self._append(_encode_records(SUMMED, ((o, 0, k, _NO_FINGERPRINT, b"", c) for o, k, c in sums)))

    def free(self, offset: int, later: bool = False) -> None:
        """A free record for the slot at ``offset``; ``later``: kept until ``write_frees`` (or
        the next commit), which writes the ones kept in one write. The tier writes them before
        it hands a slot out: until then a free that waits only leaves a salvage the block that
        was there, whole."""
        record = _FREE_RECORD.pack(_FREE_RECORD.size, FREE, offset, 0, 0, b"", _NO_FINGERPRINT, 0, b"", 0, 0)
        self._frees.append(record + _CRC.pack(zlib.crc32(record)))
        if not later:
            self.write_frees()

    def write_frees(self) -> None:
        if self._frees:
            self._append(b"".join(self._frees))
            self._frees.clear()

    def _append(self, data: bytes) -> None:
        os.write(self._fd, data)  # tmpfs: a memory copy; O_APPEND keeps records whole and ordered
        self._size += len(data)

    def rewrite(self, live: Iterable[JournalRecord]) -> None:
        """Replace the file by one commit record per live block (atomic rename)."""
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        size = 0
        try:
            chunk = bytearray()
            for r in live:
                chunk += _encode(COMMIT, *r)
                if len(chunk) > 1 << 20:
                    os.write(fd, chunk)
                    size += len(chunk)
                    chunk.clear()
            os.write(fd, chunk)
            size += len(chunk)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self._frees.clear()  # the live set written is after them
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._size = self._rewritten_size = size

    def close(self, remove: bool) -> None:
        if not remove:
            self.write_frees()
        os.close(self._fd)
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def replay(path: str) -> dict[int, JournalRecord]:
    """The live commit records of a journal, by slot offset; a torn tail is ignored."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}
    live: dict[int, JournalRecord] = {}
    pos = 0
    while pos + 4 <= len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        end = pos + 4 + length
        if length < _HEAD.size - 4 + _CRC.size or end > len(data):
            break
        record = data[pos : end - _CRC.size]
        if zlib.crc32(record) != _CRC.unpack_from(data, end - _CRC.size)[0]:
            break
        _, kind, offset, size = _HEAD.unpack_from(record, 0)
        if kind == FREE:
            live.pop(offset, None)
        elif kind in (COMMIT, SUMMED):
            at = _HEAD.size
            (key_len,) = struct.unpack_from("<H", record, at)
            key = bytes(record[at + 2 : at + 2 + key_len])
            at += 2 + key_len
            fingerprint = record[at : at + 32]
            (meta_len,) = struct.unpack_from("<H", record, at + 32)
            meta = record[at + 34 : at + 34 + meta_len]
            summed, checksum = _SUM.unpack_from(record, at + 34 + meta_len)
            if kind == COMMIT:
                live[offset] = JournalRecord(
                    offset, size, key, bytes(fingerprint), bytes(meta), checksum if summed else None
                )
            elif (committed := live.get(offset)) is not None and committed.key == key:
                live[offset] = committed._replace(checksum=checksum)  # the block still in the slot
        else:
            break
        pos = end
    return live


def records_in(live: dict[int, JournalRecord], region_bytes: int) -> Iterator[JournalRecord]:
    """The live records whose slot lies inside a region of ``region_bytes``, by offset."""
    for offset in sorted(live):
        record = live[offset]
        if offset + record.size_bytes <= region_bytes:
            yield record

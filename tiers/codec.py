"""Encoding of block payloads on a medium: identity, zstd, and zstd over bf16 byte planes.

Calls:
    encode(codec, payload, level)                  -> the stored bytes (a new object; never aliases
                                                      ``payload`` unless it already is ``bytes``)
    decode_into(codec, stored, out, payload_len)   -> ``payload_len``, after writing the decoded
                                                      payload into ``out[:payload_len]``

Stored layouts (the block header carries ``codec`` and ``payload_len``, so nothing here is
self-describing):

    NONE            the payload itself
    ZSTD            one zstd frame of the payload (content size in the frame header)
    ZSTD_BYTEPLANE  low plane (payload_len // 2 bytes, raw) | odd tail byte (0 or 1 byte, raw)
                    | one zstd frame of the high plane (payload_len // 2 bytes)

Why byte planes: KV caches are mostly bf16. The high byte of a bf16 holds the sign and most of
the exponent and compresses well; the low byte is mantissa noise that zstd cannot shrink and
only slows it down. Measured on ``torch.randn(...).to(torch.bfloat16)``: ratio ~1.29 for plain
zstd level 1, ~1.46 for the byte-plane layout. Elements are read as little-endian 16-bit words
whatever the host order; a payload of odd length keeps its last byte raw as the tail.

Threads: every function may be called from any thread. zstd contexts are not thread-safe, so
each thread keeps its own (``threading.local``) and reuses it across calls.

Buffers: ``encode`` reads ``payload`` only while it runs. ``decode_into`` reads ``stored`` only
while it runs (it may be a view of an LMDB map that dies with its transaction) and writes only
``out[:payload_len]``. On a CodecError the contents of ``out[:payload_len]`` are unspecified.
"""

from __future__ import annotations

import threading

import numpy as np

from tiers.base import BytesLike, Codec

try:
    import zstandard
except ModuleNotFoundError:  # the zstd extra; without it only Codec.NONE encodes and decodes
    zstandard = None  # type: ignore[assignment]

DEFAULT_ZSTD_LEVEL = 1

_LE_U16 = np.dtype("<u2")


class CodecError(ValueError):
    """Stored bytes that do not decode to the promised payload (corrupt or mislabeled).

    Tiers verify the checksum of the stored bytes before decoding, so inside a tier this
    signals a bug or a checksum collision; a tier treats it like a checksum failure (a miss).
    """


class _Contexts(threading.local):
    """Per-thread zstd contexts, created on first use and then reused."""

    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self.decompressor = zstandard.ZstdDecompressor()

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        found = self.compressors.get(level)
        if found is None:
            found = zstandard.ZstdCompressor(level=level, write_content_size=True)
            self.compressors[level] = found
        return found


_contexts = _Contexts() if zstandard is not None else None


def _zstd_contexts() -> _Contexts:
    """This thread's contexts; CodecError without zstandard (the server refuses to start with a
    zstd codec then, so only a block stored before it was uninstalled meets this: a miss)."""
    if _contexts is None:
        raise CodecError("a zstd block needs zstandard, not installed: pip install 'kvstore[zstd]'")
    return _contexts


def encode(codec: Codec, payload: BytesLike, level: int = DEFAULT_ZSTD_LEVEL) -> bytes:
    """Return the stored form of ``payload`` under ``codec``.

    For ``Codec.NONE`` this is ``payload`` itself when it already is ``bytes`` (immutable,
    safe to hold) and a copy otherwise. Compressed forms may be longer than the payload on
    incompressible data; whether to keep them is the caller's choice.
    """
    view = byte_view(payload)
    if codec is Codec.NONE:
        return payload if isinstance(payload, bytes) else bytes(view)
    if codec is Codec.ZSTD:
        return _zstd_contexts().compressor(level).compress(view)
    if codec is Codec.ZSTD_BYTEPLANE:
        return _encode_byteplane(view, level)
    raise ValueError(f"unknown codec {codec!r}")


def decode_into(codec: Codec, stored: BytesLike, out: memoryview, payload_len: int) -> int:
    """Decode ``stored`` into ``out[:payload_len]`` and return ``payload_len``.

    Raises ValueError when ``out`` is too short, CodecError when ``stored`` does not decode to
    exactly ``payload_len`` bytes.
    """
    dst = byte_view(out)
    if len(dst) < payload_len:
        raise ValueError(f"output buffer holds {len(dst)} bytes, payload needs {payload_len}")
    src = byte_view(stored)
    if codec is Codec.NONE:
        if len(src) != payload_len:
            raise CodecError(f"raw block holds {len(src)} bytes, header says {payload_len}")
        dst[:payload_len] = src
    elif codec is Codec.ZSTD:
        _zstd_into(src, dst[:payload_len])
    elif codec is Codec.ZSTD_BYTEPLANE:
        _decode_byteplane(src, dst[:payload_len])
    else:
        raise ValueError(f"unknown codec {codec!r}")
    return payload_len


def byte_view(buffer: BytesLike) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (no copy; TypeError otherwise): the
    buffer itself when it is one already (a restore's buffers mostly are; a view made again
    costs ~0.15 us a block)."""
    if type(buffer) is memoryview and buffer.format == "B" and buffer.ndim == 1:
        return buffer
    view = memoryview(buffer)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _encode_byteplane(view: memoryview, level: int) -> bytes:
    half = len(view) // 2
    words = np.frombuffer(view, dtype=_LE_U16, count=half)
    low = np.empty(half, dtype=np.uint8)
    high = np.empty(half, dtype=np.uint8)
    np.bitwise_and(words, 0xFF, out=low, casting="unsafe")
    np.right_shift(words, 8, out=high, casting="unsafe")
    compressed_high = _zstd_contexts().compressor(level).compress(high.data)
    return b"".join((low.data, view[2 * half :], compressed_high))


def _decode_byteplane(src: memoryview, dst: memoryview) -> None:
    payload_len = len(dst)
    half = payload_len // 2
    tail = payload_len - 2 * half
    if len(src) < half + tail:
        raise CodecError(f"byte-plane block of {len(src)} bytes is shorter than its raw plane")
    high = _zstd_bytes(src[half + tail :], half)
    words = np.frombuffer(dst, dtype=_LE_U16, count=half)
    # Build each word in place: high byte shifted up, then the low byte or-ed in.
    np.left_shift(np.frombuffer(high, dtype=np.uint8), 8, out=words, dtype=_LE_U16, casting="unsafe")
    np.bitwise_or(words, np.frombuffer(src, dtype=np.uint8, count=half), out=words, casting="unsafe")
    dst[2 * half :] = src[half : half + tail]


def _zstd_bytes(src: memoryview, expected_len: int) -> bytes:
    decompressor = _zstd_contexts().decompressor
    try:
        plain = decompressor.decompress(src, max_output_size=max(expected_len, 1))
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd frame does not decode: {exc}") from exc
    if len(plain) != expected_len:
        raise CodecError(f"zstd frame decodes to {len(plain)} bytes, expected {expected_len}")
    return plain


def _zstd_into(src: memoryview, dst: memoryview) -> None:
    """Decompress one zstd frame straight into ``dst``, which it must fill exactly."""
    expected = len(dst)
    got = 0
    decompressor = _zstd_contexts().decompressor
    try:
        with decompressor.stream_reader(src) as reader:
            while got < expected:
                n = reader.readinto(dst[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd frame does not decode: {exc}") from exc
    if got != expected or extra:
        raise CodecError(
            f"zstd frame decodes to {'more than ' if extra else ''}{got} bytes, expected {expected}"
        )

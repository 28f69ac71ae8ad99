"""Block frames of the Get and Put streams, written and read by hand.

A frame is a valid protobuf ``kvstore.v1.BlockFrame`` (so generic tools can decode it), but
neither side runs a protobuf serializer over it: encoding joins a few header bytes with the
payload (one copy), decoding walks the tags and returns the payload as a memoryview of the
received message (no copy). Field numbers must match ``proto/kvstore.proto``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvstore.errors import InvalidArgument

_KEY, _PAYLOAD, _FINGERPRINT, _PARENT, _SCOPE, _CHECKSUM = 1, 2, 3, 4, 5, 6
_LEN_DELIMITED, _FIXED64 = 2, 1
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class Frame:
    key: bytes
    payload: memoryview
    fingerprint: bytes = b""
    parent: bytes = b""
    scope: str = ""
    checksum: int | None = None  # xxh3-64 of the payload, in a Get frame


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | _LEN_DELIMITED) + _varint(len(value)) + value


def encode_frame(
    key: bytes,
    payload: bytes | bytearray | memoryview,
    fingerprint: bytes = b"",
    parent: bytes = b"",
    scope: str = "",
    checksum: int | None = None,
) -> bytes:
    head = [_field(_KEY, key)]
    if checksum is not None:
        head.append(_varint(_CHECKSUM << 3 | _FIXED64) + _U64.pack(checksum))
    if fingerprint:
        head.append(_field(_FINGERPRINT, fingerprint))
    if parent:
        head.append(_field(_PARENT, parent))
    if scope:
        head.append(_field(_SCOPE, scope.encode()))
    head.append(_varint(_PAYLOAD << 3 | _LEN_DELIMITED) + _varint(len(payload)))
    return b"".join([*head, payload])


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise InvalidArgument("malformed block frame: truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def decode_frame(message: bytes) -> Frame:
    """Parse one frame; the payload aliases ``message``. Raises InvalidArgument when malformed."""
    buf = memoryview(message)
    fields: dict[int, memoryview] = {}
    checksum: int | None = None
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _LEN_DELIMITED:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise InvalidArgument(f"malformed block frame: field {number} runs past the end")
            fields[number] = buf[pos : pos + length]
            pos += length
        elif wire_type == 0:
            _, pos = _read_varint(buf, pos)
        elif wire_type in (1, 5):
            end = pos + (8 if wire_type == 1 else 4)
            if end > len(buf):
                raise InvalidArgument(f"malformed block frame: field {number} runs past the end")
            if number == _CHECKSUM and wire_type == _FIXED64:
                (checksum,) = _U64.unpack_from(buf, pos)
            pos = end
        else:
            raise InvalidArgument(f"malformed block frame: wire type {wire_type}")
    if _KEY not in fields:
        raise InvalidArgument("block frame without a key")
    try:
        scope = bytes(fields.get(_SCOPE, b"")).decode()
    except UnicodeDecodeError as exc:
        raise InvalidArgument("block frame scope is not UTF-8") from exc
    return Frame(
        key=bytes(fields[_KEY]),
        payload=fields.get(_PAYLOAD, memoryview(b"")),
        fingerprint=bytes(fields.get(_FINGERPRINT, b"")),
        parent=bytes(fields.get(_PARENT, b"")),
        scope=scope,
        checksum=checksum,
    )

"""Which block lengths a shared kvstore node takes under a registered layout. A sidecar's value
is its payload framed (``tiers.remote.frame``: a u16 length and a version-3 header, 73 bytes in
all) and, with encryption on, sealed first (``tiers.sealed_remote``: 36 bytes more), so a node
that checked lengths against the layout alone refused every sidecar's copy of a model
registered there. The node checks the payload's length under those frames; what else a value
holds is the sidecar's to check when it reads it back (header, checksum, AEAD tag), and a
client that reads blocks of one layout asks for exact lengths (``get_into(exact=True)``)."""

from __future__ import annotations

from tiers.base import BlockHeader, Codec
from tiers.sealed_remote import SEALED_OVERHEAD_BYTES

FRAME_BYTES = 2 + len(BlockHeader(bytes(32), 0, 0, Codec.NONE, 0).pack())
_FRAMES = (0, FRAME_BYTES, FRAME_BYTES + SEALED_OVERHEAD_BYTES)


def fits_layout(size: int, block_bytes: int) -> bool:
    """Whether a value of ``size`` bytes is a block of ``block_bytes``, bare or as a sidecar frames it."""
    return size - block_bytes in _FRAMES

"""Moving HiCache pages between SGLang's host pool and kvstore: the arena or the data port.

    pages = PageTransfer(fingerprint, page_bytes, same_host=True)
    hit = pages.exists(kv, keys)                       # length of the present prefix
    n = pages.read(kv, keys, targets)                  # pages restored: a prefix of keys
    stored = pages.write(kv, keys, sources, parent)    # per key: stored (or already there)

A page is a list of pieces, each a writable uint8 array over host memory: one for a flat data
page (``get_data_page``), or the pieces ``get_page_buffer_meta`` points at (zero copy: K and
V per page, or per layer and page), whose lengths add up to ``page_bytes``. Its kvstore block is
the pieces one after another.

Same host (the sidecar's Unix socket, whose client maps its arena): ``read`` resolves the present
prefix to arena slots pinned under a lease, copies each slot straight into its pieces and
releases the lease; ``write`` reserves slots, copies the pieces straight in and commits (aborts
on any failure). Remote: ``read`` takes the bytes off the data port, ``write`` puts them.

A block whose length is not ``page_bytes`` ends the read there: its page and every later one
count as misses and their host memory is not written. Buffers: no view of the arena outlives a
call. Errors: every ``KvStoreError`` passes to the caller (``engine_plugin.sidecar.SidecarLink``
turns it into a miss), except a release that fails after a read's copies are done: the read
stands and the pin expires on its own. Thread rules: none of its own; the arrays must not be
written by anyone else during a call.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import numpy as np
import torch

from engine_plugin.transfer import release_after_load
from kvstore.client import Client
from kvstore.client.inplace import gather_from_slots, scatter_into_slots
from kvstore.keys import BlockKey, Fingerprint

log = logging.getLogger(__name__)

Page = list[np.ndarray]  # pieces of one page, uint8, in block order


def flat_page(tensor: torch.Tensor) -> Page:
    """The one piece of a flat data page (a contiguous host tensor), sharing its memory."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"a flat page must be a contiguous host tensor, got {tensor.device}")
    return [tensor.view(-1).view(torch.uint8).numpy()]


def pointed_pages(pointers: Sequence[int], sizes: Sequence[int], n_pages: int) -> list[Page]:
    """Pages over host memory that ``get_page_buffer_meta`` describes: ``len(pointers) //
    n_pages`` pieces a page, in order."""
    if n_pages == 0 or len(pointers) % n_pages or len(pointers) != len(sizes):
        raise ValueError(f"{len(pointers)} pointers and {len(sizes)} sizes do not make {n_pages} pages")
    per_page = len(pointers) // n_pages
    pieces = [
        np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))
        for ptr, size in zip(pointers, sizes, strict=True)
    ]
    return [pieces[i * per_page : (i + 1) * per_page] for i in range(n_pages)]


class PageTransfer:
    def __init__(self, fingerprint: Fingerprint, page_bytes: int, same_host: bool) -> None:
        self.fingerprint = fingerprint
        self.page_bytes = page_bytes
        self._same_host = same_host

    def exists(self, kv: Client, keys: Sequence[BlockKey]) -> int:
        return kv.lookup(self.fingerprint, keys)

    def read(self, kv: Client, keys: Sequence[BlockKey], targets: Sequence[Page]) -> int:
        """Copy the present prefix of ``keys`` into ``targets``; how many pages."""
        if self._same_host:
            resolved = kv.resolve(self.fingerprint, keys)
            try:
                return self._scatter(resolved.views, targets)
            finally:
                if resolved.lease_id:
                    release_after_load(kv, resolved.lease_id)
        return self._scatter(kv.get(self.fingerprint, keys), targets)

    def write(
        self, kv: Client, keys: Sequence[BlockKey], sources: Sequence[Page], parent: BlockKey | None
    ) -> list[bool]:
        """Store ``sources`` under ``keys`` (a chain after ``parent``); per key, whether kvstore
        holds it now (False: no room for it)."""
        for page in sources:
            self._check(page)
        if not self._same_host:
            blocks = [np.concatenate(page) if len(page) > 1 else page[0] for page in sources]
            kv.put(self.fingerprint, keys, [b.data for b in blocks], parent=parent)
            return [True] * len(keys)
        pending = kv.reserve(self.fingerprint, keys, [self.page_bytes] * len(keys), parent=parent)
        try:
            for view, page in zip(pending.views, sources, strict=True):
                if view is not None:  # None: already stored, or no room
                    scatter_into_slots(view, _pieces_of(page), [piece.data for piece in page])
        except BaseException:
            kv.abort(pending.reservation_id)
            raise
        kv.commit(pending.reservation_id)
        skipped = [k for k, view in zip(keys, pending.views, strict=True) if view is None]
        present = iter(kv.exists(self.fingerprint, skipped) if skipped else [])
        return [view is not None or next(present) for view in pending.views]

    def _scatter(self, blocks: Sequence[bytes | memoryview], targets: Sequence[Page]) -> int:
        n = 0
        for block, page in zip(blocks, targets, strict=False):
            if len(block) != self.page_bytes:
                log.warning(
                    "kvstore returned %d B for a page of %d B: served as a miss from there",
                    len(block),
                    self.page_bytes,
                )
                break
            self._check(page)
            gather_from_slots(memoryview(block), _pieces_of(page), [piece.data for piece in page])
            n += 1
        return n

    def _check(self, page: Page) -> None:
        size = sum(piece.size for piece in page)
        if size != self.page_bytes:
            raise ValueError(f"a page of {size} B where the model's pages are {self.page_bytes} B")


def _pieces_of(page: Page) -> list[tuple[int, int]]:
    """Where each piece of a page lies in its block: (offset, size), one after another. A page's
    copies are then one native call (``kvstore.client.inplace``), not one numpy copy a piece: a
    layer-first page has two pieces a layer."""
    out, offset = [], 0
    for piece in page:
        out.append((offset, piece.size))
        offset += piece.size
    return out

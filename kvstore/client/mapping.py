"""The server's arena mapped into this process: what same-host calls read and write in place.

Only a client on the server's Unix socket maps it (``attach``, once); the server names the
arena in every answer that points into it, and a name other than the mapped one means the
server restarted with a new arena: the old mapping is dropped and the new one mapped, so no
slot of the new arena is ever read out of the old mapping. A client that shares the socket but
not the server's ``/dev/shm`` (another container) cannot map it: ``mapped()`` asks once and
then says no, and its reads go through the socket.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvstore.client.translate import translated
from kvstore.errors import FailedPrecondition, Unavailable
from tiers.dram import Arena


class ArenaMapping:
    """``arena_name()`` is the client's Attach call (the name of the arena to map); it is
    called only where ``same_host``. Safe to share between threads."""

    def __init__(self, same_host: bool, arena_name: Callable[[], str]) -> None:
        self._same_host = same_host
        self._arena_name = arena_name
        self._arena: Arena | None = None
        self._lock = threading.Lock()
        self._unmappable = False  # the arena could not be mapped here: reads go through the socket
        self._pin = False  # register every arena mapped with CUDA (pin_for_cuda)

    def attach(self) -> Arena:
        """Map the server's arena (once)."""
        with self._lock:
            if self._arena is None:
                if not self._same_host:
                    raise FailedPrecondition("the arena is for same-host clients on the Unix socket")
                name = self._arena_name()
                try:
                    self._arena = _map(name, self._pin)
                except Unavailable:
                    self._unmappable = True
                    raise
            return self._arena

    def pin_for_cuda(self) -> bool:
        """Register the mapping (and any later one) as pinned memory with CUDA; whether it is."""
        self._pin = True
        arena = self.attach()
        with self._lock:
            return arena.pin_with_cuda()

    def mapped(self) -> bool:
        """Whether blocks can be read out of the arena here: on the Unix socket, once it maps."""
        if self._arena is not None:
            return True
        if self._unmappable or not self._same_host:
            return False
        try:
            self.attach()
        except Unavailable:
            if self._unmappable:
                return False
            raise
        except FailedPrecondition:  # a server without an arena to map: the socket it is
            self._unmappable = True
            return False
        return True

    def named(self, name: str) -> Arena:
        """The mapped arena, re-mapped when the server now serves another one."""
        with self._lock:
            if self._arena is not None and name and self._arena.name != name:
                stale, self._arena = self._arena, None  # a mapping that fails leaves none
                stale.close()
                self._arena = _map(name, self._pin)
            assert self._arena is not None
            return self._arena

    def region(self, name: str) -> memoryview:
        return self.named(name).view

    def views(self, name: str, slots: Sequence[tuple[int, int]]) -> list[memoryview]:
        view = self.named(name).view
        return [view[o : o + n] for o, n in slots]

    def slot_views(self, name: str, slots: Sequence[tuple[int, int] | None]) -> list[memoryview | None]:
        view = self.named(name).view
        return [None if slot is None else view[slot[0] : slot[0] + slot[1]] for slot in slots]

    def close(self) -> None:
        with self._lock:
            if self._arena is not None:
                self._arena.close()
                self._arena = None


def _map(name: str, pin_with_cuda: bool) -> Arena:
    with translated(f"mapping the server's arena {name}"):
        arena = Arena.attach(name)
    if pin_with_cuda:
        arena.pin_with_cuda()
    return arena

"""Whole blocks between host buffers and caches on a GPU, staged on the device.

A block's bytes lie in many places of the caches (a slice per layer, two for K and V apart):
tens of KiB each at vLLM's block sizes. A ``copy_`` per slice of every block costs more in
dispatch than in moving bytes (measured on an H200, 2 MiB blocks of a 32-layer kv-split model:
1.5 GB/s, 0.03x of one pinned copy of the same bytes). ``StagedCopier`` instead moves up to
``STAGE_BYTES`` of whole blocks at a time between the host and a staging tensor on the device
(one copy per run of buffers lying end to end, an arena's slots of one chain), and moves each
slice of all the staged blocks in one kernel (``index_copy_`` / ``index_select`` on the
caches' rows, in the widest words every slice is made of).

On CUDA nothing runs on the engine's stream and nothing waits for the whole device: a copy
runs on the copier's own copy stream, which first waits (on the device) for what the engine's
current stream had issued: the forward's writes a save reads, earlier reads of blocks a load
overwrites. Its host copies run on a side stream, two stages alternating: the copy of one batch
overlaps the kernels of the one before; events order each stage's reuse. A call ends by
recording an event after all of it (``done``); the engine's current stream waits for that event
on the device (a whole copy) or for one event per layer (``scatter_by_layer``, each awaited by
``wait_for_layer_load``), and the host waits for ``done`` alone (``synchronize``) before a slot
is released or committed: until then the host buffers must stay as they are (the caller holds
the lease or the reservation). On the CPU the same code runs in order, no streams, no events:
that is how it is tested without a GPU.

A full batch's kernels (a slice of each layer: 64 for a 32-layer kv-split model) cost more to
issue from Python than to run: measured on an H200, 256 blocks of 2 MiB, 6.5 ms of issuing
against 1.4 ms on the device, and the issuing of the first batch of a save (the last of a
restore) is not overlapped by any copy. So on CUDA, once a full batch of a stage has run its
kernels one by one, they are captured into a CUDA graph over that stage's buffer and a fixed
index tensor, and every later full batch of that stage is one replay (``replays`` counts
them). Partial batches and layer-wise restores issue their kernels as before; a capture that
fails leaves the copier issuing them one by one.

A layer-wise restore stages whole blocks as a whole restore does, so its first layer waits for
every block's bytes to reach the device; what overlaps the forward is the layers' kernels.

Thread rules: one call at a time per copier (the connector's worker thread).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

import torch

from engine_plugin.host_buffers import Buffer, tensor_runs

log = logging.getLogger(__name__)

STAGE_BYTES = 64 << 20  # staged on the device at a time, per stage (two stages)

Places = Sequence[tuple[int, int, int]]  # (start, stride, size) in bytes of each slice of a layer


class StagedCopier:
    """See the module docstring. ``places_of``: per layer, the slices of a block in the order
    they are stored; ``caches[l]`` holds slice ``(start, stride, size)`` of block ``b`` at byte
    ``start + b * stride`` of its storage (past its storage offset)."""

    def __init__(self, caches: Sequence[torch.Tensor], places_of: Sequence[Places], num_blocks: int) -> None:
        self.device = caches[0].device
        self.word = _widest_word(caches, places_of)
        self._rows: list[list[tuple[torch.Tensor, slice]]] = []  # per layer: rows and their words
        width, offset = self.word.itemsize, 0
        for cache, places in zip(caches, places_of, strict=True):
            layer = []
            for start, stride, size in places:
                words = slice(offset // width, (offset + size) // width)
                layer.append((rows_of(cache, start, stride, size, num_blocks, self.word), words))
                offset += size
            self._rows.append(layer)
        self.block_bytes = offset
        self.stage_blocks = max(1, STAGE_BYTES // max(1, offset))
        # On CUDA: the two stages kept for the copier's life (a graph holds their addresses),
        # the index tensor the graphs read, and a graph per (direction, stage) once captured
        # (None: its capture failed).
        self._graphing = self.device.type == "cuda"
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._graph_ids: torch.Tensor | None = None
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph | None] = {}
        self.replays = 0
        self._done: torch.cuda.Event | None = None  # recorded after the last call's work

    def scatter(
        self, sources: Sequence[Buffer], block_ids: Sequence[int], layers: Sequence[int] | None = None
    ) -> None:
        """Stored blocks ``sources`` into blocks ``block_ids`` (checked by the caller); the
        engine's stream waits for them on the device."""
        with self._copy_stream(join=True):
            self._scatter(sources, block_ids, layers)

    def scatter_by_layer(self, sources: Sequence[Buffer], block_ids: Sequence[int]) -> DeviceLayerCopy:
        """``scatter`` every layer, the engine's stream not joined: it waits for each layer's
        event (``DeviceLayerCopy.wait_for``) where that layer is read."""
        marks: list[torch.cuda.Event] = []
        with self._copy_stream(join=False, timed=True) as start:
            self._scatter(sources, block_ids, None, marks)
        assert start is not None and self._done is not None
        return DeviceLayerCopy(self.device, start, marks, self._done, list(sources))

    def _scatter(
        self,
        sources: Sequence[Buffer],
        block_ids: Sequence[int],
        layers: Sequence[int] | None,
        marks: list[torch.cuda.Event] | None = None,
    ) -> None:
        """``marks`` (CUDA): filled with an event per layer, recorded once every block's
        layer is in; the kernels then go a layer at a time."""
        ids = self._ids(block_ids)
        lanes = _Lanes(self.device)
        stages = self._stages(len(sources))
        firsts = range(0, len(sources), self.stage_blocks)
        for n, first in enumerate(firsts):
            batch = sources[first : first + self.stage_blocks]
            words, raw = stages[n % 2]
            with lanes.side(n % 2):  # once the kernels that last read this stage are done
                for start, count, host in tensor_runs(batch, self.block_bytes):
                    raw[start : start + count].view(-1).copy_(host, non_blocking=True)
            lanes.main_waits_side()
            batch_ids = ids[first : first + len(batch)]
            if marks is not None:
                for layer in range(len(self._rows)):
                    self._scatter_kernels(batch_ids, words, (layer,))
                    if n == len(firsts) - 1:
                        marks.append(_event_on(torch.cuda.current_stream(self.device)))
            elif layers is None:
                self._kernels("scatter", n % 2, batch_ids, words)
            else:
                self._scatter_kernels(batch_ids, words, layers)
            lanes.main_done(n % 2)
        lanes.join()

    def gather(self, block_ids: Sequence[int], targets: Sequence[Buffer]) -> None:
        """Blocks ``block_ids`` into ``targets`` (writable, checked by the caller)."""
        with self._copy_stream(join=True):
            self._gather(block_ids, targets)

    def _gather(self, block_ids: Sequence[int], targets: Sequence[Buffer]) -> None:
        ids = self._ids(block_ids)
        lanes = _Lanes(self.device)
        stages = self._stages(len(targets))
        for n, first in enumerate(range(0, len(targets), self.stage_blocks)):
            batch = targets[first : first + self.stage_blocks]
            words, raw = stages[n % 2]
            lanes.main_waits(n % 2)  # once the copy that last read this stage is done
            self._kernels("gather", n % 2, ids[first : first + len(batch)], words)
            with lanes.side():  # once this batch's kernels are done
                for start, count, host in tensor_runs(batch, self.block_bytes):
                    host.copy_(raw[start : start + count].view(-1), non_blocking=True)
            lanes.side_done(n % 2)
        lanes.join()

    def synchronize(self) -> None:
        """The host waits until the last call's copies are done: for them alone, not for the
        engine's stream or the device (nothing to wait for on the CPU)."""
        if self._done is not None:
            self._done.synchronize()

    @contextlib.contextmanager
    def _copy_stream(self, join: bool, timed: bool = False) -> Iterator[torch.cuda.Event | None]:
        """On CUDA: the block's work issued on the copy stream, after what the engine's current
        stream issued so far; ``done`` recorded after it, and with ``join`` the engine's stream
        waits for it on the device. Yields an event recorded first when ``timed``."""
        if self.device.type != "cuda":
            yield None
            return
        engine = torch.cuda.current_stream(self.device)
        copy = _stream(self.device, "copy")
        copy.wait_stream(engine)
        start = _event_on(copy, timed) if timed else None
        try:
            with torch.cuda.stream(copy):
                yield start
        finally:
            self._done = _event_on(copy, timed)
            if join:
                engine.wait_event(self._done)

    def _scatter_kernels(
        self, ids: torch.Tensor, words: torch.Tensor, layers: Sequence[int] | range | None = None
    ) -> None:
        """Staged rows ``words[i]`` into block ``ids[i]``, a kernel a slice of each layer."""
        for layer in range(len(self._rows)) if layers is None else layers:
            for rows, part in self._rows[layer]:
                rows.index_copy_(0, ids, words[: len(ids), part])

    def _gather_kernels(self, ids: torch.Tensor, words: torch.Tensor) -> None:
        """Block ``ids[i]`` into staged row ``words[i]``, a kernel a slice of each layer."""
        for layer in self._rows:
            for rows, part in layer:
                torch.index_select(rows, 0, ids, out=words[: len(ids), part])

    def _kernels(self, direction: str, stage: int, ids: torch.Tensor, words: torch.Tensor) -> None:
        """A batch's kernels (every layer) between the blocks ``ids`` and stage ``stage``'s
        ``words``: one replay where a graph of a full batch of this stage is captured; else one
        by one, and on CUDA, after a full batch's first run, captured for the next."""
        run: Callable[[torch.Tensor, torch.Tensor], None] = (
            self._scatter_kernels if direction == "scatter" else self._gather_kernels
        )
        full = self._graphing and len(ids) == self.stage_blocks
        graph = self._graphs.get((direction, stage)) if full else None
        if graph is not None and self._graph_ids is not None:
            self._graph_ids.copy_(ids)
            graph.replay()
            self.replays += 1
            return
        run(ids, words)  # the first full batch's run also loads every kernel before a capture
        if full and (direction, stage) not in self._graphs:
            self._graphs[(direction, stage)] = self._capture(run, words)

    def _capture(
        self, run: Callable[[torch.Tensor, torch.Tensor], None], words: torch.Tensor
    ) -> torch.cuda.CUDAGraph | None:
        """``run`` over ``words`` and the graphs' index tensor, captured on a stream of its own
        (nothing runs: a capture records). Only this thread's calls may not interrupt it."""
        if self._graph_ids is None:
            self._graph_ids = torch.zeros(self.stage_blocks, dtype=torch.int64, device=self.device)
        current = torch.cuda.current_stream(self.device)
        capture = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        capture.wait_stream(current)
        graph = torch.cuda.CUDAGraph()  # type: ignore[no-untyped-call]
        try:
            with torch.cuda.stream(capture):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    run(self._graph_ids, words)
                finally:
                    graph.capture_end()
        except RuntimeError as exc:  # torch's errors, the CUDA ones too: kernels one by one
            log.warning(
                "the staged copy's kernels could not be captured in a CUDA graph (%s): issued one by one", exc
            )
            self._graphing = False
            return None
        finally:
            current.wait_stream(capture)
        return graph

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.int64).to(self.device, non_blocking=True)

    def _stages(self, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Up to two staging tensors, each of ``stage_blocks`` blocks (fewer for a small copy),
        in words and the same memory as bytes. On CUDA a copy of a full stage or more uses the
        two kept for the copier's life: the only ones a graph reads and writes."""
        if self._graphing and blocks >= self.stage_blocks:
            if not self._kept:
                self._kept = self._new_stages(self.stage_blocks, 2)
            return self._kept
        return self._new_stages(min(blocks, self.stage_blocks), 1 if blocks <= self.stage_blocks else 2)

    def _new_stages(self, per: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (per, self.block_bytes // self.word.itemsize)
        stages = []
        for _ in range(count):
            words = torch.empty(shape, dtype=self.word, device=self.device)
            stages.append((words, words.view(torch.uint8)))
        return stages


class _Lanes:
    """The current stream and a side stream for the host copies, with an event per stage; on
    the CPU (or any device without streams) every call does nothing and work runs in order."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._events: dict[tuple[str, int], torch.cuda.Event] = {}
        if self._cuda:
            self._main = torch.cuda.current_stream(device)  # the copy stream, in a copier's call
            self._side = _stream(device, "side")
            # The kept stages outlive a call: no copy of this one may overtake the kernels of
            # the one before on them (its own copies the main stream waited for at its end).
            self._side.wait_stream(self._main)

    @contextlib.contextmanager
    def side(self, stage: int | None = None) -> Iterator[None]:
        """Issue the block's work on the side stream, once the main stream's work on ``stage``
        is done (``main_done``), or all the main stream's work so far when None."""
        if not self._cuda:
            yield
            return
        if stage is None:
            self._side.wait_stream(self._main)
        elif (event := self._events.get(("main", stage))) is not None:
            self._side.wait_event(event)
        with torch.cuda.stream(self._side):
            yield

    def main_waits_side(self) -> None:
        if self._cuda:
            self._main.wait_stream(self._side)

    def main_waits(self, stage: int) -> None:
        """The main stream's next work waits for the side stream's last copy of ``stage``."""
        if self._cuda and (event := self._events.get(("side", stage))) is not None:
            self._main.wait_event(event)

    def main_done(self, stage: int) -> None:
        self._record("main", stage)

    def side_done(self, stage: int) -> None:
        self._record("side", stage)

    def join(self) -> None:
        """Everything issued on the side stream comes before the main stream's next work."""
        self.main_waits_side()

    def _record(self, lane: str, stage: int) -> None:
        if self._cuda:
            self._events[(lane, stage)] = _event_on(self._main if lane == "main" else self._side)


class DeviceLayerCopy:
    """A restore into caches on a GPU under way a layer at a time (``scatter_by_layer``): the
    same calls as ``kv_layout.HostLayerCopy``, on events. Thread rules: the engine's thread."""

    def __init__(
        self,
        device: torch.device,
        start: torch.cuda.Event,
        marks: list[torch.cuda.Event],
        done: torch.cuda.Event,
        keep: list[Buffer],
    ) -> None:
        self.num_layers = len(marks)
        self._device = device
        self._start, self._marks, self._done = start, marks, done
        self._keep = keep  # the stored blocks, alive while the copy reads them

    def layers_done(self) -> int:
        done = 0
        for mark in self._marks:
            if not mark.query():  # type: ignore[no-untyped-call]
                break
            done += 1
        return done

    def wait_for(self, layers: int) -> None:
        """The engine's current stream waits, on the device, until ``layers`` layers are in;
        the host does not wait."""
        if layers > 0 and self._marks:
            torch.cuda.current_stream(self._device).wait_event(self._marks[min(layers, self.num_layers) - 1])

    def wait(self) -> float:
        """The host waits until every layer is in (this copy alone); its seconds on the device."""
        self._done.synchronize()
        self._keep = []
        return float(self._start.elapsed_time(self._done)) / 1e3


_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def _stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """The process's ``role`` stream on ``device`` ("copy": the copiers' kernels; "side": their
    host copies), made once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, role) not in _STREAMS:
        _STREAMS[(index, role)] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
    return _STREAMS[(index, role)]


def _event_on(stream: torch.cuda.Stream, timed: bool = False) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=timed)  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def rows_of(
    cache: torch.Tensor, start: int, stride: int, size: int, num_blocks: int, word: torch.dtype = torch.uint8
) -> torch.Tensor:
    """``[num_blocks, size / width]`` words of ``word`` (bytes by default) over a cache's own
    storage, on its device, row ``b`` at byte ``start + b * stride`` past its storage offset: a
    view (``as_strided``, bounds-checked by torch), never a copy."""
    width = word.itemsize
    flat = torch.empty(0, dtype=word, device=cache.device).set_(cache.untyped_storage())
    first = int(cache.storage_offset()) * cache.element_size() + start
    return flat.as_strided((num_blocks, size // width), (stride // width, 1), first // width)


def _widest_word(caches: Sequence[torch.Tensor], places_of: Sequence[Places]) -> torch.dtype:
    """The widest integer type whose size divides every slice's place, stride and size (and
    each cache's storage): the kernels move elements of it, 8 bytes at a time where they can."""
    figures: list[int] = []
    for cache, places in zip(caches, places_of, strict=True):
        base = int(cache.storage_offset()) * cache.element_size()
        figures.append(int(cache.untyped_storage().nbytes()))
        for start, stride, size in places:
            figures += [base + start, stride, size]
    for word in (torch.int64, torch.int32, torch.int16):
        if all(f % word.itemsize == 0 for f in figures):
            return word
    return torch.uint8

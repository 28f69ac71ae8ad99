"""Loads that run beside the engine's steps (vLLM's asynchronous KV loads).

A restore that is not a copy out of the sidecar's dram arena on this host — one from nvme, from
a remote tier, or over the data port — can take long enough that running it inside a step would
hold every other request of the batch. For such a restore the scheduler side tells vLLM to let
the request wait (``get_num_new_matched_tokens`` returns ``(tokens, True)``: the request sits in
WAITING_FOR_REMOTE_KVS with its blocks allocated) and the worker side hands the load to an
``AsyncLoader``: its thread restores the blocks while the engine runs the other requests, and
``finished`` reports each load once done, with the blocks it did not restore, for vLLM to
recompute (``get_block_ids_with_load_errors`` of the same step). A same-host copy out of dram
is a memcpy and stays inside the step.

    loader = AsyncLoader(address, connect, identity, transfer, rank)
    loader.start(job)                 # the worker's thread, from start_load_kv
    for done in loader.finished():    # the worker's thread, every step (get_finished)
        done.job, done.loaded, done.seconds, done.tiers

Thread rules: ``start``, ``finished`` and ``shutdown`` are the worker's thread's; the loader's
one thread is the only user of its link (a sidecar client and circuit breaker of its own) and
of ``transfer`` (a block copier and staging buffer of its own: nothing of them is shared with
the worker's saves). It writes
only the blocks vLLM allocated to the waiting requests, which no forward pass reads until the
load is reported finished. The link's failure reports are queued for the worker's thread
(``unreachable``), which owns the stats.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from engine_plugin.sidecar import SidecarLink
from engine_plugin.transfer import BlockTransfer
from engine_plugin.vllm_metadata import TransferJob
from kvstore.address import Address
from kvstore.client import Client
from kvstore.keys import ModelIdentity

log = logging.getLogger(f"vllm.{__name__}")


@dataclass(frozen=True)
class LoadDone:
    job: TransferJob
    loaded: int  # blocks restored: a prefix of ``job.block_ids``; the rest are recomputed
    seconds: float  # from the start of the restore to its end, on the loader's thread


class AsyncLoader:
    def __init__(
        self,
        address: Address,
        connect: Callable[[], Client],
        identity: ModelIdentity,
        transfer: BlockTransfer,
        rank: int,
    ) -> None:
        self.unreachable: queue.SimpleQueue[str] = queue.SimpleQueue()  # calls that failed
        self._link = SidecarLink(address, connect, [identity], self.unreachable.put)
        self._transfer = transfer
        self._rank = rank
        # One thread: the link's client is one caller's, and loads from one sidecar gain
        # little from overlapping each other.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-async-load")
        self._running: dict[str, tuple[TransferJob, Future[tuple[int, float]]]] = {}

    def start(self, job: TransferJob) -> None:
        if job.req_id in self._running:  # never: the scheduler sends a request's load once
            raise ValueError(f"request {job.req_id} already has a load running")
        self._running[job.req_id] = (job, self._pool.submit(self._load, job))

    def finished(self) -> list[LoadDone]:
        """The loads done since the last call (each reported once)."""
        done: list[LoadDone] = []
        for req_id, (job, future) in list(self._running.items()):
            if not future.done():
                continue
            del self._running[req_id]
            try:
                loaded, seconds = future.result()
            except Exception:  # a bug, not the sidecar (the link turns its errors into None)
                log.exception("kvstore connector: request %s's load failed; it is recomputed", req_id)
                loaded, seconds = 0, 0.0
            done.append(LoadDone(job, loaded, seconds))
        return done

    def prepare(self, timeout_s: float) -> bool:
        """Register the arena's mapping of the loader's client with CUDA now, not in a restore
        (``BlockTransfer.prepare``); before any ``start``."""
        return bool(self._link.call("pinning the arena", timeout_s, self._transfer.prepare))

    def wait_any(self, timeout_s: float) -> None:
        """Sleep until a load ends, ``timeout_s`` at most: for a step that ran nothing else.
        vLLM steps again at once while requests wait for their KV, and a loop that spins keeps
        the GIL from the loader's thread (on a busy 2-core host, loads then ran past their
        deadlines)."""
        running = [future for _, future in self._running.values()]
        if running:
            wait(running, timeout=timeout_s, return_when=FIRST_COMPLETED)

    @property
    def running(self) -> int:
        return len(self._running)

    def _load(self, job: TransferJob) -> tuple[int, float]:
        start = time.perf_counter()
        keys = job.rank_keys[self._rank]
        loaded = self._link.call(
            "load", job.timeout_s, lambda kv: self._transfer.fetch(kv, keys, job.block_ids)
        )
        return loaded or 0, time.perf_counter() - start

    def shutdown(self) -> None:
        """Wait for the loads under way (each is bounded by its deadline), then close the link."""
        self._pool.shutdown(wait=True)
        self._link.close()

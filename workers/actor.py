"""The worker: a Ray actor wrapping one engine, one per GPU (or a few CPU threads here).

The engine steps in a thread of its own, so the actor's event loop stays free to take
add/abort/stats calls while a step runs (torch releases the GIL in its kernels). Output
leaves through one long-lived streaming call, `events()`: each item is a StepBatch with
the new tokens of every request in the step and a KV report, never one object per token.
While idle, the worker still reports every `report_interval_s`.

Prefix-cache events (what the engine's cache stored and evicted) ride on the batches for
the router's index, numbered so that a lost batch shows as a gap:

    engine thread, after each step:  drain the engine's KV events -> _pending_kv_events
    events(), handing batches out:   all pending batches merged into one, carrying
                                     KVEventBatch(seq + 1, every pending KV event)
    kv_snapshot():                   answered by the engine thread right after a drain:
                                     KVSnapshot(seq of the last batch handed out, hashes)

Numbering at hand-out, not per step, because a reader that lags gets several steps'
batches merged into one; the router must see 1, 2, 3 with nothing in between. A snapshot
is taken where no KV event is undrained, so it holds every event up to that point: events
still pending go out in later batches, numbered above the snapshot, and replaying an event
the snapshot already holds is harmless (each hash ends where its last event puts it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from workers.engine.cache_events import CacheEvent
from workers.engine.errors import InvalidRequestError
from workers.engine.plan import TokenEvent
from workers.engine.request import FinishReason
from workers.engine.stats import EngineStats
from workers.messages import AddRequest, KVEventBatch, KVSnapshot, StepBatch, WorkerInfo
from workers.config import WorkerConfig
from workers.model.build import create_engine, kv_pool_size, load
from workers.model.tokenizer import TokenizerSpec


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stall:
    seconds: float


@dataclass(frozen=True)
class _Snapshot:
    reply: concurrent.futures.Future[KVSnapshot]


class _Stop:
    pass


_Command = AddRequest | _Abort | _Stall | _Snapshot | _Stop

# KV events left pending with nobody reading, past which they are dropped and the next
# batch skips a number: the router sees a gap and resyncs from a snapshot.
_MAX_PENDING_KV_EVENTS = 1 << 16


class WorkerActor:
    """Wrap with ray.remote(...) (see workers.pool.spawn_worker); methods are async."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._loaded = load(config.engine)
        self.engine = create_engine(config.engine, self._loaded)
        pool = kv_pool_size(config.engine, self._loaded)
        param = next(self._loaded.model.parameters())
        self.info_value = WorkerInfo(
            worker_id=config.worker_id,
            node_id=_node_id(),
            model=self._loaded.name,
            device=str(param.device),
            dtype=str(param.dtype).removeprefix("torch."),
            vocab_size=self._loaded.config.vocab_size,
            max_model_len=self.engine.config.max_model_len,
            block_size=self.engine.config.block_size,
            block_bytes=pool.block_bytes,
            num_blocks=pool.num_blocks,
            tokenizer=TokenizerSpec.of(self._loaded.tokenizer),
            max_num_seqs=self.engine.config.max_num_seqs,
        )
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._pending: list[StepBatch] = []
        self._pending_lock = threading.Lock()  # guards the three below as well
        self._pending_kv_events: list[CacheEvent] = []
        self._kv_events_lost = False  # pending KV events were dropped: the next batch skips a number
        self._kv_seq = 0  # the last KVEventBatch handed out
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stream_epoch = 0
        self._last_report: EngineStats | None = None  # the engine thread's last, for heartbeats
        self._thread = threading.Thread(target=self._run, name=f"engine-{config.worker_id}", daemon=True)
        self._thread.start()

    # -- calls from the router ------------------------------------------------------

    async def info(self) -> WorkerInfo:
        return self.info_value

    async def add_request(self, request: AddRequest) -> None:
        self._commands.put(request)

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def kv_snapshot(self) -> KVSnapshot:
        """Every block hash the engine's prefix cache holds, as of the KVEventBatch
        numbered seq: apply the stream's batches numbered above seq to it, and ignore the
        rest, to follow the cache from here. Taken by the engine thread between two steps."""
        reply: concurrent.futures.Future[KVSnapshot] = concurrent.futures.Future()
        self._commands.put(_Snapshot(reply))
        return await asyncio.wrap_future(reply)

    async def stop(self) -> None:
        """End the engine thread: for an actor used in-process (tests); Ray kills its actors."""
        self._commands.put(_Stop())

    async def inject_stall(self, seconds: float) -> None:
        """Fault injection for chaos tests: the engine thread sleeps, as if a step hung,
        while the actor keeps answering (its heartbeats go on, its steps do not)."""
        self._commands.put(_Stall(seconds))

    async def events(self) -> AsyncIterator[StepBatch]:
        """The worker's output stream: one StepBatch per step (merged if the reader lags),
        and a heartbeat when nothing happened for heartbeat_interval_s.

        One reader at a time: a new call (a restarted router) ends the previous stream, and
        gets whatever is still pending."""
        self._loop = asyncio.get_running_loop()
        self._stream_epoch += 1
        epoch = self._stream_epoch
        if self._wakeup is not None:
            self._wakeup.set()  # the superseded stream wakes up and ends
        wakeup = self._wakeup = asyncio.Event()
        wakeup.set()  # hand over anything already pending at once
        # A wake-up with nothing pending sends a heartbeat: one timer for the stream, not a
        # timeout per step.
        beat = asyncio.create_task(_beat(wakeup, self.config.heartbeat_interval_s))
        try:
            while True:
                await wakeup.wait()
                if epoch != self._stream_epoch:
                    return
                wakeup.clear()
                with self._pending_lock:
                    batches, self._pending = self._pending, []
                    # KV events are pending only beside a batch: they leave together.
                    kv_events = self._take_kv_events() if batches else None
                if batches:
                    yield _merge(batches, kv_events)
                elif self._last_report is not None:
                    yield StepBatch(self._last_report, heartbeat=True, sent_at=time.time())
        finally:
            beat.cancel()

    # -- the engine thread ----------------------------------------------------------

    def _run(self) -> None:
        interval = self.config.report_interval_s
        last_report = 0.0
        last_free = -1
        while True:
            events: list[TokenEvent] = []
            added: list[str] = []
            snapshots: list[_Snapshot] = []
            timeout = None if self.engine.has_unfinished else interval
            try:
                command: _Command | None = self._commands.get(timeout=timeout) if timeout else None
            except queue.Empty:
                command = None
            while True:
                if command is not None:
                    if isinstance(command, _Stop):
                        for snapshot in snapshots:
                            snapshot.reply.cancel()
                        return
                    if isinstance(command, _Stall):
                        time.sleep(command.seconds)
                    elif isinstance(command, _Snapshot):
                        snapshots.append(command)  # answered after this step's KV events are drained
                    else:
                        self._apply(command, events, added)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
            if self.engine.has_unfinished:
                events.extend(self.engine.step())
            now = time.monotonic()
            free = self.engine.allocator.num_free_blocks
            kv_events = self.engine.drain_kv_events()
            if events or added or kv_events or free != last_free or now - last_report >= interval:
                self._publish(StepBatch(self.engine.stats(), tuple(events), tuple(added), sent_at=time.time()), kv_events)
                last_report, last_free = now, free
                # Hand the GIL to the event-loop thread now, so the batch leaves before the
                # next step's Python work, not a whole switch interval later.
                time.sleep(0)
            for snapshot in snapshots:
                # Nothing is undrained here: the snapshot holds every event published so far.
                with self._pending_lock:
                    seq = self._kv_seq
                snapshot.reply.set_result(KVSnapshot(seq, self.engine.cached_block_hashes()))

    def _apply(self, command: AddRequest | _Abort, events: list[TokenEvent], added: list[str]) -> None:
        if isinstance(command, _Abort):
            event = self.engine.abort(command.request_id)
            if event is not None:
                events.append(event)
            return
        try:
            self.engine.add_request(
                command.request_id, command.prompt_ids, command.params, resume=command.resume,
                cache_salt=command.cache_salt,
            )
        except InvalidRequestError as exc:
            # The router validates first; this is the last line of defence, reported per request.
            events.append(TokenEvent(command.request_id, (), "", 0, finish_reason=FinishReason.ERROR, error=str(exc)))
            return
        added.append(command.request_id)

    def _publish(self, batch: StepBatch, kv_events: list[CacheEvent]) -> None:
        self._last_report = batch.report
        with self._pending_lock:
            self._pending.append(batch)
            if len(self._pending) > 256:  # nobody is reading: keep memory bounded
                self._pending = [_merge(self._pending)]
            self._pending_kv_events.extend(kv_events)
            if len(self._pending_kv_events) > _MAX_PENDING_KV_EVENTS:
                self._pending_kv_events.clear()
                self._kv_events_lost = True
        loop, wakeup = self._loop, self._wakeup
        if loop is not None and wakeup is not None:
            loop.call_soon_threadsafe(wakeup.set)

    def _take_kv_events(self) -> KVEventBatch | None:
        """The pending KV events as the next numbered batch, or None if there are none.
        Called with _pending_lock held, by the reader taking the pending batches."""
        if not self._pending_kv_events and not self._kv_events_lost:
            return None
        self._kv_seq += 2 if self._kv_events_lost else 1  # a skipped number: the router resyncs
        batch = KVEventBatch(self._kv_seq, tuple(self._pending_kv_events))
        self._pending_kv_events = []
        self._kv_events_lost = False
        return batch


async def _beat(wakeup: asyncio.Event, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        wakeup.set()


def _merge(batches: list[StepBatch], kv_events: KVEventBatch | None = None) -> StepBatch:
    """One batch saying what all of them say, with the report of the last."""
    if len(batches) == 1 and kv_events is None:
        return batches[0]
    events = tuple(e for b in batches for e in b.events)
    added = tuple(i for b in batches for i in b.added_ids)
    return StepBatch(batches[-1].report, events, added, kv_events=kv_events, sent_at=batches[-1].sent_at)


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - the node id is informational
        pass
    return socket.gethostname()

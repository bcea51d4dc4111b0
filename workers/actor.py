"""The worker: a Ray actor wrapping one engine, one per GPU (or a few CPU threads here).

The engine steps in a process of its own under the actor (workers/engine_process.py), with
a GIL of its own, so neither the actor's event loop (add/abort/stats calls, Ray's stream
hand-offs and serialisation) nor a step waits for the other. A relay thread here takes
each step's batch from it. Output leaves through one long-lived streaming call per
router, `events(router_id)`: each item is a StepBatch with the new tokens of that
router's requests in the step and a KV report, never one object per token. While idle,
the worker still reports every `report_interval_s`.

Several routers may share a worker. Each reads a stream of its own, `events(router_id)`,
fed from an outlet of its own: every outlet gets every KV report and every prefix-cache
event (each router keeps the whole placement picture), and the token events of the
requests that router placed (AddRequest.router_id), and no others. A new stream for the
same router id (that router restarted) ends the previous one and takes over what is
pending. An outlet nobody has read for OUTLET_IDLE_S is dropped, with what was pending.

Prefix-cache events (what the engine's cache stored and evicted) ride on the batches for
the routers' indexes, numbered per outlet so that a lost batch shows as a gap:

    engine process, after each step: drain the engine's KV events; the relay thread here
                                     appends them to every outlet's pending
    events(router_id), handing out:  that outlet's pending batches merged into one, carrying
                                     KVEventBatch(seq + 1, every pending KV event)
    kv_snapshot(router_id):          answered by the engine process right after a drain:
                                     KVSnapshot(the outlet's last seq handed out, hashes)

Numbering at hand-out, not per step, because a reader that lags gets several steps'
batches merged into one; the router must see 1, 2, 3 with nothing in between. A snapshot
is taken where no KV event is undrained, so it holds every event up to that point: events
still pending go out in later batches, numbered above the snapshot, and replaying an event
the snapshot already holds is harmless (each hash ends where its last event puts it).

The worker is the final judge of its KV: an AddRequest with must_fit is taken only if
its blocks at max_tokens fit beside what is committed, counted as

    committed = the last report's num_committed_blocks + the charge of every request taken
                since (not yet in a report)
    charge    = its need less the leading prompt blocks that unfinished requests here,
                any router's, already hold (workers/engine/shared_prefix.py)

checked and counted in one critical section, so two routers that each saw room cannot
both take the last of it; the loser gets AddRefused and places the request elsewhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import itertools
import logging
import os
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import AsyncGenerator
from typing import Any

from workers import events_wire
from workers.config import WorkerConfig
from workers.cpus import keep_off
from workers.engine.cache_events import CacheEvent
from workers.engine.shared_prefix import SharedPrefixes
from workers.engine.config import blocks_for_tokens
from workers.engine.plan import TokenEvent
from workers.engine.stats import EngineStats
from workers.engine_process import Abort, Command, Snapshot, Stall, Stop, start_engine_process
from workers.messages import AddRefused, AddRequest, KVEventBatch, KVSnapshot, StepBatch, WorkerInfo, WorkerLoadError

log = logging.getLogger("kvserve.worker")


# KV events left pending with nobody reading, past which they are dropped and the next
# batch skips a number: the router sees a gap and resyncs from a snapshot.
_MAX_PENDING_KV_EVENTS = 1 << 16
OUTLET_IDLE_S = 120.0  # an outlet unread this long is dropped (its router is gone)


class _Outlet:
    """What one router's stream has yet to hand out. Guarded by WorkerActor._pending_lock,
    but for wakeup and epoch, which only the actor's event loop touches."""

    def __init__(self, now: float) -> None:
        self.batches: list[StepBatch] = []
        self.kv_events: list[CacheEvent] = []
        self.kv_events_lost = False  # pending KV events were dropped: the next batch skips a number
        self.kv_seq = 0  # the last KVEventBatch handed out
        self.wakeup: asyncio.Event | None = None
        self.epoch = 0
        self.reading = False
        self.unread_since = now

    def take_kv_events(self) -> KVEventBatch | None:
        """The pending KV events as the next numbered batch, or None if there are none."""
        if not self.kv_events and not self.kv_events_lost:
            return None
        self.kv_seq += 2 if self.kv_events_lost else 1  # a skipped number: the router resyncs
        batch = KVEventBatch(self.kv_seq, tuple(self.kv_events))
        self.kv_events = []
        self.kv_events_lost = False
        return batch


class WorkerActor:
    """Wrap with ray.remote(...) (see workers.pool.spawn_worker); methods are async."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        if config.reserved_cpus:
            keep_off(config.reserved_cpus, f"worker {config.worker_id}")  # the engine process widens its own
        # A new interpreter, not a fork: a fork would copy Ray's threads and connections into the child.
        self._engine, self._commands, self._results = start_engine_process(config)
        # Why the model did not load, raised by info() (the first call a router makes): an
        # __init__ that raised would reach the router as the actor's death, its one line of
        # why at the end of two tracebacks, and Ray would start it again to fail the same way.
        self._load_error: str | None = None
        try:
            loaded: WorkerInfo | tuple[str, str] = self._results.recv()  # the model has loaded, or why not
        except EOFError:
            self._join_engine(10)
            loaded = ("failed", f"its engine process exited ({self._engine.returncode}) while loading the model; "
                                "the worker's log has why")
        if isinstance(loaded, tuple):
            self._load_error = f"worker {config.worker_id} could not load the model: {loaded[1]}"
            self._join_engine(10)
            return
        self.info_value = dataclasses.replace(loaded, node_id=_node_id(), events_token=secrets.token_hex(16))
        self._pending_lock = threading.Lock()  # guards the outlets, the commit ledger and the snapshot calls
        self._outlets: dict[str, _Outlet] = {}
        self._owners: dict[str, str] = {}  # request id -> the router its events go to
        # The commit ledger (module docstring): the last report's committed blocks, and the
        # need of each request taken since that no report counts yet.
        self._reported_committed = 0
        self._unreported: dict[str, int] = {}
        self._unreported_blocks = 0
        self._prompts = SharedPrefixes()  # the unfinished requests' prompt blocks, with prefix caching
        self._snapshots: dict[int, tuple[str, concurrent.futures.Future[KVSnapshot]]] = {}
        self._snapshot_tokens = itertools.count()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events_server: asyncio.Server | None = None
        self._events_starting = asyncio.Lock()
        self._last_report: EngineStats | None = None  # the engine's last, for heartbeats
        self._relay = threading.Thread(target=self._relay_results, name=f"relay-{config.worker_id}", daemon=True)
        self._relay.start()
        gc.collect()
        gc.freeze()  # Ray's modules live as long as the process: collections walk what serving makes

    # -- calls from the router ------------------------------------------------------

    async def info(self) -> WorkerInfo:
        """What the worker loaded, and where a router reads its events (the first call
        starts serving them, on this actor's loop)."""
        if self._load_error is not None:
            raise WorkerLoadError(self._load_error)
        async with self._events_starting:  # two first calls at once start one server
            if self._events_server is None:
                host = _node_ip()
                self._events_server = await asyncio.start_server(self._serve_events, host=host, port=0)
                port = self._events_server.sockets[0].getsockname()[1]
                self.info_value = dataclasses.replace(self.info_value, events_address=f"{host}:{port}")
        return self.info_value

    async def _serve_events(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One router's events(router_id) over its connection (workers/events_wire.py)."""
        adds: asyncio.Task[None] | None = None
        try:
            router_id = await asyncio.wait_for(events_wire.read_hello(reader, self.info_value.events_token), 30)
            events_wire.set_buffers(writer)
            adds = asyncio.create_task(self._take_adds(reader, writer))
            async with contextlib.aclosing(self.events(router_id)) as stream:
                async for batch in stream:
                    if adds.done():
                        break  # the router's end closed, or sent what it must not
                    writer.write(events_wire.encode(batch))
                    await writer.drain()  # a router that does not read: the steps merge meanwhile
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, events_wire.BadHello) as exc:
            log.info("worker %s: an events connection ended: %s", self.config.worker_id, exc or type(exc).__name__)
        finally:
            if adds is not None:
                adds.cancel()
            writer.close()

    async def _take_adds(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """AddRequests the router sends over its events connection, each answered there."""
        try:
            while True:
                request = await events_wire.read_frame(reader, "a router")
                if not isinstance(request, AddRequest):
                    log.warning("worker %s: a %s on an events connection; closing it", self.config.worker_id,
                                type(request).__name__)
                    return
                answer = await self.add_request(request)
                writer.write(events_wire.encode(events_wire.AddAnswer(request.request_id, answer)))
        except (OSError, asyncio.IncompleteReadError):
            return  # the router's end closed

    async def add_request(self, request: AddRequest) -> AddRefused | None:
        """Queue the request for the engine, or refuse it (a must_fit one that does not
        fit: nothing of it is kept)."""
        # The engine's own count (LLMEngine.blocks_needed): the last sampled token is never fed back.
        need = blocks_for_tokens(len(request.prompt_ids) + request.committed_tokens - 1, self.info_value.block_size)
        with self._pending_lock:
            if self.info_value.prefix_caching:
                self._prompts.remove(request.request_id)  # sent again: no share of itself
                need = self._prompts.charge(need, request.block_hashes)
            if request.must_fit:
                committed = self._reported_committed + self._unreported_blocks
                if committed + need > self.info_value.num_blocks:
                    return AddRefused(request.request_id, committed, self.info_value.num_blocks, need)
            self._unreported_blocks += need - self._unreported.get(request.request_id, 0)
            self._unreported[request.request_id] = need
            self._owners[request.request_id] = request.router_id
            if self.info_value.prefix_caching:
                self._prompts.add(request.request_id, request.block_hashes)
            # Its events wait in its router's outlet even if that router's stream has not
            # reached this worker yet.
            self._outlet(request.router_id)
        self._send(request)
        return None

    async def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    async def kv_snapshot(self, router_id: str = "") -> KVSnapshot:
        """Every block hash the engine's prefix cache holds, as of the KVEventBatch
        numbered seq of router_id's stream: apply that stream's batches numbered above
        seq to it, and ignore the rest, to follow the cache from here. Taken by the engine
        process between two steps."""
        reply: concurrent.futures.Future[KVSnapshot] = concurrent.futures.Future()
        with self._pending_lock:
            self._outlet(router_id)
            token = next(self._snapshot_tokens)
            self._snapshots[token] = (router_id, reply)
        self._send(Snapshot(token))
        return await asyncio.wrap_future(reply)

    async def pending_batches(self, router_id: str = "") -> int:
        """Step batches waiting in router_id's outlet: more than one means its reader lags
        (they leave merged); bounded, as the outlet merges them past 256."""
        with self._pending_lock:
            outlet = self._outlets.get(router_id)
            return 0 if outlet is None else len(outlet.batches)

    async def stop(self) -> None:
        """End the engine process: for an actor used in-process (tests); Ray kills its actors
        (and the engine process dies with it)."""
        if self._load_error is not None:
            return  # its engine process has ended already
        self._stopping = True
        if self._events_server is not None:
            self._events_server.close()
        self._send(Stop())
        await asyncio.to_thread(self._join_engine, 30)

    def _join_engine(self, timeout_s: float) -> None:
        """Wait up to timeout_s for the engine process to exit (and reap it)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._engine.wait(timeout=timeout_s)

    async def inject_stall(self, seconds: float) -> None:
        """Fault injection for chaos tests: the engine process sleeps, as if a step hung,
        while the actor keeps answering (its heartbeats go on, its steps do not)."""
        self._send(Stall(seconds))

    def _send(self, command: Command) -> None:
        self._commands.send(command)

    async def events(self, router_id: str = "") -> AsyncGenerator[StepBatch, None]:
        """router_id's output stream: one StepBatch per step (merged if the reader lags),
        and a heartbeat when nothing happened for heartbeat_interval_s.

        One reader per router id: a new call (that router restarted) ends the previous
        stream, and gets whatever is still pending."""
        self._loop = asyncio.get_running_loop()
        with self._pending_lock:
            outlet = self._outlet(router_id)
            outlet.epoch += 1
            epoch = outlet.epoch
            outlet.reading = True
            if outlet.wakeup is not None:
                outlet.wakeup.set()  # the superseded stream wakes up and ends
            wakeup = outlet.wakeup = asyncio.Event()
        wakeup.set()  # hand over anything already pending at once
        # A wake-up with nothing pending sends a heartbeat: one timer for the stream, not a
        # timeout per step.
        beat = asyncio.create_task(_beat(wakeup, self.config.heartbeat_interval_s))
        try:
            while True:
                await wakeup.wait()
                if epoch != outlet.epoch:
                    return
                wakeup.clear()
                with self._pending_lock:
                    batches, outlet.batches = outlet.batches, []
                    # KV events are pending only beside a batch: they leave together.
                    kv_events = outlet.take_kv_events() if batches else None
                if batches:
                    yield _merge(batches, kv_events)
                elif self._last_report is not None:
                    now = time.time()
                    yield StepBatch(self._last_report, heartbeat=True, sent_at=now, handed_at=now)
        finally:
            beat.cancel()
            with self._pending_lock:
                if epoch == outlet.epoch:
                    outlet.reading = False
                    outlet.unread_since = time.monotonic()

    def _outlet(self, router_id: str) -> _Outlet:
        """router_id's outlet, made if it has none. Called with _pending_lock held."""
        outlet = self._outlets.get(router_id)
        if outlet is None:
            outlet = self._outlets[router_id] = _Outlet(time.monotonic())
        return outlet

    # -- the relay thread: what the engine process sends -----------------------------

    def _relay_results(self) -> None:
        while True:
            try:
                message: tuple[Any, ...] = self._results.recv()
            except (EOFError, OSError):
                self._engine_gone()
                return
            if message[0] == "batch":
                self._publish(message[1], message[2])
            else:  # ("snapshot", token, hashes): sent after a batch, with nothing undrained
                _, token, hashes = message
                with self._pending_lock:
                    router_id, reply = self._snapshots.pop(token)
                    seq = self._outlet(router_id).kv_seq
                reply.set_result(KVSnapshot(seq, hashes))

    def _engine_gone(self) -> None:
        with self._pending_lock:
            replies, self._snapshots = list(self._snapshots.values()), {}
        for _, reply in replies:
            reply.cancel()
        if self._stopping:
            return
        # Its engine is gone (a crash, the OOM killer): so is this worker. Exiting makes Ray
        # end its streams, and the routers move its requests at once.
        log.error("worker %s: its engine process exited (%s); the worker exits", self.config.worker_id,
                  self._engine.poll())
        os._exit(1)

    def _publish(self, batch: StepBatch, kv_events: list[CacheEvent]) -> None:
        """Hand the step's batch to every outlet: the report and KV events to each, a token
        event to the outlet of the router that placed its request."""
        self._last_report = batch.report
        now = time.monotonic()
        wakeups: list[asyncio.Event] = []
        with self._pending_lock:
            # The report counts what the engine took in: it leaves the unreported need (and
            # so does a request the engine refused, which ends without being taken).
            self._reported_committed = batch.report.num_committed_blocks
            for request_id in batch.added_ids:
                self._unreported_blocks -= self._unreported.pop(request_id, 0)
            for event in batch.events:
                if event.finish_reason is not None:
                    self._unreported_blocks -= self._unreported.pop(event.request_id, 0)
            routed: dict[str, tuple[list[TokenEvent], list[str]]] = {rid: ([], []) for rid in self._outlets}
            # Added ids first: a request may be added and finish in one step, and its finish
            # forgets its owner.
            for request_id in batch.added_ids:
                owner = self._owners.get(request_id, "")
                if owner in routed:
                    routed[owner][1].append(request_id)
            for event in batch.events:
                owner = self._owners.get(event.request_id, "")
                if event.finish_reason is not None:
                    self._owners.pop(event.request_id, None)
                    self._prompts.remove(event.request_id)
                if owner in routed:
                    routed[owner][0].append(event)
            for router_id, outlet in list(self._outlets.items()):
                if not outlet.reading and now - outlet.unread_since > OUTLET_IDLE_S:
                    del self._outlets[router_id]  # its router is gone; what it was owed goes too
                    continue
                own_events, own_added = routed[router_id]
                outlet.batches.append(StepBatch(batch.report, tuple(own_events), tuple(own_added), sent_at=batch.sent_at,
                                                step_s=batch.step_s))
                if len(outlet.batches) > 256:  # nobody is reading: keep memory bounded
                    outlet.batches = [_merge(outlet.batches)]
                outlet.kv_events.extend(kv_events)
                if len(outlet.kv_events) > _MAX_PENDING_KV_EVENTS:
                    outlet.kv_events.clear()
                    outlet.kv_events_lost = True
                if outlet.wakeup is not None:
                    wakeups.append(outlet.wakeup)
        loop = self._loop
        if loop is not None:
            for wakeup in wakeups:
                loop.call_soon_threadsafe(wakeup.set)


async def _beat(wakeup: asyncio.Event, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        wakeup.set()


def _merge(batches: list[StepBatch], kv_events: KVEventBatch | None = None) -> StepBatch:
    """One batch saying what all of them say, with the report of the last, stamped with
    the time it is handed out."""
    if len(batches) == 1:
        events, added = batches[0].events, batches[0].added_ids
    else:
        events = tuple(e for b in batches for e in b.events)
        added = tuple(i for b in batches for i in b.added_ids)
    return StepBatch(batches[-1].report, events, added, kv_events=kv_events, sent_at=batches[-1].sent_at,
                     handed_at=time.time(), step_s=batches[-1].step_s)


def _node_ip() -> str:
    """The address routers reach this node at: Ray's for it, or loopback outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001 - outside a Ray worker
        pass
    return "127.0.0.1"


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - the node id is informational
        pass
    return socket.gethostname()

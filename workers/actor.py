"""The worker: a Ray actor wrapping one engine, one per GPU (or a few CPU threads here).

The engine steps in a thread of its own, so the actor's event loop stays free to take
add/abort/stats calls while a step runs (torch releases the GIL in its kernels). Output
leaves through one long-lived streaming call, `events()`: each item is a StepBatch with
the new tokens of every request in the step and a KV report, never one object per token.
While idle, the worker still reports every `report_interval_s`.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from workers.engine.errors import InvalidRequestError
from workers.engine.plan import TokenEvent
from workers.engine.request import FinishReason
from workers.messages import AddRequest, KVReport, StepBatch, WorkerInfo
from workers.config import WorkerConfig
from workers.model.build import create_engine, kv_pool_size, load
from workers.model.tokenizer import TokenizerSpec


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stall:
    seconds: float


class _Stop:
    pass


_Command = AddRequest | _Abort | _Stall | _Stop


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
        )
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._pending: list[StepBatch] = []
        self._pending_lock = threading.Lock()
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stream_epoch = 0
        self._seq = 0
        self._last_report: KVReport | None = None
        self._thread = threading.Thread(target=self._run, name=f"engine-{config.worker_id}", daemon=True)
        self._thread.start()

    # -- calls from the router ------------------------------------------------------

    async def info(self) -> WorkerInfo:
        return self.info_value

    async def add_request(self, request: AddRequest) -> None:
        self._commands.put(request)

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def report(self) -> KVReport:
        return self._report()

    async def stop(self) -> None:
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
                if batches:
                    yield _merge(batches)
                elif self._last_report is not None:
                    yield StepBatch(self._last_report, heartbeat=True)
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
            timeout = None if self.engine.has_unfinished else interval
            try:
                command: _Command | None = self._commands.get(timeout=timeout) if timeout else None
            except queue.Empty:
                command = None
            while True:
                if command is not None:
                    if isinstance(command, _Stop):
                        return
                    if isinstance(command, _Stall):
                        time.sleep(command.seconds)
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
            if events or added or free != last_free or now - last_report >= interval:
                self._publish(StepBatch(self._report(), tuple(events), tuple(added)))
                last_report, last_free = now, free
                # Hand the GIL to the event-loop thread now, so the batch leaves before the
                # next step's Python work, not a whole switch interval later.
                time.sleep(0)

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

    def _report(self) -> KVReport:
        self._seq += 1
        return KVReport.from_stats(self.config.worker_id, self._seq, time.time(), self.engine.stats())

    def _publish(self, batch: StepBatch) -> None:
        self._last_report = batch.report
        with self._pending_lock:
            self._pending.append(batch)
            if len(self._pending) > 256:  # nobody is reading: keep memory bounded
                self._pending = [_merge(self._pending)]
        loop, wakeup = self._loop, self._wakeup
        if loop is not None and wakeup is not None:
            loop.call_soon_threadsafe(wakeup.set)


async def _beat(wakeup: asyncio.Event, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        wakeup.set()


def _merge(batches: list[StepBatch]) -> StepBatch:
    if len(batches) == 1:
        return batches[0]
    events = tuple(e for b in batches for e in b.events)
    added = tuple(i for b in batches for i in b.added_ids)
    return StepBatch(batches[-1].report, events, added)


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - the node id is informational
        pass
    return socket.gethostname()

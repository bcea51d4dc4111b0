"""The KVServe gRPC service: proto in, proto out, every error through router.errors."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from router.core import AlreadyExisting, Router
from router.errors import Cancelled, InvalidArgument, NotFound, Unavailable, status_of
from router.records import sampling_params
from router.state import LogEntry, RequestRecord, RequestStatus
from router.tracker import RequestTracker
from router.validation import ValidRequest, sampling_to_proto, validate_generate, validate_request_id
from workers.engine.plan import TokenEvent
from workers.engine.request import FinishReason

log = logging.getLogger("kvserve.router")

_FINISH = {
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "eos": pb.FINISH_REASON_EOS,
    "cancelled": pb.FINISH_REASON_CANCELLED,
    "error": pb.FINISH_REASON_ERROR,
}
_STATUS = {
    RequestStatus.QUEUED: pb.REQUEST_STATUS_QUEUED,
    RequestStatus.RUNNING: pb.REQUEST_STATUS_RUNNING,
    RequestStatus.FINISHED: pb.REQUEST_STATUS_FINISHED,
    RequestStatus.CANCELLED: pb.REQUEST_STATUS_CANCELLED,
    RequestStatus.FAILED: pb.REQUEST_STATUS_FAILED,
}
_POLL_S = 0.05  # following a request that another router runs: how often to read Redis


class KVServeService(pb_grpc.KVServeServicer):
    def __init__(self, router: Router) -> None:
        self.router = router
        self._background: set[asyncio.Task[Any]] = set()

    # -- Generate / Submit ------------------------------------------------------------

    async def _validate(self, request: pb.GenerateRequest) -> ValidRequest:
        limits, tokenizer, chat = self.router.limits, self.router.tokenizer, self.router.chat_template
        if limits is None or tokenizer is None:
            raise Unavailable("no worker has registered yet")
        if request.WhichOneof("prompt") == "messages":
            # Rendering a template over a long conversation is CPU work: off the event loop.
            return await asyncio.to_thread(validate_generate, request, limits, tokenizer, chat)
        return validate_generate(request, limits, tokenizer, chat)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        tracker: RequestTracker | None = None
        listener: asyncio.Queue[TokenEvent] | None = None
        try:
            valid = await self._validate(request)
            tracker = await self.router.create(valid, keep_running_without_client=False)
            listener = tracker.subscribe()  # before it can produce anything
            await self.router.admit(tracker, _deadline(context))
        except AlreadyExisting as exc:
            await context.abort(exc.code, f"{exc}; attach to it with Stream")
        except Cancelled:
            pass  # a Cancel call ended it in the queue: the stream says so (finished CANCELLED)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status in one place
            if context.done():
                return  # the deadline passed or the client left: gRPC has ended the call already
            code, message = status_of(exc)
            await context.abort(code, message)
        assert tracker is not None and listener is not None
        try:
            yield pb.GenerateResponse(
                started=pb.Started(
                    request_id=tracker.request_id, worker_id=tracker.worker_id, prompt_tokens=len(tracker.prompt_ids)
                )
            )
            async for message in _live(listener, tracker, next_offset=0, skip_text_only_at=None):
                yield message
        finally:
            tracker.unsubscribe(listener)
            # The client cancelled or went away: the request must not keep its KV. Checked here,
            # not only on CancelledError: a client that leaves while a message is being sent
            # cancels the sending task, and this generator is then closed (GeneratorExit).
            if not tracker.finished:
                self._spawn(self.router.cancel(tracker.request_id))

    async def Submit(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.SubmitResponse:  # noqa: N802
        try:
            valid = await self._validate(request)
            try:
                tracker = await self.router.create(valid, keep_running_without_client=True)
            except AlreadyExisting as exc:
                return pb.SubmitResponse(request_id=exc.record.request_id, created=False, status=_STATUS[exc.record.status])
            try:
                self.router.check_admissible(tracker)
            except Exception as exc:
                await self.router.abandon(tracker, exc)  # recorded as FAILED, never placed
                raise
            self._spawn(self.router.admit(tracker, deadline=None))
            return pb.SubmitResponse(request_id=tracker.request_id, created=True, status=pb.REQUEST_STATUS_QUEUED)
        except Exception as exc:  # noqa: BLE001
            code, message = status_of(exc)
            await context.abort(code, message)
            raise  # unreachable: abort raises

    # -- Stream: re-attach from an offset ---------------------------------------------

    async def Stream(self, request: pb.StreamRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        try:
            request_id = validate_request_id(request.request_id)
            if request.from_offset < 0:
                raise InvalidArgument("from_offset", f"must be >= 0, got {request.from_offset}")
            tracker = self.router.trackers.get(request_id)
            listener = tracker.subscribe() if tracker is not None else None
            record = await self.router.store.get(request_id)
            if record is None:
                raise NotFound(f"request_id: no request {request_id!r}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            code, message = status_of(exc)
            await context.abort(code, message)
            raise
        try:
            yield pb.GenerateResponse(
                started=pb.Started(request_id=request_id, worker_id=record.worker_id, prompt_tokens=len(record.prompt_ids))
            )
            cursor = _LogCursor(request.from_offset)
            for entry in cursor.fresh(await self.router.store.read_log(request_id, request.from_offset)):
                yield _delta_from_entry(entry)
            if tracker is not None and listener is not None:
                async for message in _live(listener, tracker, cursor.next_offset, cursor.text_only_at):
                    yield message
                return
            async for message in self._follow_redis(request_id, cursor):
                yield message
        finally:
            if tracker is not None and listener is not None:
                tracker.unsubscribe(listener)

    async def _follow_redis(self, request_id: str, cursor: _LogCursor) -> AsyncIterator[pb.GenerateResponse]:
        """A request this router does not run: read Redis until it ends."""
        while True:
            record = await self.router.store.get(request_id)
            for entry in cursor.fresh(await self.router.store.read_log(request_id, cursor.next_offset)):
                yield _delta_from_entry(entry)
            if record is None or record.is_finished:
                yield _finished_from_record(record, cursor.next_offset)
                return
            await asyncio.sleep(_POLL_S)

    # -- the rest ---------------------------------------------------------------------

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:  # noqa: N802
        try:
            request_id = validate_request_id(request.request_id)
            status = await self.router.cancel(request_id)
            return pb.CancelResponse(request_id=request_id, status=_STATUS[status])
        except Exception as exc:  # noqa: BLE001
            code, message = status_of(exc)
            await context.abort(code, message)
            raise

    async def GetRequest(self, request: pb.GetRequestRequest, context: grpc.aio.ServicerContext) -> pb.RequestInfo:  # noqa: N802
        try:
            request_id = validate_request_id(request.request_id)
            record = await self.router.store.get(request_id)
            if record is None:
                raise NotFound(f"request_id: no request {request_id!r}")
            entries = await self.router.store.read_log(request_id, 0)
            return _request_info(record, entries)
        except Exception as exc:  # noqa: BLE001
            code, message = status_of(exc)
            await context.abort(code, message)
            raise

    async def ClusterStatus(self, request: pb.ClusterStatusRequest, context: grpc.aio.ServicerContext) -> pb.ClusterStatusResponse:  # noqa: N802
        return cluster_status(self.router)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)


class _LogCursor:
    """How far a re-attached client has been sent: each token once, and the one possible
    text-only entry (text released at the end) once."""

    def __init__(self, from_offset: int) -> None:
        self.next_offset = from_offset
        self.text_only_at: set[int] = set()

    def fresh(self, entries: list[LogEntry]) -> list[LogEntry]:
        out = []
        for entry in entries:
            if entry.token_ids:
                if entry.offset + len(entry.token_ids) <= self.next_offset:
                    continue
                self.next_offset = entry.offset + len(entry.token_ids)
            elif entry.offset in self.text_only_at:
                continue
            else:
                self.text_only_at.add(entry.offset)
            out.append(entry)
        return out


async def _live(
    listener: asyncio.Queue[TokenEvent], tracker: RequestTracker, next_offset: int, skip_text_only_at: set[int] | None
) -> AsyncIterator[pb.GenerateResponse]:
    """Live events from `next_offset` on, each token exactly once, then the finish."""
    while True:
        event = await listener.get()
        ids = event.token_ids
        if ids and event.offset + len(ids) > next_offset:
            cut = max(0, next_offset - event.offset)
            yield pb.GenerateResponse(delta=_delta(event, cut))
            next_offset = event.offset + len(ids)
        elif not ids and event.text and not (skip_text_only_at and event.offset in skip_text_only_at):
            yield pb.GenerateResponse(delta=_delta(event, 0))
        if event.finish_reason is not None:
            yield pb.GenerateResponse(
                finished=pb.Finished(
                    finish_reason=_FINISH[event.finish_reason.value],
                    usage=pb.Usage(prompt_tokens=len(tracker.prompt_ids), completion_tokens=tracker.num_output_tokens,
                                   cached_prompt_tokens=tracker.num_cached_tokens),
                    error=event.error or "",
                )
            )
            return


def _delta(event: TokenEvent, cut: int) -> pb.TokenDelta:
    logprobs = [
        pb.TokenLogprob(
            token_id=s.token_id,
            logprob=s.logprob or 0.0,
            top=[pb.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in s.top_logprobs],
        )
        for s in event.logprobs[cut:]
    ]
    return pb.TokenDelta(
        token_ids=list(event.token_ids[cut:]), text=event.text, logprobs=logprobs, offset=event.offset + cut
    )


def _delta_from_entry(entry: LogEntry) -> pb.GenerateResponse:
    logprobs = [
        pb.TokenLogprob(
            token_id=int(lp["id"]),
            logprob=float(lp["lp"] or 0.0),
            top=[pb.TopLogprob(token_id=int(t[0]), logprob=float(t[1])) for t in lp.get("top", [])],
        )
        for lp in entry.logprobs
    ]
    return pb.GenerateResponse(
        delta=pb.TokenDelta(token_ids=list(entry.token_ids), text=entry.text, logprobs=logprobs, offset=entry.offset)
    )


def _finished_from_record(record: RequestRecord | None, num_output: int) -> pb.GenerateResponse:
    if record is None:
        return pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_ERROR, error="record expired"))
    return pb.GenerateResponse(
        finished=pb.Finished(
            finish_reason=_FINISH.get(record.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
            usage=pb.Usage(prompt_tokens=len(record.prompt_ids), completion_tokens=record.num_output_tokens or num_output,
                           cached_prompt_tokens=record.cached_prompt_tokens),
            error=record.error,
        )
    )


def _request_info(record: RequestRecord, entries: list[LogEntry]) -> pb.RequestInfo:
    output_ids = [t for e in entries for t in e.token_ids]
    info = pb.RequestInfo(
        request_id=record.request_id,
        status=_STATUS[record.status],
        worker_id=record.worker_id,
        prompt_token_ids=record.prompt_ids,
        output_token_ids=output_ids,
        output_text="".join(e.text for e in entries),
        finish_reason=_FINISH.get(record.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        timings=pb.Timings(
            created_at=record.created_at, first_token_at=record.first_token_at, finished_at=record.finished_at
        ),
        error=record.error,
        num_migrations=record.num_migrations,
        prompt_text=record.prompt_text,
        cached_prompt_tokens=record.cached_prompt_tokens,
    )
    try:
        info.sampling.CopyFrom(sampling_to_proto(sampling_params(record.sampling)))
    except Exception:  # noqa: BLE001 - an old or foreign record: leave sampling empty
        pass
    return info


def cluster_status(router: Router) -> pb.ClusterStatusResponse:
    now = time.monotonic()
    out = pb.ClusterStatusResponse(queued=router.queue_length, has_chat_template=router.chat_template is not None)
    for view in router.workers.values():
        r = view.report
        status = pb.WorkerStatus(
            worker_id=view.worker_id,
            alive=view.alive,
            block_size=view.info.block_size,
            total_blocks=view.info.num_blocks,
            total_kv_bytes=view.info.num_blocks * view.info.block_bytes,
            report_age_seconds=now - view.last_report_at,
            node_id=view.info.node_id,
        )
        if r is not None:
            status.free_blocks = r.num_free_blocks
            status.free_kv_bytes = r.free_kv_bytes
            status.running = r.num_running
            status.waiting = r.num_waiting
            status.uncommitted_blocks = view.headroom_blocks
            status.preemptions = r.num_preemptions
            status.evictable_blocks = r.num_evictable_blocks
            status.prefix_cache_hit_tokens = r.prefix_cache_hit_tokens
            status.prefix_cache_queried_tokens = r.prefix_cache_queried_tokens
            status.prefix_cache_hit_rate = r.prefix_cache_hit_rate or 0.0
        status.indexed_blocks = router.prefix_index.num_blocks(view.worker_id)
        out.workers.append(status)
        if view.alive:
            out.alive_workers += 1
            out.total_blocks += status.total_blocks
            out.total_kv_bytes += status.total_kv_bytes
            out.free_blocks += status.free_blocks
            out.free_kv_bytes += status.free_kv_bytes
            out.running += status.running
            out.waiting += status.waiting
    return out


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("background request task ended with: %s", task.exception())


__all__ = ["KVServeService", "cluster_status", "FinishReason"]

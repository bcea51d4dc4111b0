"""The KVServe gRPC service: proto in, proto out, every error through router.errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from router.core import AlreadyExisting, Router
from router.errors import Cancelled, InvalidArgument, NotFound, ResourceExhausted, Unavailable, status_of
from router.records import sampling_params
from router.state import FollowersExhausted, LogEnd, LogEntry, RequestRecord, RequestStatus
from router.tracker import DEFAULT_MAX_PENDING_TOKENS, Listener, PendingOutputOverflow, RequestMoved, RequestTracker
from router.validation import ValidRequest, sampling_to_proto, validate_generate, validate_request_id
from workers.engine.plan import TokenEvent
from workers.engine.request import FinishReason

if TYPE_CHECKING:
    from router.auth import Context

log = logging.getLogger("kvserve.router")
ROUTERS_WAIT_S = 1.0  # how long ClusterStatus waits for Redis to list the routers
END_RECORD_WAIT_S = 1.0  # how long a stream's `finished` waits for Redis to hold the end (_end_recorded)

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


class KVServeService(pb_grpc.KVServeServicer):
    """`max_pending_tokens` bounds each Generate/Stream client's output not yet sent (a
    client that does not read): past it the call ends RESOURCE_EXHAUSTED, the request
    goes on, and the client re-attaches with Stream from the offset it had."""

    def __init__(self, router: Router, max_pending_tokens: int = DEFAULT_MAX_PENDING_TOKENS,
                 stream_interval: int = 1) -> None:
        if max_pending_tokens < 1:
            raise ValueError(f"max_pending_tokens must be >= 1, got {max_pending_tokens}")
        self.router = router
        self.max_pending_tokens = max_pending_tokens
        self.stream_interval = stream_interval  # see Listener
        self._background: set[asyncio.Task[Any]] = set()

    # -- Generate / Submit ------------------------------------------------------------

    async def _validate(self, request: pb.GenerateRequest) -> ValidRequest:
        limits, tokenizer, chat = self.router.limits, self.router.tokenizer, self.router.chat_template
        if limits is None or tokenizer is None:
            raise Unavailable("no worker has registered yet")
        if request.WhichOneof("prompt") in ("text", "messages"):
            # Encoding a long text, or rendering a template over a long conversation, is CPU
            # work (a 4 MiB prompt: seconds): off the event loop, which serves every other call.
            return await asyncio.to_thread(validate_generate, request, limits, tokenizer, chat)
        return validate_generate(request, limits, tokenizer, chat)

    async def Generate(self, request: pb.GenerateRequest, context: Context) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        tracker: RequestTracker | None = None
        listener: Listener | None = None
        try:
            valid = await self._validate(request)
            # An id the router makes cannot be taken: its record is created while it is placed.
            tracker = await self.router.create(valid, wait=bool(request.request_id))
            listener = tracker.subscribe(self.max_pending_tokens, self.stream_interval)  # before it can produce anything
            await self.router.admit(tracker, _deadline(context))
            await self.router.recorded(tracker)  # before `started` names it: GetRequest finds it then
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
            async for response in _live(listener, tracker, next_offset=0):
                yield response
        except (ResourceExhausted, Unavailable) as exc:  # fell behind, or handed over: the request goes on
            await context.abort(exc.code, str(exc))
        finally:
            tracker.unsubscribe(listener)
            # The client cancelled or went away: the request must not keep its KV. Checked here,
            # not only on CancelledError: a client that leaves while a message is being sent
            # cancels the sending task, and this generator is then closed (GeneratorExit).
            # One that fell behind was told to re-attach: its request runs on.
            if not tracker.finished and not listener.overflowed and listener.ended_by is None:
                self._spawn(self.router.cancel(tracker.request_id))

    async def Submit(self, request: pb.GenerateRequest, context: Context) -> pb.SubmitResponse:  # noqa: N802
        try:
            valid = await self._validate(request)
            try:
                tracker = await self.router.create(valid)
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

    async def Stream(self, request: pb.StreamRequest, context: Context) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        tracker: RequestTracker | None = None
        listener: Listener | None = None
        try:
            request_id = validate_request_id(request.request_id)
            if request.from_offset < 0:
                raise InvalidArgument("from_offset", f"must be >= 0, got {request.from_offset}")
            tracker = self.router.trackers.get(request_id)
            # Subscribed before Redis is read. A finished tracker publishes nothing more (its
            # last events may not be in Redis yet): that request is followed in Redis, whose
            # log ends with the marker its finish writes.
            if tracker is not None and not tracker.finished:
                listener = tracker.subscribe(self.max_pending_tokens, self.stream_interval)
            record = await self.router.store.get(request_id)
            if record is None:
                raise NotFound(f"request_id: no request {request_id!r}")
        except asyncio.CancelledError:
            if tracker is not None and listener is not None:
                tracker.unsubscribe(listener)
            raise
        except Exception as exc:  # noqa: BLE001
            if tracker is not None and listener is not None:
                tracker.unsubscribe(listener)
            code, message = status_of(exc)
            await context.abort(code, message)
            raise
        try:
            yield pb.GenerateResponse(
                started=pb.Started(request_id=request_id, worker_id=record.worker_id, prompt_tokens=len(record.prompt_ids))
            )
            cursor = _LogCursor(request.from_offset)
            if tracker is None or listener is None:
                async for response in self._from_redis(request_id, record, cursor, until_offset=None):
                    yield response
                return
            # Events are published before Redis has them: Redis up to what was published
            # before the listener subscribed (waiting for it if needed), the listener after.
            # Tokens mark that point; an event of text alone comes only with a finish, and a
            # finished request took the Redis path above.
            if cursor.next_offset < listener.start_offset:
                async for response in self._from_redis(request_id, record, cursor, until_offset=listener.start_offset):
                    yield response
                    if response.WhichOneof("event") == "finished":
                        return
            async for response in _live(listener, tracker, cursor.next_offset):
                yield response
        except (ResourceExhausted, FollowersExhausted) as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except (asyncio.CancelledError, GeneratorExit, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. Redis went away mid-stream
            if context.done():
                return
            code, message = status_of(exc)
            await context.abort(code, message)
        finally:
            if tracker is not None and listener is not None:
                tracker.unsubscribe(listener)

    async def _from_redis(
        self, request_id: str, record: RequestRecord, cursor: _LogCursor, until_offset: int | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The log from the cursor on, followed live (XREAD BLOCK), up to `until_offset`
        tokens (None: to the end, then `finished`). Works on any router: it needs nothing
        of the request but Redis."""
        if until_offset is not None and cursor.next_offset >= until_offset:
            return
        async with contextlib.aclosing(self.router.store.follow(request_id, cursor.next_offset)) as log:
            async for item in log:
                if isinstance(item, LogEnd):
                    final = await self.router.store.get(request_id)  # Usage as it ended (cached tokens)
                    yield _finished_from_end(item, final or record, cursor.next_offset)
                    return
                for entry in cursor.fresh([item]):
                    yield _delta_from_entry(entry)
                if until_offset is not None and cursor.next_offset >= until_offset:
                    return

    # -- the rest ---------------------------------------------------------------------

    async def Cancel(self, request: pb.CancelRequest, context: Context) -> pb.CancelResponse:  # noqa: N802
        try:
            request_id = validate_request_id(request.request_id)
            status = await self.router.cancel(request_id)
            return pb.CancelResponse(request_id=request_id, status=_STATUS[status])
        except Exception as exc:  # noqa: BLE001
            code, message = status_of(exc)
            await context.abort(code, message)
            raise

    async def GetRequest(self, request: pb.GetRequestRequest, context: Context) -> pb.RequestInfo:  # noqa: N802
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

    async def ClusterStatus(self, request: pb.ClusterStatusRequest, context: Context) -> pb.ClusterStatusResponse:  # noqa: N802
        out = cluster_status(self.router)
        # The routers from their leases; answered without them while Redis is down, since
        # the workers' picture is the router's own.
        try:
            routers = await asyncio.wait_for(self.router.ownership.live_routers(), ROUTERS_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - Redis down or slow: say the list is unknown
            log.info("ClusterStatus without the routers: %s", exc)
            return out
        out.routers_known = True
        for router_id in sorted(routers):
            out.routers.append(pb.RouterStatus(router_id=router_id, address=routers[router_id],
                                               answering=router_id == self.router.router_id))
        return out

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


async def _live(listener: Listener, tracker: RequestTracker, next_offset: int) -> AsyncIterator[pb.GenerateResponse]:
    """Live events from `next_offset` on, each token exactly once, then the finish. Whatever
    piled up while the client was not reading comes as one delta; raises ResourceExhausted
    once more than the listener's max_pending_tokens piled up."""
    while True:
        try:
            event = await listener.get()
        except PendingOutputOverflow as exc:
            raise ResourceExhausted(
                f"{exc}; the request goes on: re-attach with Stream(request_id={tracker.request_id!r}, "
                f"from_offset={next_offset})"
            ) from exc
        except RequestMoved as exc:
            raise Unavailable(
                f"{exc}; it goes on: re-attach with Stream(request_id={tracker.request_id!r}, from_offset={next_offset})"
            ) from exc
        ids = event.token_ids
        if ids and event.offset + len(ids) > next_offset:
            cut = max(0, next_offset - event.offset)
            yield pb.GenerateResponse(delta=_delta(event, cut))
            next_offset = event.offset + len(ids)
        elif not ids and event.text:
            yield pb.GenerateResponse(delta=_delta(event, 0))
        if event.finish_reason is not None:
            await _end_recorded(tracker)
            yield pb.GenerateResponse(
                finished=pb.Finished(
                    finish_reason=_FINISH[event.finish_reason.value],
                    usage=pb.Usage(prompt_tokens=len(tracker.prompt_ids), completion_tokens=tracker.num_output_tokens,
                                   cached_prompt_tokens=tracker.num_cached_tokens),
                    error=event.error or "",
                )
            )
            return


async def _end_recorded(tracker: RequestTracker) -> None:
    """Wait until Redis holds the request's end, for at most END_RECORD_WAIT_S: a client
    that calls GetRequest (on any router) once it has `finished` reads the end, not RUNNING
    and part of the output (a Node.js client saw that in up to 1 in 5 calls under load; the
    write lands in milliseconds, after the stream's own last message). With Redis slow or
    down, `finished` goes at the bound, and Redis records the end when it can."""
    written = tracker.end_recorded
    if written is None or written.done():
        return
    try:
        await asyncio.wait_for(asyncio.shield(written), END_RECORD_WAIT_S)
    except Exception:  # noqa: BLE001 - timed out, or the write failed: the client is told now
        pass


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


def _finished_from_end(end: LogEnd, record: RequestRecord, num_output: int) -> pb.GenerateResponse:
    """`finished` from a log's end marker; Usage from the request's record."""
    return pb.GenerateResponse(
        finished=pb.Finished(
            finish_reason=_FINISH.get(end.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
            usage=pb.Usage(prompt_tokens=len(record.prompt_ids),
                           completion_tokens=end.num_output_tokens or record.num_output_tokens or num_output,
                           cached_prompt_tokens=record.cached_prompt_tokens),
            error=end.error,
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
            if view.alive:  # a dead one runs nothing (its requests moved) and is promised nothing
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


def _deadline(context: Context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _log_failure(task: asyncio.Task[Any]) -> None:
    # A Submit-ed request's admit() that a Cancel call ended is no news.
    if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), Cancelled):
        log.info("background request task ended with: %s", task.exception())


__all__ = ["KVServeService", "cluster_status", "FinishReason"]

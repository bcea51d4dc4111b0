"""The router: where each request runs, its in-flight reservation, and its way there.

It composes one part per concept:

- router/registry.py: the workers, the reader of each one's event stream, liveness;
- this file: a request's creation, admission (the FIFO queue of requests no worker can
  hold now, placed in order as reports show room), placement, its send to a worker,
  cancel, drain;
- router/token_flow.py: a step's token events to the listeners and to Redis;
- router/moves.py: requests that lose their worker, and adoption after a restart.

No request is lost with its worker: a dead worker's requests move (moves.py). A request
id is known to a worker's engine as engine_key(request_id, num_migrations), so the events
of an earlier placement can never be taken for the current one's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.admission import DEADLINE_PASSED, AdmissionQueue
from router.chat import ChatTemplate
from router.errors import AlreadyExists, Cancelled, DeadlineExceeded, NotFound, Unavailable
from router.group_commit import GroupCommit
from router.moves import Mover, quietly
from router.ownership import Ownership, UnguardedBesideGuarded
from router.placement import (
    CacheHits, PlacementPolicy, PrefixWeights, ReserveRatio, WorkerView, make_policy, reservation,
)
from router.prefix_index import PrefixIndex
from router.recorder import Barrier, OrderedRecorder, StepOp
from router.registry import WorkerRegistry
from router.state import RequestRecord, RequestStatus, RequestStore, StepWrite, StoreRefused, StoreUnavailable
from router.token_flow import FINISH_STATUS, TokenFlow
from router.tracker import RequestTracker, engine_key
from router.validation import ClusterLimits, ValidRequest
from workers.engine.plan import TokenEvent
from workers.engine.request import FinishReason, Resume
from workers.engine.sampling import SamplingParams
from workers.messages import AddRefused, AddRequest, StepBatch, WorkerInfo
from workers.model.tokenizer import Tokenizer

log = logging.getLogger("kvserve.router")

# Seeds the router picks are below 2^53, so a client that reads them as IEEE doubles
# (JavaScript's Number, JSON parsers) holds them exactly and can reproduce a run.
ROUTER_SEED_BOUND = 2**53
# How long Cancel waits to learn what became of a request it aborted on a worker: the
# worker may finish it (LENGTH, EOS) before the abort lands, and Cancel answers that.
CANCEL_ANSWER_WAIT_S = 5.0
# A call cancelled this close to its deadline, before its request was placed, ended by the
# deadline: gRPC's timer and the admission queue's fire in the same instant, either first.
DEADLINE_SLACK_S = 0.05
# Records created in one script call at most (each carries its prompt's ids as JSON).
MAX_CREATES_PER_CALL = 128


QUEUE_ORDERS = ("fifo", "backfill")  # RouterConfig.queue_order


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "prefix"  # router/placement.py; README "How a request is placed"
    max_queue: int = 1024  # requests waiting for room or a sequence slot, beyond which RESOURCE_EXHAUSTED
    max_queue_wait_s: float = 30.0
    # "fifo": the queue's head goes first, and nothing passes it. "backfill": while the head
    # fits nowhere, requests behind it may go to any worker but the one the head waits for
    # (router/admission.py), so a short request does not wait behind a long one.
    queue_order: str = "fifo"
    # A worker silent this long is dead (workers say "alive" every 0.25 s, even mid-step).
    worker_timeout_s: float = 2.0
    # A worker whose engine makes no step this long while it has requests is dead.
    progress_timeout_s: float = 10.0
    max_migrations: int = 3  # moves to another worker per request, beyond which it FAILS
    # Send a worker no more requests than its engine runs at once (max_num_seqs): the rest
    # wait in the router's queue, from which they go to whichever worker frees first.
    count_seq_slots: bool = True
    max_outstanding_per_worker: int = 512
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    prefix_weights: PrefixWeights = field(default_factory=PrefixWeights)  # the `prefix` policy's
    # How long a placement predicts its prompt's blocks on the chosen worker, before the
    # worker's own events say so (a burst with a new shared prefix lands together).
    prefix_prediction_ttl_s: float = 2.0
    # A router's lease in Redis (router/ownership.py): a router silent this long is taken
    # for dead by its peers, which adopt its requests.
    lease_ttl_s: float = 10.0
    # What a kv-aware placement commits of a request's output: its prompt's blocks and
    # ceil(ratio x max_tokens) tokens' (README "How a request is placed"). 1: all of
    # max_tokens, and a worker never runs short; below, more requests run at once, and a
    # worker whose requests outgrow their reservations preempts (as vLLM does).
    kv_reserve_ratio: float = 0.5
    # With a floor, the ratio adapts (placement.ReserveRatio): kv_reserve_ratio right after
    # a worker preempts, then down over kv_reserve_decay_s seconds without one to what the
    # requests that ended say (kv_reserve_ratio x the 90th percentile of output / max_tokens),
    # never below kv_reserve_floor. None: fixed at kv_reserve_ratio.
    kv_reserve_floor: float | None = None
    kv_reserve_decay_s: float = 20.0

    def __post_init__(self) -> None:
        make_policy(self.policy, 1)  # validates the name
        if not self.prefix_prediction_ttl_s > 0:
            raise ValueError(f"RouterConfig.prefix_prediction_ttl_s must be positive, got {self.prefix_prediction_ttl_s}")
        if self.max_queue < 0:
            raise ValueError(f"RouterConfig.max_queue must be >= 0, got {self.max_queue}")
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"RouterConfig.{name} must be >= 1 or None (no limit), got {value}")
        if self.max_migrations < 0:
            raise ValueError(f"RouterConfig.max_migrations must be >= 0, got {self.max_migrations}")
        for name in ("max_queue_wait_s", "worker_timeout_s", "progress_timeout_s", "lease_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RouterConfig.{name} must be positive, got {getattr(self, name)}")
        if self.queue_order not in QUEUE_ORDERS:
            raise ValueError(f"RouterConfig.queue_order must be one of {', '.join(QUEUE_ORDERS)}, got {self.queue_order!r}")
        if not 0 < self.kv_reserve_ratio <= 1:  # also refuses NaN
            raise ValueError(f"RouterConfig.kv_reserve_ratio must be in (0, 1], got {self.kv_reserve_ratio}")
        if self.kv_reserve_floor is not None and not 0 < self.kv_reserve_floor <= self.kv_reserve_ratio:
            raise ValueError(f"RouterConfig.kv_reserve_floor must be in (0, kv_reserve_ratio = "
                             f"{self.kv_reserve_ratio:g}], got {self.kv_reserve_floor}")
        if not self.kv_reserve_decay_s > 0:
            raise ValueError(f"RouterConfig.kv_reserve_decay_s must be positive, got {self.kv_reserve_decay_s}")
        if self.max_outstanding_per_worker < 1:
            raise ValueError(
                f"RouterConfig.max_outstanding_per_worker must be >= 1, got {self.max_outstanding_per_worker}"
            )


class _WorkerLost(Exception):
    """The worker a request was being sent to died before it took the request."""


class _Refused(Exception):
    """The worker refused the request: it could not commit the request's blocks."""

    def __init__(self, answer: AddRefused) -> None:
        super().__init__(f"refused by its worker: {answer}")
        self.answer = answer


def new_router_id() -> str:
    """A router's id: unique per process, readable in logs and Redis."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Router:
    """Owns the live requests of this process and their reservations on the workers."""

    def __init__(self, config: RouterConfig, store: RequestStore, router_id: str | None = None) -> None:
        self.config = config
        self.store = store
        # This router among the routers sharing the workers and Redis: its workers' streams
        # carry the token events of what it placed, and Redis records it as their owner.
        self.router_id = router_id or new_router_id()
        store.set_owner(self.router_id)
        self.ownership = Ownership(store, self.router_id, config.lease_ttl_s)
        # Whether it requires a bearer token (check_guards); a problem found after the start.
        self.guarded = False
        self._open_peers_said: set[str] = set()
        self.unguarded = asyncio.Event()
        self.unguarded_problem = ""
        self.policy: PlacementPolicy = make_policy(
            config.policy, config.max_outstanding_per_worker, config.prefix_weights
        )
        # The share of max_tokens a kv-aware placement commits; it adapts with a floor.
        self.reserve = ReserveRatio(config.kv_reserve_ratio, config.kv_reserve_floor, config.kv_reserve_decay_s)
        # Which worker's prefix cache holds which block: from the workers' KV events.
        self.prefix_index = PrefixIndex(config.prefix_prediction_ttl_s)
        self.registry = WorkerRegistry(
            config.worker_timeout_s, config.progress_timeout_s, self.prefix_index, config.count_seq_slots,
            on_join=self._on_join, on_batch=self._on_batch, on_dead=self._on_dead, router_id=self.router_id,
        )
        self.trackers: dict[str, RequestTracker] = {}
        self.queue = AdmissionQueue(config.max_queue, config.max_queue_wait_s, self._try_place, self.notify,
                                    self._backfill if config.queue_order == "backfill" else None)
        self._hold: tuple[RequestTracker, WorkerView] | None = None  # _held_for's: the head, and its worker
        self.recorder = OrderedRecorder()
        # New requests' records: those that come while a create is in flight go to Redis
        # together in the next call, not one round trip each.
        self.creates: GroupCommit[RequestRecord, RequestRecord | None] = GroupCommit(
            store.create_many, MAX_CREATES_PER_CALL
        )
        self.tokens = TokenFlow(store, self.recorder, self.trackers, self.notify, self._on_lost_events, self._on_fenced)
        self.moves = Mover(self)
        self.tokenizer: Tokenizer | None = None
        self.chat_template: ChatTemplate | None = None  # the tokenizer's, compiled; None: it has none
        self.limits: ClusterLimits | None = None
        self.draining = False
        self._drain_cut = False  # end_drain()
        self._background: set[asyncio.Task[Any]] = set()  # moves, and aborts of requests dropped on their way
        # Metrics hooks, called as observer(event name, payload) on this loop: "report" (view,
        # batch), "tokens" [(tracker, event), ...] once per batch, for its events with tokens, "placed" (tracker, view),
        # "finished" tracker, "queued" queue length, "backfilled" how many passed the queue's
        # head, "rejected" (tracker, reason), "worker_dead" view, "migrated" (tracker, from
        # worker id).
        self.observers: list[Callable[[str, Any], None]] = []

    # -- workers (router/registry.py) ---------------------------------------------------

    @property
    def workers(self) -> dict[str, WorkerView]:
        return self.registry.views

    @property
    def alive_workers(self) -> list[WorkerView]:
        return self.registry.alive

    async def add_worker(self, handle: Any) -> WorkerInfo:
        """Register a worker actor: read its info, then follow its event stream."""
        return await self.registry.add(handle)

    def _on_join(self, info: WorkerInfo) -> None:
        if self.tokenizer is None:
            self.tokenizer = info.tokenizer.build()
            self.chat_template = _compile_chat_template(self.tokenizer)
        infos = [w.info for w in self.registry.views.values()]
        self.limits = ClusterLimits(
            vocab_size=min(i.vocab_size for i in infos),
            max_model_len=min(i.max_model_len for i in infos),
            block_size=infos[0].block_size,
            max_worker_blocks=max(i.num_blocks for i in infos),
            max_prompt_tokens=self.config.max_prompt_tokens,
            max_tokens_limit=self.config.max_tokens_limit,
        )
        self.queue.drain()

    async def _on_batch(self, view: WorkerView, batch: StepBatch) -> None:
        if view.new_preemptions > 0:
            self.reserve.preempted(time.monotonic())
        self.notify("report", (view, batch))
        if batch.events:
            # Not awaited: Redis is written off the stream's path (router/recorder.py).
            self.tokens.apply(view, batch.events)
        self.queue.drain()

    def _learn_reserve(self, tracker: RequestTracker) -> None:
        """An adaptive ratio learns from every request that ran and ended without an error
        (placement.ReserveRatio.ended)."""
        if tracker.num_placements > 0 and tracker.finish_reason is not FinishReason.ERROR:
            self.reserve.ended(tracker.num_output_tokens, tracker.params.max_tokens)

    async def _on_dead(self, view: WorkerView, why: str) -> None:
        await self.moves.move_all_off(view, why)

    def _on_lost_events(self, view: WorkerView | None, tracker: RequestTracker, what: str) -> None:
        """A placement's events were lost on their way here (router/token_flow.py): stop it
        and move the request, which resumes from what it has."""
        key = tracker.engine_key
        log.error("request %s: events of its placement %s were lost (%s); it moves", tracker.request_id, key, what)
        if view is not None:
            view.release(key)
            handle = self.registry.handle(view.worker_id)
            if handle is not None:
                self.spawn(quietly(handle.abort.remote(key)))
        self.spawn(self.moves.move(tracker, f"events of its placement were lost ({what})"))

    def _on_fenced(self, request_ids: list[str]) -> None:
        """Redis refused this router's writes to these requests: a peer claimed them (this
        router's lease lapsed while it was stalled). Let them go: stop their placements
        here, and send their clients to re-attach, to whichever router."""
        for request_id in request_ids:
            tracker = self.trackers.get(request_id)
            if tracker is None:
                continue
            log.warning("request %s is owned by another router now; this router lets it go", request_id)
            self._let_go(tracker, "another router took it over")

    def _let_go(self, tracker: RequestTracker, why: str) -> None:
        """Another router serves the request from now on: forget it here, stop its placement
        (its KV on the worker is freed), and send its clients, waiting or streaming, to
        re-attach."""
        self.trackers.pop(tracker.request_id, None)
        view = self.workers.get(tracker.worker_id)
        if view is not None:
            view.release(tracker.engine_key)
            handle = self.registry.handle(view.worker_id)
            if handle is not None:
                self.spawn(quietly(handle.abort.remote(tracker.engine_key)))
        tracker.hand_over(why)
        self.queue.remove(tracker)  # after hand_over: its wait says where to re-attach

    async def check_store_at_start(self, guarded: bool = False) -> None:
        """Raise OlderRouters (router/ownership.py) while routers of an earlier version hold
        leases in this Redis, StoreRefused when Redis refuses this router's credentials or
        the rights it needs, and UnguardedBesideGuarded when this router (guarded: it
        requires a bearer token) has no token and a live peer does (a `kvserve router` joined
        without the token flags served the cluster to anyone: a security check's note); at a
        start, before any worker is loaded or joined."""
        self.guarded = guarded
        try:
            await self.store.check_rights()
            await self.ownership.refuse_beside_older_routers()
            problem = await self.check_guards()
            if problem is not None:
                raise UnguardedBesideGuarded(problem)
        except StoreRefused:
            raise  # credentials or rights: no waiting fixes them, so the start fails (a Redis down is waited for)
        except StoreUnavailable as exc:
            log.warning("Redis is unavailable (%s): routers of an earlier version were not looked for (the "
                        "routers' guards are compared at each lease renewal, once it is back)", exc)

    async def check_guards(self) -> str | None:
        """What is wrong with this router's guard beside its peers' (StoreUnavailable if
        Redis is down): a router without a token beside one that requires a token must not
        serve (the message says why); a guarded one beside open ones logs a warning, once a
        set of them. Said in Redis again first, so that it never lapses (a review)."""
        await self.ownership.record_guard(self.guarded)
        guarded, open_ = await self.ownership.peers_by_guard()
        if not self.guarded and guarded:
            return (f"the cluster's router(s) {', '.join(f'{rid} at {addr}' for rid, addr in sorted(guarded.items()))} "
                    f"require a bearer token, and this one has none: it would serve their workers to anyone. "
                    f"Give it --auth-token-file (or $KVSERVE_AUTH_TOKEN), as they have")
        if self.guarded and open_ and set(open_) != self._open_peers_said:
            self._open_peers_said = set(open_)
            log.warning("router(s) %s serve this cluster without a bearer token, beside this one, which requires "
                        "one: anyone who reaches them can use its workers; give them the token",
                        ", ".join(f"{rid} at {addr}" for rid, addr in sorted(open_.items())))
        return None

    def found_unguarded(self, problem: str) -> None:
        """This router, without a token, found a peer that requires one after its start:
        the cluster stops it (Cluster.wait_for_failure)."""
        self.unguarded_problem = problem
        self.unguarded.set()

    async def start_ownership(self, address: str) -> None:
        """Take this router's lease (its address is what peers and tools see), then keep it
        and adopt what dead peers leave, in the background (each renewal also says and
        compares its guard: check_guards). After add_worker."""
        self.ownership.address = address
        try:
            await self.ownership.clear_draining()
            await self.ownership.renew()
        except StoreUnavailable as exc:
            log.warning("router lease: Redis is unavailable (%s); taken once it is back", exc)
        self.spawn(self.moves.hold_lease_and_watch_peers())
        self.spawn(self._follow_cancel_requests())

    async def _follow_cancel_requests(self) -> None:
        """Cancel what clients asked other routers to cancel (router/ownership.py); for the
        router's life."""
        async for request_id in self.ownership.cancel_requests():
            if request_id is None:  # (re)subscribed: asks made before it were missed
                try:
                    marked = await self.ownership.cancel_marked(
                        [rid for rid, tracker in self.trackers.items() if not tracker.finished])
                except StoreUnavailable as exc:
                    log.info("cancel requests: could not check the marks (%s)", exc)
                    continue
            else:
                marked = [request_id]
            for rid in marked:
                tracker = self.trackers.get(rid)
                if tracker is not None and not tracker.finished:
                    self.spawn(quietly(self.cancel(rid)))
                elif tracker is None:
                    self.moves.cancel_asked(rid)  # being taken over: ended once it is tracked

    # -- requests -----------------------------------------------------------------------

    async def create(self, request: ValidRequest, wait: bool = True) -> RequestTracker:
        """Record a new request in Redis (QUEUED) and track it here; admit() places it.

        A sampled request without a seed gets one here (below ROUTER_SEED_BOUND), so that a
        move to another worker continues the same random stream. Raises AlreadyExisting,
        carrying the existing record, if the id is taken.

        wait=False, for an id this router made (one no request can have taken): returns at
        once, and the request is placed while Redis creates its record, which is a round
        trip off its time to first token; recorded() says when the record is there. The
        record lands before any other write of the request (a Barrier in the recorder).
        Not while a create is in flight (under load): the Barrier would hold every write
        behind it for that call and the next, the create's pipeline and the recorder's in
        turn instead of side by side (at the router's ceiling, 10-20% fewer tokens/s); and
        under load a create's round trip is shared by the requests of its group anyway."""
        if self.draining:
            raise Unavailable("the router is draining and takes no new requests")
        if not self.alive_workers:
            raise Unavailable("no live worker")
        params = request.params
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=secrets.randbelow(ROUTER_SEED_BOUND))
            request = dataclasses.replace(request, params=params)
        record = RequestRecord(
            request_id=request.request_id,
            status=RequestStatus.QUEUED,
            prompt_ids=list(request.prompt_ids),
            sampling=_sampling_json(request.params),
            seed=request.params.seed,
            created_at=time.time(),
            prompt_text=request.prompt_text,
            router_id=self.router_id,
            cache_salt=request.cache_salt or "",
        )
        if not self.ownership.held:
            # Redis was away past the lease: take it again before naming this router the
            # owner, or a peer could take the request for a dead router's.
            await self.ownership.renew()
        tracker = RequestTracker(
            request.request_id,
            request.prompt_ids,
            request.params,
            request.need_blocks,
            block_hashes=request.block_hashes,
            cache_salt=request.cache_salt,
            created_at=record.created_at,
        )
        wait = wait or self.creates.busy
        creating = asyncio.ensure_future(self.creates.submit(record))
        if not wait:
            creating.add_done_callback(_retrieve)  # recorded() raises it, if its caller is still there
            self.recorder.submit([Barrier(creating)])
            tracker.creating = creating
            self.trackers[tracker.request_id] = tracker
            return tracker
        try:
            existing = await asyncio.shield(creating)
        except asyncio.CancelledError:
            # The caller left while Redis was creating the record: end it if it was made, or it
            # would stay QUEUED, in the active set and without expiry, for ever; and count it,
            # as every request that ends is counted.
            try:
                if await creating is None:
                    await self.store.finish(record.request_id, RequestStatus.CANCELLED, FinishReason.CANCELLED.value, "")
                    tracker.finish_reason = FinishReason.CANCELLED
                    self.notify("finished", tracker)
            except Exception as exc:  # noqa: BLE001 - best effort; the caller is gone
                log.debug("could not end an abandoned request: %s", exc)
            raise
        if existing is not None:
            raise AlreadyExisting(existing)
        self.trackers[tracker.request_id] = tracker
        return tracker

    async def recorded(self, tracker: RequestTracker) -> None:
        """Wait for the record of a request created with wait=False, which may be placed
        and running by now. If Redis could not create it, the request is cancelled (its
        worker frees its KV) and the error raised: a request that Redis does not hold
        cannot be re-attached to, moved or adopted. A caller that leaves here cancels it."""
        creating = tracker.creating
        if creating is None:
            return
        try:
            existing = await asyncio.shield(creating)
        except asyncio.CancelledError:
            self.spawn(quietly(self.cancel(tracker.request_id)))
            raise
        except Exception:
            await quietly(self.cancel(tracker.request_id))
            raise
        if existing is not None:  # not for an id of this router's making: a bug, told as one
            await quietly(self.cancel(tracker.request_id))
            raise RuntimeError(f"request id {tracker.request_id} was taken in Redis already")

    async def adopt(self, include_own: bool = False) -> int:
        """Take over the requests a dead router left running (router/moves.py); include_own
        at start: also those this router's id owns (its previous run's)."""
        return await self.moves.adopt(include_own)

    def adopt_when_redis_returns(self) -> None:
        """adopt() in the background, retrying with backoff while Redis is unavailable."""
        self.spawn(self.moves.adopt_when_redis_returns())

    def check_admissible(self, tracker: RequestTracker) -> None:
        """Raise ResourceExhausted now if admit() could only fail on a full queue."""
        if len(self.queue):
            self.queue.refuse_if_full(tracker)

    async def admit(self, tracker: RequestTracker, deadline: float | None) -> None:
        """Place the request on a worker, waiting in the FIFO queue for room if needed.

        On failure (queue full, waited too long, deadline, cancellation) the request is
        recorded as ended and forgotten here, and the error propagates."""
        try:
            await self.place_and_send(tracker, deadline)
        except asyncio.CancelledError:
            if (deadline is None or tracker.cancel_requested or tracker.num_placements
                    or deadline - time.monotonic() > DEADLINE_SLACK_S):
                await self.abandon(tracker, asyncio.CancelledError())
                raise
            # gRPC ended the call at its deadline, in the instant the queue's own wait for it
            # was due: the same outcome as when the queue's timer comes first. (Not once it
            # was placed: it did not wait for room then.)
            self.notify("rejected", (tracker, "deadline"))
            await self.abandon(tracker, DeadlineExceeded(DEADLINE_PASSED))
            raise
        except BaseException as exc:
            if tracker.handed_over and tracker.creating is not None:
                # Let go to another router while it waited: its client is told to re-attach
                # there, which finds nothing if Redis never made its record. Then the create's
                # error is the answer (raised here), not the re-attach.
                await self.recorded(tracker)
            await self.abandon(tracker, exc)
            raise

    async def abandon(self, tracker: RequestTracker, exc: BaseException) -> None:
        """End a request that was never placed: record why, and forget it here (unless
        another router serves it now)."""
        if tracker.handed_over:
            return
        self.trackers.pop(tracker.request_id, None)
        cancelled = isinstance(exc, (asyncio.CancelledError, Cancelled))
        status = RequestStatus.CANCELLED if cancelled else RequestStatus.FAILED
        reason = FinishReason.CANCELLED if cancelled else FinishReason.ERROR
        error = tracker.cancel_reason if cancelled else str(exc)
        tracker.publish(TokenEvent(tracker.request_id, (), "", 0, finish_reason=reason, error=error))
        self.notify("finished", tracker)  # every request that ends counts once, placed or not
        # Through the recorder: with Redis down it is written once Redis is back, or the
        # record would stay QUEUED, active and without expiry.
        finish = StepOp(self.store, [self.store.finish_write(tracker.request_id, status, reason.value, error or "")])
        await quietly(self.recorder.record([finish]))

    async def end(self, tracker: RequestTracker, reason: FinishReason, error: str | None) -> None:
        """Finish a request here, not on a worker (it has none now)."""
        if tracker.finished:
            return
        event = TokenEvent(tracker.engine_key, (), "", tracker.num_output_tokens, finish_reason=reason, error=error)
        await self.tokens.apply(None, [event])

    # -- placement and the send to a worker -----------------------------------------------

    async def place_and_send(self, tracker: RequestTracker, deadline: float | None, resumed: bool = False) -> None:
        """Place and send; a worker that dies while the request is on its way there is
        left for another. A resumed request (moved off a dead worker) goes before the queue."""
        while True:
            view = await self._place(tracker, deadline, resumed)
            try:
                await self._dispatch(tracker, view)
                return
            except _WorkerLost as exc:
                log.warning("request %s: %s; placing it elsewhere", tracker.request_id, exc)
            except _Refused as exc:
                # Another router's requests took the room this router saw: the worker's own
                # count stands until its next report.
                view.refused(exc.answer.num_committed_blocks)
                self.notify("refused", (tracker, view))
                log.debug("request %s: worker %s refused it (%d of %d blocks committed, needs %d); placing it again",
                          tracker.request_id, view.worker_id, exc.answer.num_committed_blocks,
                          exc.answer.num_total_blocks, exc.answer.need_blocks)

    async def _place(self, tracker: RequestTracker, deadline: float | None, resumed: bool) -> WorkerView:
        head = self.queue.head
        if resumed or head is None:
            view = self._try_place(tracker)
            if view is not None:
                return view
        elif self.config.queue_order == "backfill":
            view = self._try_place(tracker, self._held_for(head))  # as the queue backfills
            if view is not None:
                self.queue.backfilled(1)
                return view
        if not resumed:
            self.queue.refuse_if_full(tracker)
        return await self.queue.wait(tracker, deadline, first=resumed)

    def _try_place(self, tracker: RequestTracker, passing: WorkerView | None = None) -> WorkerView | None:
        """Choose a worker with room and reserve the request's blocks there, or None.
        passing: a worker held for the queue's head, which this request may not take."""
        workers: Sequence[WorkerView] = self.alive_workers
        if passing is not None:
            workers = [w for w in workers if w is not passing]
        need, tracker.reserve_tokens = self._commitment(tracker)
        return self._choose(workers, tracker, need)

    def _backfill(self, head: RequestTracker, behind: Sequence[RequestTracker]) -> list[WorkerView | None]:
        """The queue's backfill: each request behind the head, in order, placed on any worker
        but the one held for the head (or None). One list of workers serves the whole scan,
        and under a policy blind to the cache a request at least as large as one no worker
        took (its commitment and its longest) is not tried: a placement only shrinks what
        the others can take, so it would be refused too. Before both, a drain with 40
        waiting behind a head cost 1.6 ms at 1,000 workers (a list and a scalar pass per try);
        now ~146 us (README, "How a request is placed")."""
        held = self._held_for(head)
        workers = [w for w in self.alive_workers if w is not held]
        refused: list[tuple[int, int]] = []
        out: list[WorkerView | None] = []
        for tracker in behind:
            need, tracker.reserve_tokens = self._commitment(tracker)
            if any(need >= n and tracker.need_blocks >= longest for n, longest in refused):
                out.append(None)
                continue
            view = self._choose(workers, tracker, need)
            if view is None and not self.policy.reads_hits:
                refused.append((need, tracker.need_blocks))
            out.append(view)
        return out

    def _choose(self, workers: Sequence[WorkerView], tracker: RequestTracker, need: int) -> WorkerView | None:
        """The policy's choice among workers for a request committing need blocks, reserved there."""
        hits = None
        if tracker.block_hashes:
            hits = CacheHits(len(tracker.block_hashes), self.prefix_index.hits(tracker.block_hashes),
                             tracker.block_hashes)
        view = self.policy.choose(workers, need, hits, tracker.need_blocks)
        if view is not None:
            # The need less what this router's unfinished requests there hold of the prompt
            # (WorkerView.charge); a hit on a cached block nobody holds is committed again.
            view.place(tracker.engine_key, need, tracker.block_hashes)
            if tracker.block_hashes and view.info.prefix_caching:
                # Not where nothing is cached: the predictions read as hits, and a burst with
                # one prompt prefix piled on one worker of a --no-prefix-caching cluster.
                self.prefix_index.predict(view.worker_id, tracker.block_hashes)
        return view

    def _held_for(self, tracker: RequestTracker) -> WorkerView | None:
        """The worker a request that fits nowhere now waits for (queue_order "backfill"):
        when it became the head, of the workers that could ever run it, the one with the
        most headroom, i.e. the closest to having room for it. Kept until it is placed (or
        that worker dies): a hold that moved to whichever worker led at the moment would
        hand the room the head had waited for to the requests behind it."""
        held = self._hold
        if held is not None and held[0] is tracker and held[1].alive:
            return held[1]
        best: WorkerView | None = None
        for w in self.alive_workers:
            if w.num_blocks >= tracker.need_blocks and (best is None or w.headroom_blocks > best.headroom_blocks):
                best = w
        self._hold = None if best is None else (tracker, best)
        return best

    def _commitment(self, tracker: RequestTracker) -> tuple[int, int | None]:
        """The blocks placing the request commits, and the output tokens they count (None:
        max_tokens): router.placement.reservation at this router's ratio now (self.reserve).
        The policy is told the request's longest too, and places it only where that fits."""
        if self.limits is None:
            return tracker.need_blocks, None
        return reservation(len(tracker.prompt_ids), tracker.params.max_tokens, tracker.num_output_tokens,
                           tracker.need_blocks, self.reserve.at(time.monotonic()), self.limits.block_size)

    async def _dispatch(self, tracker: RequestTracker, view: WorkerView) -> None:
        """Send the request to its worker (the reservation is already on the view).

        tracker.worker_id is set only once the worker holds the request, so cancel() never
        sends an abort that could reach the worker first and be lost. A cancel() that came
        while the request was on its way finished it here; it is taken back from the worker.
        Raises _WorkerLost if the worker dies before it takes the request."""
        tracker.num_placements += 1
        placed_at = time.time()
        self.notify("placed", (tracker, view))
        handle = self.registry.handle(view.worker_id)
        key = tracker.engine_key
        resume = Resume(tuple(tracker.output_ids), tracker.num_text_chars) if tracker.output_ids else None
        add = AddRequest(key, tracker.prompt_ids, tracker.params, resume, router_id=self.router_id,
                         must_fit=self.policy.kv_aware, block_hashes=tracker.block_hashes,
                         reserve_tokens=tracker.reserve_tokens, cache_salt=tracker.cache_salt)
        sending = self.registry.send_add(view.worker_id, add)
        # The worker gets the request first; recording RUNNING overlaps with it (the store
        # drops the write if the request has already ended; while Redis cannot take it, it
        # waits in the recorder's backlog, so a request moving during an outage still moves).
        running = StepOp(self.store, [StepWrite(tracker.request_id, None, {"status": RequestStatus.RUNNING.value,
                                                                          "worker_id": view.worker_id})])
        recording = self.recorder.submit([running])
        try:
            try:
                answer = await asyncio.shield(sending)  # a cancelled caller leaves it to _abort_once_added
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the actor died under it
                raise _WorkerLost(f"worker {view.worker_id} died before it took the request: {exc}") from exc
            if isinstance(answer, AddRefused):
                # The RUNNING write may land: the next placement's overwrites it, in order.
                view.release(key)
                raise _Refused(answer)
            await recording
        except _Refused:
            raise
        except BaseException:
            view.release(key)
            # The worker may take it all the same: abort it once it has (sent now, the abort
            # could overtake the add on the async actor and be lost).
            self.spawn(_abort_once_added(handle, sending, key))
            raise
        if tracker.handed_over:
            # Let go to another router while it was on its way here (_let_go could not stop a
            # placement whose worker it did not know yet): stop it now; the adopter places it.
            view.release(key)
            if handle is not None:
                await quietly(handle.abort.remote(key))
            return
        tracker.worker_id = view.worker_id
        if not tracker.accepted_at:
            tracker.accepted_at = placed_at
            self.notify("accepted", tracker)
            # Once a request, in the recorder's next batch: what an adopter reads (moves.py).
            self.recorder.submit([StepOp(self.store, [StepWrite(tracker.request_id, None,
                                                                {"accepted_at": repr(placed_at)})])])
        if tracker.finished or tracker.cancel_requested:
            view.release(key)
            # Its worker may hold it: take it back. Not one that ended there, which is gone
            # (at saturation many end before their RUNNING write is recorded).
            if handle is not None and not tracker.ended_on_worker:
                await quietly(handle.abort.remote(key))
            await self.end(tracker, FinishReason.CANCELLED, None)
        elif not view.alive:
            # It died after taking the request, and the registry did not see it here yet.
            await self.moves.move(tracker, f"worker {view.worker_id} died as the request reached it")

    # -- cancel, drain, close -------------------------------------------------------------

    async def cancel(self, request_id: str, reason: str | None = None) -> RequestStatus:
        """Abort a request wherever it is (its KV is freed on its worker), and answer its
        status after the call: CANCELLED, or what it finished with if its worker finished it
        before the abort landed (RUNNING if that is not known within CANCEL_ANSWER_WAIT_S).
        reason: why the router cancels it (no client asked), told in its finish's error."""
        tracker = self.trackers.get(request_id)
        if tracker is None:
            record = await self.store.get(request_id)
            if record is None:
                raise NotFound(f"request_id: no request {request_id!r}")
            return await self._cancel_elsewhere(record)
        if not tracker.finished:
            if reason is not None and not tracker.cancel_requested:  # not a client's cancel, already on its way
                tracker.cancel_reason = reason
            tracker.cancel_requested = True
            if self.queue.remove(tracker):  # admit() (or the resume) then records it as cancelled
                return RequestStatus.CANCELLED
            view = self.workers.get(tracker.worker_id)
            if view is not None and view.alive:
                handle = self.registry.handle(tracker.worker_id)
                if handle is not None:
                    await quietly(handle.abort.remote(tracker.engine_key))
            elif not tracker.worker_id:
                # On its way to a worker, or never placed: _dispatch takes it back; it ends here.
                await self.end(tracker, FinishReason.CANCELLED, None)
            # else its worker just died: the move sees cancel_requested and ends it.
            try:
                await asyncio.wait_for(tracker.done.wait(), CANCEL_ANSWER_WAIT_S)
            except asyncio.TimeoutError:
                return RequestStatus.RUNNING if tracker.worker_id else RequestStatus.QUEUED
        assert tracker.finish_reason is not None
        return FINISH_STATUS[tracker.finish_reason]

    async def _cancel_elsewhere(self, record: RequestRecord) -> RequestStatus:
        """Cancel a request another router owns: mark it and tell its owner, which cancels it
        wherever it is (its admission queue included); one running on a worker is also
        aborted there at once, its end event going to the owner. Answers the status it then
        has. An owner that has not ended it within CANCEL_ANSWER_WAIT_S and has not renewed
        its lease meanwhile (dead, its lease not lapsed yet) has it claimed from it, and it
        is ended here: the answer is then CANCELLED, as Redis records (it answered RUNNING,
        and whoever adopted the request at the lease's lapse ended it CANCELLED seconds
        later). A live owner is never claimed from: its end may be told to its clients
        already, with its write to Redis still on its way."""
        if record.is_finished:
            return record.status
        asked = await self.ownership.ask_to_cancel(record.request_id)
        if asked is None:
            return RequestStatus.CANCELLED  # it expired meanwhile
        if asked[0].is_finished:
            return asked[0]
        if record.status is RequestStatus.RUNNING:
            handle = self.registry.handle(record.worker_id)
            if handle is not None:
                await quietly(handle.abort.remote(engine_key(record.request_id, record.num_migrations)))
        status, owner = asked
        asked_at = time.monotonic()
        lease_then = await self.ownership.lease_end(owner) if owner else None
        # Long enough for the owner's end to land, and for a live owner to renew its lease
        # at least once (every ttl_s / 4).
        deadline = asked_at + max(CANCEL_ANSWER_WAIT_S, self.ownership.ttl_s / 4 + 1.0)
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            now = await self.store.get(record.request_id)
            if now is None:
                return RequestStatus.CANCELLED
            status = now.status
            if now.is_finished:
                return status
        # Not ended. An owner that renewed its lease meanwhile is alive, only slow (its end,
        # already told to its clients, may be on its way): the answer is the status now. One
        # that did not (dead, its lease not lapsed yet) has it taken from it and ended here.
        if owner != self.router_id and self.limits is not None:
            lease_now = await self.ownership.lease_end(owner) if owner else None
            if lease_now is None or lease_now == lease_then:
                await self.moves.end_cancelled(record.request_id, owner)
                now = await self.store.get(record.request_id)
                status = RequestStatus.CANCELLED if now is None else now.status
        return status

    async def drain(self, grace_s: float, hand_over: bool = False) -> None:
        """Stop taking requests; let running ones finish for up to grace_s; then cancel the
        rest or, with hand_over (a router whose workers live on after it), leave them to a
        peer that is not draining too, if there is one: they move there as from a router
        that died, and their clients re-attach there."""
        self.draining = True
        try:
            await self.ownership.mark_draining(grace_s + self.ownership.ttl_s + CANCEL_ANSWER_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - Redis away or refusing writes (OOM): the drain goes on
            log.info("drain: peers were not told (%s)", exc)
        end = time.monotonic() + grace_s
        while self.trackers and not self._drain_cut and time.monotonic() < end:
            await asyncio.sleep(0.05)
        if hand_over and self.trackers:
            try:
                peers = await self.ownership.serving_peers()
            except Exception as exc:  # noqa: BLE001 - then what still runs is cancelled, as before
                peers = []
                log.info("drain: could not look for a router to hand requests to (%s)", exc)
            if peers:
                await self._hand_over_all(peers)
                return
        why = ("the router stopped: a second stop signal cut its drain short" if self._drain_cut else
               f"the router stopped: it ran past the drain grace ({grace_s:g} s)")
        cancels = [asyncio.ensure_future(quietly(self.cancel(request_id, why))) for request_id in list(self.trackers)]
        if cancels:
            await asyncio.wait(cancels, timeout=CANCEL_ANSWER_WAIT_S + 1)

    async def _hand_over_all(self, peers: list[str]) -> None:
        """Leave every unfinished request to the peers: stop it where it runs, send its
        clients to re-attach, and let the writes already made land. Redis keeps it active
        and owned by this router, whose lease close() drops: a peer adopts it then."""
        why = f"router {self.router_id} stopped; {', '.join(peers)} takes it over"
        handed = [tracker for tracker in self.trackers.values() if not tracker.finished]
        log.info("drain: %d requests left to %s", len(handed), ", ".join(peers))
        for tracker in handed:
            self._let_go(tracker, why)
        # Its log as far as its clients read it: an adopter resumes from the log.
        try:
            await asyncio.wait_for(self.recorder.flush(), CANCEL_ANSWER_WAIT_S)
        except asyncio.TimeoutError:
            log.info("drain: the last writes of the requests left to peers did not land in %g s", CANCEL_ANSWER_WAIT_S)

    def end_drain(self) -> None:
        """Cut a drain short, or the one to come (a second Ctrl-C): what still runs is cancelled now."""
        self._drain_cut = True

    async def close(self, timeout_s: float = 5.0) -> None:
        """Cancel the router's tasks and wait for them, at most timeout_s: a task that does
        not end by then is logged with where it is stuck and left behind, so a stop is
        bounded."""
        self.recorder.close()
        tasks = [*self.registry.tasks(), *self._background]
        # What this router leaves active, a peer (or its successor) adopts now, not a TTL later.
        try:
            await asyncio.wait_for(self.ownership.release(), timeout=min(timeout_s, 2.0))
        except Exception as exc:  # noqa: BLE001 - the lease lapses by itself
            log.info("router close: the lease was not dropped (%s); it lapses in %.0f s", exc, self.ownership.ttl_s)
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                frames = task.get_stack(limit=3)
                where = "; ".join(f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in frames)
                log.warning("router close: task %s still running %.0f s after its cancel, left behind (at %s)",
                            task.get_name(), timeout_s, where or "?")
        self.registry.forget_tasks()

    @property
    def queue_length(self) -> int:
        return len(self.queue)

    # -- hooks ----------------------------------------------------------------------------

    def notify(self, name: str, payload: Any) -> None:
        if name == "finished":
            self._learn_reserve(payload)  # the router's own, before the observers
        for observer in self.observers:
            try:
                observer(name, payload)
            except Exception:  # noqa: BLE001 - an observer (metrics, probes) never stops the flow
                log.exception("router observer %r failed on %r", observer, name)

    def spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen: it is raised where someone still waits for it."""
    if not future.cancelled():
        future.exception()


class AlreadyExisting(AlreadyExists):
    """The id is taken: carries the existing record so Submit can return it."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        super().__init__(f"request_id: {record.request_id!r} already exists (status {record.status.value})")


def _sampling_json(p: SamplingParams) -> dict[str, Any]:
    return {
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "seed": p.seed,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "logprobs": p.logprobs,
    }


async def _abort_once_added(handle: Any, sending: Any, request_id: str) -> None:
    try:
        await sending
    except Exception:  # noqa: BLE001 - it never reached the worker
        return
    await quietly(handle.abort.remote(request_id))


def _compile_chat_template(tokenizer: Tokenizer) -> ChatTemplate | None:
    """The model's chat template; one that does not compile is logged and treated as none,
    so chat requests are refused (INVALID_ARGUMENT) while text and ids still serve."""
    try:
        return ChatTemplate.of(tokenizer)
    except ValueError as exc:
        log.error("the model's chat template is unusable, chat requests will be refused: %s", exc)
        return None

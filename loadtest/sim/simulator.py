"""The discrete-event loop: arrivals, the router, N workers, and the messages between them.

Virtual time only ever jumps to the next event in a heap. The messages are the real
ones (AddRequest to a worker, StepBatch back), each arriving a fixed latency after it
is sent. Token timestamps are taken when a StepBatch reaches the router, the moment
the router can stream them to a client, so TTFT includes the queue, the dispatch, the
engine's own waiting queue, the prefill and the way back.

The router's per-event work costs no virtual time here: the simulator models a router
that keeps up. Whether one does is measured separately (loadtest.sim.placement_bench).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.metrics import RequestTimeline
from loadtest.sim.cost_model import CostModel
from loadtest.sim.proposals import SIM_POLICIES
from loadtest.sim.routing import Placement, SimRouter, Waiting
from loadtest.sim.worker import SimWorker, StepStarted
from loadtest.trace import TraceRequest
from router.core import RouterConfig
from router.placement import reservation
from workers.engine.config import SchedulerConfig, blocks_for_tokens
from workers.engine.sampling import SamplingParams
from workers.messages import AddRequest, StepBatch

# Event kinds, in the heap as (time, sequence number, kind, a, b); the sequence number
# makes simultaneous events run in the order they were scheduled.
_ARRIVE, _DELIVER, _STEP_END, _BATCH, _EXPIRE, _SAMPLE, _ABORT = range(7)


@dataclass(frozen=True)
class ClusterConfig:
    """A simulated cluster: one KV pool size per worker, the router, and the wires between.

    policy: one of router.placement.POLICIES; it
        replaces router.policy, of which the rest (queue limits) is used as is.
    report_latency_s: from a worker's step end to its StepBatch reaching the router.
    dispatch_latency_s: from a placement to the AddRequest reaching the worker.
    kv_sample_interval_s: how often every worker's KV use is recorded.
    max_tokens_factor: each request asks for ceil(factor x its output_len) tokens and ends
        at output_len, as an answer that stops well before max_tokens (bench-policies
        --max-tokens-factor, whose client ends the stream there): the router commits and
        learns its reserve ratio against max_tokens, and the worker has the request
        aborted once output_len tokens have reached the router (dispatch_latency_s later).
    """

    worker_blocks: tuple[int, ...]
    policy: str = "kv"
    router: RouterConfig = field(default_factory=RouterConfig)
    report_interval_s: float = 0.1
    report_latency_s: float = 0.001
    dispatch_latency_s: float = 0.001
    kv_sample_interval_s: float = 0.1
    seed: int = 0
    max_tokens_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.policy not in SIM_POLICIES:
            raise ValueError(f"ClusterConfig.policy must be one of {', '.join(SIM_POLICIES)}, got {self.policy!r}")
        if not self.worker_blocks:
            raise ValueError("ClusterConfig.worker_blocks must name at least one worker")
        bad = [b for b in self.worker_blocks if isinstance(b, bool) or not isinstance(b, int) or b < 1]
        if bad:
            raise ValueError(f"ClusterConfig.worker_blocks must be positive integers, got {bad[0]!r}")
        if not self.report_interval_s > 0:
            raise ValueError(f"ClusterConfig.report_interval_s must be positive, got {self.report_interval_s}")
        if not self.kv_sample_interval_s > 0:
            raise ValueError(f"ClusterConfig.kv_sample_interval_s must be positive, got {self.kv_sample_interval_s}")
        for name in ("report_latency_s", "dispatch_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ClusterConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.max_tokens_factor < math.inf:
            raise ValueError(f"ClusterConfig.max_tokens_factor must be >= 1, got {self.max_tokens_factor}")


@dataclass
class SimResult:
    """What one simulated run produced. timelines holds every request that was placed."""

    policy: str
    worker_blocks: list[int]
    timelines: dict[str, RequestTimeline]
    num_requests: int
    num_rejected_queue_full: int
    num_rejected_wait: int
    num_rejected_too_large: int
    num_failed: int  # refused by an engine (cannot happen after router validation)
    preemptions_per_worker: list[int]
    peak_committed_blocks: list[int]  # per worker, the most blocks its admitted requests ever committed
    kv_sample_times: list[float]
    kv_used_blocks: list[list[int]]  # [sample][worker] blocks holding KV
    kv_committed_blocks: list[list[int]]  # [sample][worker] blocks committed at max_tokens
    num_steps: int
    num_events: int
    num_batches: int  # StepBatches the router received
    num_batches_while_queued: int  # of those, arrived with requests waiting in its queue
    max_queue_length: int
    end_time: float
    wall_s: float
    # The engines' prefix caches, summed over workers (cumulative tokens, as in EngineStats).
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_predicted_hit_blocks: int = 0  # the router's index, over its placements (cache-aware policies)
    num_backfilled: int = 0  # placed ahead of a queue head that fit nowhere (queue_order "backfill")

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt (and resumed) tokens served from a cache over those looked up; 0 when none were."""
        if self.prefix_cache_queried_tokens == 0:
            return 0.0
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens

    @property
    def num_rejected(self) -> int:
        return self.num_rejected_queue_full + self.num_rejected_wait + self.num_rejected_too_large

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions_per_worker)


def simulate(trace: Sequence[TraceRequest], config: ClusterConfig, cost: CostModel) -> SimResult:
    """Run the trace through the cluster until every request has finished or been rejected."""
    return _Simulation(trace, config, cost).run()


class _Simulation:
    def __init__(self, trace: Sequence[TraceRequest], config: ClusterConfig, cost: CostModel) -> None:
        facts = cost.facts
        self.config = config
        self.scheduler = SchedulerConfig(
            max_model_len=facts.max_model_len,
            block_size=facts.block_size,
            max_num_seqs=facts.max_num_seqs,
            max_num_batched_tokens=facts.max_num_batched_tokens,
        )
        self.workers = [
            SimWorker(f"sim-{i}", blocks, cost, self.scheduler, config.report_interval_s, seed=config.seed + i)
            for i, blocks in enumerate(config.worker_blocks)
        ]
        self.router = SimRouter(config.router, [w.info for w in self.workers], config.policy)
        self.trace = sorted(trace, key=lambda r: r.arrival_time)
        self.requests = {r.request_id: r for r in self.trace}
        if len(self.requests) != len(self.trace):
            raise ValueError("trace request ids must be unique")
        self.timelines: dict[str, RequestTimeline] = {}
        self._params: dict[int, SamplingParams] = {}
        self._max_tokens = {r.request_id: math.ceil(config.max_tokens_factor * r.output_len) for r in self.trace}
        self._worker_of: dict[str, int] = {}  # where each request was last sent
        self._generated: dict[str, int] = {}  # tokens each request's worker made (past output_len too)
        self._aborting: set[str] = set()  # ended by their client at output_len; the abort is on its way
        self._heap: list[tuple[float, int, int, object, object]] = []
        self._sequence = itertools.count()
        self._next_arrival = 0
        self._num_open = 0  # arrived, neither finished nor rejected
        self._num_failed = 0
        self._num_events = 0
        self._kv_times: list[float] = []
        self._kv_used: list[list[int]] = []
        self._kv_committed: list[list[int]] = []

    def _push(self, at: float, kind: int, a: object = None, b: object = None) -> None:
        heapq.heappush(self._heap, (at, next(self._sequence), kind, a, b))

    def run(self) -> SimResult:
        started = time.perf_counter()
        if self.trace:
            self._push(self.trace[0].arrival_time, _ARRIVE)
            self._push(self.trace[0].arrival_time, _SAMPLE)
        now = 0.0
        heap = self._heap
        total = len(self.trace)
        # Stop once every request has ended: what is left are deadlines of requests that
        # were placed after all, and KV samples.
        while heap and (self._num_open or self._next_arrival < total):
            now, _, kind, a, b = heapq.heappop(heap)
            self._num_events += 1
            if kind == _STEP_END:
                self._on_step_end(now, a, b)  # type: ignore[arg-type]
            elif kind == _BATCH:
                self._on_batch(now, a, b)  # type: ignore[arg-type]
            elif kind == _DELIVER:
                self._on_deliver(now, a, b)  # type: ignore[arg-type]
            elif kind == _ARRIVE:
                self._on_arrive(now)
            elif kind == _EXPIRE:
                if self.router.expire(a):  # type: ignore[arg-type]
                    self._close(a)  # type: ignore[arg-type]
            elif kind == _SAMPLE:
                self._sample(now)
            elif kind == _ABORT:
                self._on_abort(now, a, b)  # type: ignore[arg-type]
        return self._result(now, time.perf_counter() - started)

    # -- handlers -----------------------------------------------------------------------

    def _on_arrive(self, now: float) -> None:
        request = self.trace[self._next_arrival]
        self._next_arrival += 1
        if self._next_arrival < len(self.trace):
            self._push(self.trace[self._next_arrival].arrival_time, _ARRIVE)
        self._num_open += 1
        self.timelines[request.request_id] = RequestTimeline(request.arrival_time)
        max_tokens = self._max_tokens[request.request_id]
        longest = blocks_for_tokens(len(request.prompt_ids) + max_tokens - 1, self.scheduler.block_size)
        # What the router commits (RouterConfig.kv_reserve_ratio, adapting with a floor), on
        # a worker whose pool holds its longest; a request that waits commits at the ratio of
        # the moment it is placed (SimRouter.need_at), and _dispatch tells its worker that.
        need = self._commitment(request, now)[0]
        outcome = self.router.arrive(now, request.request_id, need, request.prompt_ids, longest, max_tokens)
        if isinstance(outcome, Placement):
            self._dispatch(now, outcome)
        elif isinstance(outcome, Waiting):
            self._push(outcome.deadline, _EXPIRE, request.request_id)
        else:
            self._close(request.request_id)

    def _commitment(self, request: TraceRequest, now: float) -> tuple[int, int | None]:
        """The blocks placing it now commits and the output tokens they count (None: all),
        at the router's ratio of this moment (Router._commitment)."""
        max_tokens = self._max_tokens[request.request_id]
        longest = blocks_for_tokens(len(request.prompt_ids) + max_tokens - 1, self.scheduler.block_size)
        return reservation(len(request.prompt_ids), max_tokens, 0, longest, self.router.reserve.at(now),
                           self.scheduler.block_size)

    def _dispatch(self, now: float, placement: Placement) -> None:
        request = self.requests[placement.request_id]
        max_tokens = self._max_tokens[request.request_id]
        params = self._params.get(max_tokens)
        if params is None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            self._params[max_tokens] = params
        self._worker_of[request.request_id] = placement.worker_index
        message = AddRequest(request.request_id, request.prompt_ids, params,
                             reserve_tokens=self._commitment(request, now)[1])
        self._push(now + self.config.dispatch_latency_s, _DELIVER, placement.worker_index, message)

    def _on_deliver(self, now: float, worker_index: int, message: AddRequest) -> None:
        worker = self.workers[worker_index]
        worker.inbox.append(message)
        if not worker.busy:
            self._start(now, worker_index)

    def _start(self, now: float, worker_index: int) -> None:
        step = self.workers[worker_index].start_iteration(now)
        if step is not None:
            self._push(now + step.duration_s, _STEP_END, worker_index, step)

    def _on_step_end(self, now: float, worker_index: int, step: StepStarted) -> None:
        batch = self.workers[worker_index].finish_iteration(now, step)
        if batch is not None:
            self._push(now + self.config.report_latency_s, _BATCH, worker_index, batch)
        self._start(now, worker_index)

    def _on_batch(self, now: float, worker_index: int, batch: StepBatch) -> None:
        for event in batch.events:
            request_id = event.request_id
            timeline = self.timelines[request_id]
            wanted = self.requests[request_id].output_len
            # The client takes tokens up to output_len; the worker may make a few more
            # before its abort lands, and the router counts them.
            for _ in event.token_ids[: max(0, wanted - len(timeline.token_times))]:
                timeline.token_times.append(now)
            self._generated[request_id] = self._generated.get(request_id, 0) + len(event.token_ids)
            if event.finish_reason is not None:
                self._aborting.discard(request_id)
                if event.error is not None:
                    self._num_failed += 1
                else:  # an adaptive ratio learns from each end, as the router's does
                    self.router.reserve.ended(self._generated.pop(request_id), self._max_tokens[request_id])
                self._num_open -= 1
            elif len(timeline.token_times) >= wanted and request_id not in self._aborting:
                # Its client has its answer and ends the stream: the router aborts it.
                self._aborting.add(request_id)
                self._push(now + self.config.dispatch_latency_s, _ABORT, self._worker_of[request_id], request_id)
        for placement in self.router.on_batch(now, worker_index, batch):
            self._dispatch(now, placement)

    def _on_abort(self, now: float, worker_index: int, request_id: str) -> None:
        worker = self.workers[worker_index]
        worker.aborts.append(request_id)
        if not worker.busy:
            self._start(now, worker_index)

    def _close(self, request_id: str) -> None:
        """A request the router rejected: it never ran."""
        del self.timelines[request_id]
        self._num_open -= 1

    def _sample(self, now: float) -> None:
        self._kv_times.append(now)
        self._kv_used.append([w.engine.allocator.num_used_blocks for w in self.workers])
        self._kv_committed.append([w.engine.stats().num_committed_blocks for w in self.workers])
        if self._num_open or self._next_arrival < len(self.trace):
            self._push(now + self.config.kv_sample_interval_s, _SAMPLE)

    def _result(self, end: float, wall_s: float) -> SimResult:
        r = self.router
        stats = [w.engine.stats() for w in self.workers]
        return SimResult(
            policy=self.config.policy,
            worker_blocks=list(self.config.worker_blocks),
            timelines=self.timelines,
            num_requests=len(self.trace),
            num_rejected_queue_full=r.num_rejected_queue_full,
            num_rejected_wait=r.num_rejected_wait,
            num_rejected_too_large=r.num_rejected_too_large,
            num_failed=self._num_failed,
            preemptions_per_worker=[s.num_preemptions for s in stats],
            peak_committed_blocks=[w.peak_committed_blocks for w in self.workers],
            kv_sample_times=self._kv_times,
            kv_used_blocks=self._kv_used,
            kv_committed_blocks=self._kv_committed,
            num_steps=sum(s.num_steps for s in stats),
            num_events=self._num_events,
            num_batches=r.num_batches,
            num_batches_while_queued=r.num_batches_while_queued,
            max_queue_length=r.max_queue_length,
            end_time=end,
            wall_s=wall_s,
            prefix_cache_queried_tokens=sum(s.prefix_cache_queried_tokens for s in stats),
            prefix_cache_hit_tokens=sum(s.prefix_cache_hit_tokens for s in stats),
            num_predicted_hit_blocks=r.num_predicted_hit_blocks,
            num_backfilled=r.num_backfilled,
        )

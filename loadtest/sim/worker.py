"""One simulated worker: the real LLMEngine, a runner that prices steps instead of computing.

The loop is workers/actor.py's `_run`, one iteration at a time in virtual time: take
every AddRequest that has arrived, run one engine step if anything is unfinished, and
when the step's priced time has passed publish a StepBatch (events, added ids, KV
report, and the prefix cache's KV events numbered 1, 2, 3, ... as the actor numbers
them) under the actor's condition: new events, new requests, new KV events, a change
in free blocks, or report_interval_s since the last report. A worker with nothing to do
waits for the next AddRequest.

The engine caches prefixes (SchedulerConfig's default), and a step's price comes from
its plan's shape (cost_model.shape_of): a cache hit starts the request's first chunk
after the cached tokens, so only the tokens it computes are charged, plus its attention
over the cached context.

An idle engine sends no report it already sent (workers/engine_process.py), so an idle
simulated worker sends nothing either; the actor's heartbeats carry no news for placement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from loadtest.sim.cost_model import CostModel, shape_of
from workers.engine.config import SchedulerConfig
from workers.engine.engine import KVPool, LLMEngine, ModelLimits
from workers.engine.errors import InvalidRequestError
from workers.engine.plan import SampledToken, StepPlan, TokenEvent
from workers.engine.request import FinishReason
from workers.engine.stats import EngineStats
from workers.messages import AddRequest, KVEventBatch, StepBatch, WorkerInfo
from workers.model.tokenizer import TokenizerSpec

_TOKEN = SampledToken(token_id=0)


class PricedRunner:
    """The engine's Runner in the simulator: token 0 for every chunk that samples, and the
    step's cost-model time in place of computing it."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.last_step_s = 0.0

    def execute(self, plan: StepPlan) -> Mapping[str, SampledToken]:
        self.last_step_s = self.cost.step_seconds(shape_of(plan))
        return {chunk.request_id: _TOKEN for chunk in plan.chunks if chunk.sample}


class StepStarted(NamedTuple):
    """An engine step that has run; its batch is due once duration_s has passed."""

    duration_s: float
    events: list[TokenEvent]
    added_ids: list[str]


class SimWorker:
    """The engine and the actor's reporting rules, with no threads and no clock of its own."""

    def __init__(
        self,
        worker_id: str,
        num_blocks: int,
        cost: CostModel,
        scheduler: SchedulerConfig,
        report_interval_s: float,
        seed: int,
    ) -> None:
        facts = cost.facts
        self.runner = PricedRunner(cost)
        self.engine = LLMEngine(
            self.runner,
            scheduler,
            KVPool(num_blocks=num_blocks, block_bytes=facts.block_bytes),
            ModelLimits(vocab_size=facts.vocab_size, max_model_len=facts.max_model_len),
            decoder=None,
            seed=seed,
        )
        self.info = WorkerInfo(
            worker_id=worker_id,
            node_id="sim",
            model=facts.model,
            device=facts.device,
            dtype="float32",
            vocab_size=facts.vocab_size,
            max_model_len=scheduler.max_model_len,
            block_size=scheduler.block_size,
            block_bytes=facts.block_bytes,
            num_blocks=num_blocks,
            tokenizer=TokenizerSpec(None, None, ()),
            prefix_caching=scheduler.enable_prefix_caching,
        )
        self.report_interval_s = report_interval_s
        self.inbox: list[AddRequest] = []
        self.aborts: list[str] = []  # request ids the router aborts (their clients ended them)
        self.busy = False  # an iteration is under way (a step's time is passing)
        self.peak_committed_blocks = 0
        self._kv_seq = 0  # the last KVEventBatch published
        self._last_report_at = float("-inf")
        self._last_free = -1

    @property
    def num_blocks(self) -> int:
        return self.info.num_blocks

    def start_iteration(self, now: float) -> StepStarted | None:
        """Take the inbox, run one step if there is work; None: nothing to do, now idle."""
        events: list[TokenEvent] = []
        added: list[str] = []
        for request_id in self.aborts:
            event = self.engine.abort(request_id)
            if event is not None:
                events.append(event)
        self.aborts.clear()
        for request in self.inbox:
            try:
                self.engine.add_request(
                    request.request_id, request.prompt_ids, request.params, arrival_time=now,
                    cache_salt=request.cache_salt, reserve_tokens=request.reserve_tokens,
                )
            except InvalidRequestError as exc:
                events.append(
                    TokenEvent(request.request_id, (), "", 0, finish_reason=FinishReason.ERROR, error=str(exc))
                )
                continue
            added.append(request.request_id)
        self.inbox.clear()
        if added:
            committed = self.engine.stats().num_committed_blocks
            if committed > self.peak_committed_blocks:
                self.peak_committed_blocks = committed
        duration = 0.0
        if self.engine.has_unfinished:
            events.extend(self.engine.step())
            duration = self.runner.last_step_s
            assert duration > 0, "a worker with unfinished requests must plan a non-empty step"
        elif not events:
            self.busy = False
            return None
        self.busy = True
        return StepStarted(duration, events, added)

    def finish_iteration(self, now: float, step: StepStarted) -> StepBatch | None:
        """The step's time has passed: the batch to publish, if the actor would publish one."""
        free = self.engine.allocator.num_free_blocks
        interval_up = now - self._last_report_at >= self.report_interval_s
        kv_events = self.engine.drain_kv_events()
        if step.events or step.added_ids or kv_events or free != self._last_free or interval_up:
            self._last_report_at, self._last_free = now, free
            kv_batch = None
            if kv_events:
                self._kv_seq += 1
                kv_batch = KVEventBatch(self._kv_seq, tuple(kv_events))
            report = self.engine.stats()
            # Committed can also grow at a preemption (a victim's shared blocks stay held).
            self.peak_committed_blocks = max(self.peak_committed_blocks, report.num_committed_blocks)
            return StepBatch(report, tuple(step.events), tuple(step.added_ids), kv_events=kv_batch, sent_at=now)
        return None

    def report(self) -> EngineStats:
        return self.engine.stats()

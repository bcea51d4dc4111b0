"""The router's placement and admission in virtual time.

Placement is router/placement.py itself: the real WorkerView (headroom = report's
uncommitted blocks minus in-flight reservations) and the real policy objects. The
admission queue is router/admission.py's `AdmissionQueue` re-implemented without
asyncio, rule for rule:

* an arrival is placed at once if the queue is empty and the policy finds a worker;
* otherwise it joins the FIFO queue, or is rejected if max_queue are already waiting;
* after every StepBatch the queue is drained head first while the head can be placed;
  the head blocks everyone behind it;
* a request that waited max_queue_wait_s is rejected and leaves the queue (the router
  does not drain on that: the new head is tried at the next batch).

With `config.queue_order` "backfill", as router/admission.py and router/core.py do it:
while the head fits nowhere, the worker it waits for is held for it (when it became the
head, the one with the most headroom among those whose pool holds it; kept until it is
placed), and after the head's turn each drain places up to BACKFILL_SCAN of the requests
behind it, in order, on any other worker with room; an arrival that finds a queue goes
to another worker with room at once, or joins the queue.

The policy is named by the simulator, not by config.policy, so that a proposal
(loadtest/sim/proposals.py) can run too; the rest of config is the router's.

A policy that sees the prefix cache (`prefix`) gets what router/core.py gives it: the
router hashes each prompt's full blocks (router.validation's way: hash_blocks, no cache
salt), keeps a router.prefix_index.PrefixIndex fed with the KVEventBatches on the
workers' StepBatches, passes CacheHits to choose(), reserves the request's charge on
the chosen worker (its need less the prompt blocks its requests there share with it:
WorkerView.place), and predicts the prompt's blocks there.

One shortcut, exact for the policies blind to the cache: once the head has failed a
full choose(), only the worker whose batch just arrived has changed, so the queue is
retried only if that worker passes the test every policy applies before it can return
it (alive, large enough, under max_outstanding, and for the KV-bounded ones enough
headroom). Each of them returns None only when no worker passes it. Not for `prefix`:
its hits change as predictions lapse, and its balance guard can refuse a worker that
passes, so its queue is retried with a full choose() after every batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from loadtest.sim.proposals import CACHE_AWARE, KV_BOUNDED, SIM_POLICIES, make_sim_policy
from router.admission import BACKFILL_SCAN
from router.core import RouterConfig
from router.placement import CacheHits, ReserveRatio, ViewColumns, WorkerView, reservation
from router.prefix_index import PrefixIndex
from router.validation import prompt_block_hashes
from workers.engine.block_hash import BlockHash
from workers.messages import KVSnapshot, StepBatch, WorkerInfo


class Waiting(NamedTuple):
    request_id: str
    need_blocks: int  # what it commits at the ratio of its arrival
    deadline: float
    longest_blocks: int = 0  # at its longest: only a worker whose pool holds that may take it
    # Its prompt and max_tokens, when known: an adaptive ratio's commitment is taken anew at
    # each try, as the router takes it (0: need_blocks throughout).
    num_prompt_tokens: int = 0
    max_tokens: int = 0


class Placement(NamedTuple):
    request_id: str
    worker_index: int


class SimRouter:
    """Owns the worker views, the policy and the admission queue of the simulated router."""

    def __init__(self, config: RouterConfig, infos: Sequence[WorkerInfo], policy: str) -> None:
        self.config = config
        self.policy_name = policy
        self.policy = make_sim_policy(policy, config.max_outstanding_per_worker, config.prefix_weights)
        self.views = ViewColumns([WorkerView(info, last_report_at=0.0) for info in infos])
        self._index = {id(view): i for i, view in enumerate(self.views)}
        self.block_size = infos[0].block_size
        # The ratio a kv-aware placement commits at, in virtual time (router/core.py's).
        self.reserve = ReserveRatio(config.kv_reserve_ratio, config.kv_reserve_floor, config.kv_reserve_decay_s, 0.0)
        self._adaptive = self.reserve.floor < self.reserve.ceiling
        # The prefix index, for the policies that read it: every worker starts empty and
        # synced (nothing is ever lost between a simulated worker and the router).
        self.prefix_index: PrefixIndex | None = None
        if policy in CACHE_AWARE:
            self.prefix_index = PrefixIndex(config.prefix_prediction_ttl_s)
            for info in infos:
                self.prefix_index.reset(info.worker_id, KVSnapshot(0, ()))
        self._block_hashes: dict[str, tuple[BlockHash, ...]] = {}  # arrived, not yet placed
        self.num_predicted_hit_blocks = 0  # over all placements: blocks the index said were there
        self.max_worker_blocks = max(info.num_blocks for info in infos)
        self._queue: deque[Waiting] = deque()
        self._waiting_ids: set[str] = set()  # in the queue and not expired
        self._expired: set[str] = set()  # left the queue by timeout, still in the deque
        self._head_tried = False  # the current head failed a full choose() since it became head
        self.num_rejected_queue_full = 0
        self.num_rejected_wait = 0
        self.num_rejected_too_large = 0
        self.num_placed = 0
        self.max_queue_length = 0
        self.num_batches = 0
        self.num_batches_while_queued = 0  # each costs the real router a full choose()
        self.backfill = config.queue_order == "backfill"
        self._hold: tuple[str, WorkerView] | None = None  # the head, and the worker held for it
        self.num_backfilled = 0  # placed ahead of a head that fit nowhere

    @property
    def num_waiting(self) -> int:
        return len(self._waiting_ids)

    def arrive(
        self, now: float, request_id: str, need_blocks: int, prompt_ids: Sequence[int] = (), longest_blocks: int = 0,
        max_tokens: int = 0,
    ) -> Placement | Waiting | None:
        """A new request committing need_blocks (longest_blocks at its longest): placed,
        queued (the caller arms its deadline), or None: rejected. With max_tokens, a request
        that waits commits at the ratio of each try (need_at)."""
        if max(need_blocks, longest_blocks) > self.max_worker_blocks:
            self.num_rejected_too_large += 1  # validation: no worker could ever hold it
            return None
        if self.prefix_index is not None:
            self._block_hashes[request_id] = prompt_block_hashes(tuple(prompt_ids), self.block_size)
        if not self._waiting_ids:
            placement = self._try_place(now, request_id, need_blocks, longest_blocks)
            if placement is not None:
                return placement
        elif self.backfill:
            placement = self._try_place(now, request_id, need_blocks, longest_blocks, self._held_for(self._queue[0]))
            if placement is not None:
                self.num_backfilled += 1
                return placement
        if len(self._waiting_ids) >= self.config.max_queue:
            self.num_rejected_queue_full += 1
            self._block_hashes.pop(request_id, None)
            return None
        waiting = Waiting(request_id, need_blocks, now + self.config.max_queue_wait_s, longest_blocks,
                          len(prompt_ids), max_tokens)
        self._queue.append(waiting)
        self._waiting_ids.add(request_id)
        self.max_queue_length = max(self.max_queue_length, len(self._waiting_ids))
        return waiting

    def expire(self, request_id: str) -> bool:
        """Its max_queue_wait_s is up: True if it was still waiting (now rejected)."""
        if request_id not in self._waiting_ids:
            return False
        self._waiting_ids.discard(request_id)
        self._expired.add(request_id)
        self._block_hashes.pop(request_id, None)
        self.num_rejected_wait += 1
        self._pop_expired_heads()
        return True

    def on_batch(self, now: float, worker_index: int, batch: StepBatch) -> list[Placement]:
        """Apply a worker's batch (report, then finished requests) and drain the queue."""
        view = self.views[worker_index]
        self.num_batches += 1
        view.apply_report(batch.report, batch.added_ids, now)
        if view.new_preemptions > 0:
            self.reserve.preempted(now)
        if self.prefix_index is not None and batch.kv_events is not None:
            applied = self.prefix_index.apply(view.worker_id, batch.kv_events)
            assert applied, f"{view.worker_id}: KV event batch #{batch.kv_events.seq} out of order"
        for event in batch.events:
            if event.finish_reason is not None:
                view.release(event.request_id)
        return self._drain(now, view)

    def _drain(self, now: float, changed: WorkerView) -> list[Placement]:
        placed: list[Placement] = []
        if self._waiting_ids:
            self.num_batches_while_queued += 1
        while self._queue:
            head = self._queue[0]
            need = self.need_at(head, now)
            if self._head_tried and not self._could_take(changed, need, head.longest_blocks):
                break
            placement = self._try_place(now, head.request_id, need, head.longest_blocks)
            if placement is None:
                self._head_tried = True
                break
            self._queue.popleft()
            self._waiting_ids.discard(head.request_id)
            self._head_tried = False
            placed.append(placement)
            self._pop_expired_heads()
        if self.backfill and len(self._waiting_ids) > 1:
            placed += self._backfill(now, self._held_for(self._queue[0]))
        return placed

    def _backfill(self, now: float, held: WorkerView | None) -> list[Placement]:
        """Up to BACKFILL_SCAN waiting requests behind the head, in order, each on any worker
        with room but the one held for the head; as Router._backfill, one list of workers for
        the scan, and a request at least as large as one refused is not tried (under a policy
        blind to the cache)."""
        views = [v for v in self.views if v is not held]
        refused: list[tuple[int, int]] = []
        placed: list[Placement] = []
        tried = 0
        for waiting in list(self._queue)[1:]:
            if tried == BACKFILL_SCAN:
                break
            if waiting.request_id not in self._waiting_ids:
                continue  # expired, still in the deque
            tried += 1
            size = (self.need_at(waiting, now), waiting.longest_blocks)
            if any(size[0] >= n and size[1] >= longest for n, longest in refused):
                continue
            placement = self._try_place(now, waiting.request_id, size[0], waiting.longest_blocks, views=views)
            if placement is None and not self.policy.reads_hits:
                refused.append(size)
            if placement is not None:
                self._queue.remove(waiting)
                self._waiting_ids.discard(waiting.request_id)
                placed.append(placement)
        self.num_backfilled += len(placed)
        return placed

    def _held_for(self, head: Waiting) -> WorkerView | None:
        """router/core.py's Router._held_for: the worker the head waits for, kept until it is placed."""
        if self._hold is not None and self._hold[0] == head.request_id:
            return self._hold[1]
        longest = max(head.need_blocks, head.longest_blocks)
        best: WorkerView | None = None
        for view in self.views:
            if view.alive and view.num_blocks >= longest and (best is None or view.headroom_blocks > best.headroom_blocks):
                best = view
        self._hold = None if best is None else (head.request_id, best)
        return best

    def need_at(self, waiting: Waiting, now: float) -> int:
        """What a waiting request commits if placed now: router.placement.reservation at the
        ratio of this moment, as Router._commitment takes it at each try."""
        if not self._adaptive or waiting.max_tokens == 0:
            return waiting.need_blocks
        longest = max(waiting.need_blocks, waiting.longest_blocks)
        return reservation(waiting.num_prompt_tokens, waiting.max_tokens, 0, longest, self.reserve.at(now),
                           self.block_size)[0]

    def _could_take(self, view: WorkerView, need_blocks: int, longest_blocks: int = 0) -> bool:
        if self.policy_name not in SIM_POLICIES or self.policy_name in CACHE_AWARE or self._adaptive:
            return True  # (an adaptive ratio: the head's commitment moves between batches)
        if not (
            view.alive
            and max(need_blocks, longest_blocks) <= view.total_blocks
            and len(view.outstanding) < self.config.max_outstanding_per_worker
        ):
            return False
        return self.policy_name not in KV_BOUNDED or view.headroom_blocks >= need_blocks

    def _pop_expired_heads(self) -> None:
        while self._queue and self._queue[0].request_id in self._expired:
            self._expired.discard(self._queue.popleft().request_id)
            self._head_tried = False

    def _try_place(self, now: float, request_id: str, need_blocks: int, longest_blocks: int = 0,
                   passing: WorkerView | None = None, views: Sequence[WorkerView] | None = None) -> Placement | None:
        """Choose a worker (with the cache's hits, for a policy that reads them) and reserve
        there what the request would newly hold; None: no worker now. passing: a worker held
        for the queue's head, which this request may not take; views: the workers to choose
        from (default: every one)."""
        if views is None:
            views = self.views if passing is None else [v for v in self.views if v is not passing]
        index = self.prefix_index
        if index is None:
            view = self.policy.choose(views, need_blocks, None, longest_blocks)
            return None if view is None else self._place(view, request_id, need_blocks)
        block_hashes = self._block_hashes[request_id]
        hits = CacheHits(len(block_hashes), index.hits(block_hashes, now), block_hashes) if block_hashes else None
        view = self.policy.choose(views, need_blocks, hits, longest_blocks)
        if view is None:
            return None
        cached = hits.by_worker.get(view.worker_id, 0) if hits is not None else 0
        self.num_predicted_hit_blocks += cached
        del self._block_hashes[request_id]
        if block_hashes:
            index.predict(view.worker_id, block_hashes, now)
        return self._place(view, request_id, need_blocks, block_hashes)  # as router/core.py reserves

    def _place(self, view: WorkerView, request_id: str, need_blocks: int,
               block_hashes: Sequence[BlockHash] = ()) -> Placement:
        view.place(request_id, need_blocks, block_hashes)
        self.num_placed += 1
        return Placement(request_id, self._index[id(view)])

"""Continuous batching with chunked prefill: which tokens of which requests run each step.

The scheduler owns the waiting queue, the running list and the block tables. Block ids
and refcounts belong to the BlockAllocator; the scheduler only asks it for blocks and
hands them back.

Why this never deadlocks, and never loses a request:

* The engine admits a request only if it could fit the whole pool alone:
  blocks_for_tokens(request.max_kv_tokens) <= num_blocks. A running request never
  holds KV for more than max_kv_tokens tokens, because the engine finishes it when
  its max_tokens-th output is sampled (that last token is never fed back).
* Preemption always takes the newest running request. So the oldest running request
  is never a victim of another request, and it cannot be its own victim either: by the
  time it is the only one left, every used block is its own, and it fits the pool.
  Every step that has a running request therefore computes at least one token of the
  oldest one (it is scheduled first, with the whole budget available), and it
  finishes in a bounded number of steps.
* A step that starts with nothing running preempts nothing, so it admits the head of
  the waiting queue: a waiting request holds no KV and its first chunk fits an empty
  pool by the first point.
* Preempted requests go to the front of the waiting queue and keep their tokens
  (prompt and outputs so far); they recompute their KV when readmitted.
* With enable_prefix_caching, every admission (the first, after a preemption, or of a
  resumed request, whose known tokens include its output so far) starts after the
  longest cached prefix of the known tokens (_admit). None of the above changes: an
  unheld cached block (EVICTABLE) is allocatable like a free one, a block shared with
  the request that needs room is in its own table, and admission counts the hit blocks
  it takes out of the LRU against what is available (BlockAllocator.can_allocate).
  A waiting request whose next uncached block a running request is computing waits
  (in its place in the queue, while those behind it may go) until that block is written
  and it can hit it: never with nothing running, so the point above stands, and no
  longer than the running request's prefill.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from workers.engine.block_allocator import BlockAllocator
from workers.engine.block_hash import BlockHash
from workers.engine.config import SchedulerConfig, blocks_for_tokens
from workers.engine.errors import DuplicateRequestError
from workers.engine.plan import ScheduledChunk, StepPlan
from workers.engine.prefix_cache import PrefixCache, PrefixCacheCounters
from workers.engine.request import FinishReason, Request, SchedulingState


class Scheduler:
    """Decides each step's chunks within one token budget, vLLM-v1 style.

    Running requests (oldest first) get their next tokens first: one for a decode, the
    next chunk for a request still in prefill. Then, if no request was preempted this
    step, waiting requests are admitted first come first served while there is budget,
    a free sequence slot and KV blocks for their first chunk.
    """

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator) -> None:
        self._config = config
        self._allocator = allocator
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order: oldest first, newest last
        self._block_tables: dict[str, list[int]] = {}  # running requests only
        self._requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self._pending_finished_ids: list[str] = []  # left since the last plan
        self._num_preemptions = 0
        self._prefix_cache = PrefixCache(allocator, config.block_size) if config.enable_prefix_caching else None

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    # -- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request the engine has validated (it fits the pool alone), FCFS.

        Raises DuplicateRequestError if a request with this id is still unfinished.
        """
        if request.request_id in self._requests:
            raise DuplicateRequestError("request_id", f"request {request.request_id!r} is already in the engine")
        assert request.status is SchedulingState.WAITING and request.num_computed_tokens == 0
        assert blocks_for_tokens(request.max_kv_tokens, self._config.block_size) <= self._allocator.num_blocks, (
            f"request {request.request_id!r} can never fit the KV pool; the engine must refuse it"
        )
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Remove a request (finished or aborted) and free its blocks now.

        Its id is reported in the next plan's finished_ids. Unknown or already finished
        ids return None.
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is SchedulingState.RUNNING:
            self._running.remove(request)
            self._release_table(request_id)
        else:
            self._waiting.remove(request)
        if self._prefix_cache is not None:
            self._prefix_cache.forget(request_id)
        request.status = SchedulingState.FINISHED
        request.finish_reason = reason
        self._pending_finished_ids.append(request_id)
        return request

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished (waiting or running) request with this id, or None."""
        return self._requests.get(request_id)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """Block ids holding this request's KV, in position order; () if it holds none."""
        return tuple(self._block_tables.get(request_id, ()))

    def num_table_blocks(self, request_id: str) -> int:
        """len(block_table(request_id)) without the copy: 0 for a request holding none."""
        table = self._block_tables.get(request_id)
        return 0 if table is None else len(table)

    def num_shared_waiting_blocks(self) -> int:
        """Of the waiting requests' cached prefixes, the blocks they would share rather
        than take (EngineStats.num_committed_blocks): those some request holds now (a
        running one may still be computing them), and those an earlier waiting request
        already takes. 0 with prefix caching off.

        Sound under eviction: a counted block the allocator evicts for a running request
        moves from a waiting request's hit to its new blocks, and the running request's
        growth to used, so the sum stays; only the sharers behind it count more."""
        if self._prefix_cache is None or not self._waiting:
            return 0
        evictable_among = self._allocator.evictable_among
        pending = self._pending_hashes()
        taken: set[int] = set()  # evictable hit blocks an earlier waiting request takes
        shared = 0
        # Set operations, not a loop per block: this runs every step, for every waiting request.
        for request in self._waiting:
            hit, num_pending = self._prefix_cache.hit_and_pending(request, pending)
            shared += num_pending  # held by the running request computing them
            if hit:
                takes = evictable_among(hit) - taken  # the rest are held, or taken already
                taken |= takes
                shared += len(hit) - len(takes)
        return shared

    def _pending_hashes(self) -> set[BlockHash]:
        """Hashes of the full blocks running requests hold and have not written yet."""
        cache = self._prefix_cache
        if cache is None or not self._waiting:
            return set()
        pending: set[BlockHash] = set()
        for request in self._running:
            if request.num_computed_tokens < request.num_tokens - 1:  # still in prefill
                pending.update(cache.pending_hashes(request))
        return pending

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_preemptions(self) -> int:
        """Preemptions since this scheduler was created."""
        return self._num_preemptions

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def prefix_cache_counters(self) -> PrefixCacheCounters:
        """Tokens looked up and found in the prefix cache; zeros when it is off."""
        return PrefixCacheCounters() if self._prefix_cache is None else self._prefix_cache.counters

    # -- one step ------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan one step. Blocks for every chunk are allocated before this returns."""
        budget = self._config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted_ids: list[str] = []

        # 1. Running requests, oldest first. The list can shrink under us (preemption
        # removes from the end), so walk it by index.
        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id!r} has nothing to compute"
            scheduled = True
            while not self._grow_table(request, num_new):
                victim = self._running[-1]
                # The oldest running request alone always fits (see the module docstring).
                assert victim is not self._running[0], (
                    f"request {request.request_id!r} cannot fit the KV pool even alone"
                )
                self._preempt(victim)
                preempted_ids.append(victim.request_id)
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                # The request just preempted itself: everyone after it is gone too.
                break
            chunks.append(self._make_chunk(request, num_new))
            budget -= num_new
            index += 1

        # 2. Waiting requests, first come first served. Skipped after a preemption: the
        # pool is evidently short, and admitting now would only evict again next step.
        if not preempted_ids:
            cache = self._prefix_cache
            pending = self._pending_hashes()
            position = 0
            while position < len(self._waiting) and budget > 0 and len(self._running) < self._config.max_num_seqs:
                request = self._waiting[position]
                if pending and cache is not None and cache.hit_and_pending(request, pending)[1]:
                    position += 1  # its next block is being computed: it hits it once written
                    continue
                num_admitted = self._admit(request, budget)
                if num_admitted is None:
                    # Head of line: a smaller request behind it must not overtake it,
                    # or a long prompt could wait forever.
                    break
                del self._waiting[position]
                request.status = SchedulingState.RUNNING
                self._running.append(request)
                chunks.append(self._make_chunk(request, num_admitted))
                budget -= num_admitted
                if cache is not None:
                    pending.update(cache.pending_hashes(request))

        finished_ids = tuple(self._pending_finished_ids) + tuple(preempted_ids)
        self._pending_finished_ids.clear()
        return StepPlan(chunks=tuple(chunks), preempted_ids=tuple(preempted_ids), finished_ids=finished_ids)

    def commit(self, plan: StepPlan, sampled: Mapping[str, int]) -> None:
        """Record that the runner executed plan: advance progress, append sampled tokens.

        sampled maps request_id to the token sampled for each chunk with sample=True.
        Chunks of requests finished or aborted since schedule() are skipped.
        """
        for chunk in plan.chunks:
            request = self._requests.get(chunk.request_id)
            if request is None or request.status is not SchedulingState.RUNNING:
                continue
            assert request.num_computed_tokens == chunk.start_position, (
                f"stale chunk for {chunk.request_id!r}: starts at {chunk.start_position}, "
                f"request has {request.num_computed_tokens} computed"
            )
            request.num_computed_tokens += chunk.num_tokens
            if chunk.sample:
                request.token_ids.append(sampled[chunk.request_id])
            if self._prefix_cache is not None:
                # Only now is this step's KV written: its full blocks become findable.
                self._prefix_cache.cache_written_blocks(request, self._block_tables[request.request_id])

    # -- internals -----------------------------------------------------------------

    def _admit(self, request: Request, budget: int) -> int | None:
        """Give a waiting request its table, the cached prefix of its known tokens and new
        blocks for its first chunk; return the chunk's length, or None taking nothing.

            block_size 4, known 11, hit 2 blocks, budget 2
            positions:  0 1 2 3 | 4 5 6 7 | 8 9 [10]
            table:      hit     | hit     | new         chunk 8 9, num_computed 8
        """
        assert request.num_computed_tokens == 0 and request.request_id not in self._block_tables
        block_size = self._config.block_size
        hit = self._prefix_cache.find_hit(request) if self._prefix_cache is not None else []
        num_hit_tokens = len(hit) * block_size
        num_new = min(request.num_tokens - num_hit_tokens, budget)
        num_new_blocks = blocks_for_tokens(num_hit_tokens + num_new, block_size) - len(hit)
        if not self._allocator.can_allocate(num_new_blocks, touching=hit):
            return None
        self._allocator.touch(hit)
        block_ids = self._allocator.allocate(num_new_blocks)
        assert block_ids is not None, "can_allocate said yes"
        self._block_tables[request.request_id] = hit + block_ids
        request.num_computed_tokens = num_hit_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit_tokens
        if self._prefix_cache is not None:
            self._prefix_cache.admitted(request, len(hit))
        return num_new

    def _grow_table(self, request: Request, num_new: int) -> bool:
        """Extend the request's table to cover num_computed + num_new tokens; False if no room.

            block_size 4, num_computed 6, num_new 3 -> positions 0..8 -> 3 blocks
            positions: 0 1 2 3 | 4 5 [6 7 | 8]
            table:        b0   |    b1     | b2   <- one block to allocate
        """
        table = self._block_tables[request.request_id]
        needed = blocks_for_tokens(request.num_computed_tokens + num_new, self._config.block_size) - len(table)
        if needed <= 0:
            return True
        block_ids = self._allocator.allocate(needed)
        if block_ids is None:
            return False
        table.extend(block_ids)
        return True

    def _preempt(self, request: Request) -> None:
        """Evict the newest running request: free its KV, queue it first to recompute."""
        assert self._running and self._running[-1] is request
        self._running.pop()
        self._release_table(request.request_id)
        request.num_computed_tokens = 0
        request.status = SchedulingState.WAITING
        request.num_preemptions += 1
        self._num_preemptions += 1
        self._waiting.appendleft(request)

    def _release_table(self, request_id: str) -> None:
        """Hand a request's blocks back; with the prefix cache tail first, so a prefix's
        end is evicted before its start (as vLLM does): table (4, 9, 2) -> LRU ... 2 9 4.
        Without it, in table order, exactly as before the cache existed."""
        table = self._block_tables.pop(request_id)
        if self._prefix_cache is not None:
            self._prefix_cache.released(request_id)
            table.reverse()
        self._allocator.release(table)

    def _make_chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        """The next num_new tokens of request, after its table was grown to cover them.

            token_ids: [p0 p1 p2 p3 p4 o0 o1]   num_computed 5, num_new 2
                                       ^^^^^    -> positions 5, 6; sample (reaches the end)
        """
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=tuple(request.token_ids[start:end]),
            start_position=start,
            block_table=tuple(self._block_tables[request.request_id]),
            sample=end == request.num_tokens,
            params=request.params,
            seed=request.seed,
        )

    # -- checks --------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the scheduler's state is consistent with itself and the allocator."""
        running_ids = [request.request_id for request in self._running]
        waiting_ids = [request.request_id for request in self._waiting]
        assert len(set(running_ids)) == len(running_ids), "a request is in the running list twice"
        assert len(set(waiting_ids)) == len(waiting_ids), "a request is in the waiting queue twice"
        assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
        assert set(self._requests) == set(running_ids) | set(waiting_ids), "request index out of sync"
        assert len(self._running) <= self._config.max_num_seqs, "more running requests than max_num_seqs"
        assert set(self._block_tables) == set(running_ids), "block tables must belong to running requests"

        seen: set[int] = set()
        for request in self._running:
            assert request.status is SchedulingState.RUNNING, f"{request.request_id!r} is running with {request.status}"
            assert 0 <= request.num_computed_tokens <= request.num_tokens
            table = self._block_tables[request.request_id]
            assert len(table) * self._config.block_size >= request.num_computed_tokens, (
                f"{request.request_id!r}: table of {len(table)} blocks cannot hold "
                f"{request.num_computed_tokens} computed tokens"
            )
            assert len(set(table)) == len(table), f"{request.request_id!r} holds a block twice"
            if self._prefix_cache is None:
                assert not seen & set(table), f"{request.request_id!r} shares a block with no prefix cache"
            else:
                # Shared blocks are cached ones, under this request's own hashes.
                self._prefix_cache.check_invariants(request, table)
            seen.update(table)
        for request in self._waiting:
            assert request.status is SchedulingState.WAITING, f"{request.request_id!r} is waiting with {request.status}"
            assert request.num_computed_tokens == 0, f"waiting {request.request_id!r} has computed tokens"
        # The tables are the only holders: every refcount is the number of tables naming
        # the block, so no block is used that no table holds.
        self._allocator.check_invariants(self._block_tables.values())

"""Prefix caching under random add / step / abort / pressure / evict sequences.

Prompts come from a few families that share prefixes of random lengths (and two cache
salts), so hits, duplicates computed in one step, preemption with re-hits and eviction
all happen. After every operation the scheduler's and the allocator's invariants hold
(refcounts equal the block tables naming each block, every block in exactly one
state), and the allocator's KV events drained and replayed onto a set give exactly its
hash map, as the router's index would see it; the content-checking runner proves no request read KV that was not its own;
at the end every output equals the request's output alone and no block is held.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.prefix_cache_fakes import ContentKVRunner, make_scheduler
from tests.test_block_allocator import replay_events
from tests.test_scheduler import finish_long_enough, reference_output
from workers.engine.block_allocator import BlockAllocator, BlockState
from workers.engine.block_hash import BlockHash
from workers.engine.request import FinishReason, Request
from workers.engine.sampling import SamplingParams
from workers.engine.scheduler import Scheduler

NUM_FAMILIES = 3


def family_prefix(family: int, length: int) -> tuple[int, ...]:
    return tuple(1000 * (family + 1) + i for i in range(length))


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scheduler: Scheduler
        self.allocator: BlockAllocator
        self.runner: ContentKVRunner
        self.requests: list[Request] = []
        self.aborted: set[str] = set()
        self.replayed: set[BlockHash] = set()  # the hash map, as the drained events tell it

    @initialize(
        block_size=st.integers(min_value=1, max_value=4),
        num_blocks=st.integers(min_value=2, max_value=12),
        max_num_seqs=st.integers(min_value=1, max_value=6),
        budget=st.integers(min_value=1, max_value=16),
    )
    def make(self, block_size: int, num_blocks: int, max_num_seqs: int, budget: int) -> None:
        self.scheduler, self.allocator, self.runner = make_scheduler(
            num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs, block_size=block_size
        )

    @property
    def capacity(self) -> int:
        """Tokens of KV the whole pool holds."""
        return self.allocator.num_blocks * self.scheduler.config.block_size

    def add_request(self, prompt: tuple[int, ...], max_tokens: int, cache_salt: str | None) -> None:
        # Only requests that fit the whole pool, as the engine guarantees.
        prompt = prompt[: self.capacity]
        max_tokens = max(1, min(max_tokens, self.capacity - len(prompt) + 1))
        request = Request(
            request_id=f"r{len(self.requests)}",
            prompt_ids=prompt,
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            seed=0,
            arrival_time=0.0,
            cache_salt=cache_salt,
        )
        self.requests.append(request)
        self.scheduler.add_request(request)

    @rule(
        family=st.integers(min_value=0, max_value=NUM_FAMILIES - 1),
        num_shared=st.integers(min_value=0, max_value=24),
        num_own=st.integers(min_value=0, max_value=6),
        max_tokens=st.integers(min_value=1, max_value=12),
        cache_salt=st.sampled_from([None, None, "tenant"]),
    )
    def add(self, family: int, num_shared: int, num_own: int, max_tokens: int, cache_salt: str | None) -> None:
        own = tuple(100_000 + 100 * len(self.requests) + i for i in range(num_own))
        prompt = family_prefix(family, num_shared) + own
        self.add_request(prompt or (7,), max_tokens, cache_salt)

    @rule(family=st.integers(min_value=0, max_value=NUM_FAMILIES - 1))
    def pressure(self, family: int) -> None:
        """A request that wants most of the pool: preemption and eviction follow."""
        self.add_request(family_prefix(family, self.capacity), self.capacity, None)

    @rule()
    def step(self) -> None:
        self.run_step(abort_index=None)

    @rule(index=st.integers(min_value=0, max_value=30))
    def abort_mid_step(self, index: int) -> None:
        self.run_step(abort_index=index)

    @rule(index=st.integers(min_value=0, max_value=30))
    def abort(self, index: int) -> None:
        if self.requests:
            request = self.requests[index % len(self.requests)]
            if self.scheduler.finish_request(request.request_id, FinishReason.CANCELLED) is not None:
                self.aborted.add(request.request_id)

    @rule()
    def evict(self) -> None:
        self.allocator.evict_all()

    def run_step(self, abort_index: int | None) -> None:
        plan = self.scheduler.schedule()
        self.scheduler.check_invariants()
        sampled = self.runner.execute(plan)
        if abort_index is not None:
            self.abort(abort_index)  # between the runner and commit, as a cancel can land
            self.scheduler.check_invariants()
        self.scheduler.commit(plan, sampled)
        finish_long_enough(self.scheduler, plan)
        if plan.preempted_ids:
            event("preempted")

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "scheduler"):
            self.scheduler.check_invariants()
            self.check_events()

    def check_events(self) -> None:
        """One operation's events (a step evicts, hits and caches many blocks), replayed."""
        replay_events(self.replayed, self.allocator.drain_events())
        assert self.replayed == set(self.allocator.cached_hashes())
        if self.allocator.num_cached_blocks:
            event("events replayed onto a non-empty cache")

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        scheduler, allocator = self.scheduler, self.allocator
        # The oldest running request computes a token every step and is never preempted.
        max_steps = sum(r.max_num_tokens for r in self.requests if not r.is_finished) + 1
        for _ in range(max_steps):
            if not scheduler.has_unfinished:
                break
            self.run_step(abort_index=None)
            scheduler.check_invariants()
        assert not scheduler.has_unfinished, "requests left after the step bound"
        self.check_events()  # the whole drain at once: the log keeps net changes only
        for request in self.requests:
            expected = reference_output(request.prompt_ids, request.params.max_tokens)
            if request.request_id in self.aborted:
                assert request.output_ids == expected[: request.num_output_tokens]
            else:
                assert request.finish_reason is FinishReason.LENGTH
                assert request.output_ids == expected
        counters = scheduler.prefix_cache_counters
        event(f"hit tokens: {'some' if counters.num_hit_tokens else 'none'}")
        # Nothing is held: every block is free or evictable, and the counts agree.
        allocator.check_invariants([])
        states = [allocator.block_state(b) for b in range(allocator.num_blocks)]
        assert BlockState.USED not in states
        assert allocator.num_used_blocks == 0
        assert allocator.num_evictable_blocks == states.count(BlockState.EVICTABLE)
        assert allocator.free_kv_bytes == allocator.total_kv_bytes


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

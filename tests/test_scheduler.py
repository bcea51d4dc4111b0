"""Scheduler: exact scenarios with named block ids, then random add / step / abort sequences.

A fake runner stands in for the model. It writes each chunk's tokens into a slot-addressed
"KV cache" through the chunk's block table and samples the next token as a fixed function
of the context it reads back, so a wrong block table, a shared block or a lost position
shows up as a wrong token, and every request's output must equal what it would generate
alone, however often it was preempted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from workers.engine.block_allocator import BlockAllocator
from workers.engine.config import SchedulerConfig, blocks_for_tokens
from workers.engine.errors import DuplicateRequestError
from workers.engine.plan import StepPlan
from workers.engine.request import FinishReason, Request, SchedulingState
from workers.engine.sampling import SamplingParams
from workers.engine.scheduler import Scheduler

BLOCK_SIZE = 4
BLOCK_BYTES = 64


def next_token(context: Sequence[int]) -> int:
    """The fake model: any deterministic function of the whole context will do."""
    return (31 * sum(context) + 7 * context[-1] + len(context)) % 100


def prompt_for(request_id: str, length: int) -> tuple[int, ...]:
    salt = sum(ord(c) for c in request_id)
    return tuple((salt + 13 * i) % 100 for i in range(length))


def reference_output(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What the request generates when it runs alone, never preempted."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def make_request(request_id: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(
        request_id=request_id,
        prompt_ids=prompt_for(request_id, prompt_len),
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        seed=0,
        arrival_time=0.0,
    )


def make_scheduler(
    num_blocks: int,
    budget: int = 64,
    max_num_seqs: int = 8,
    block_size: int = BLOCK_SIZE,
) -> tuple[Scheduler, BlockAllocator]:
    """A scheduler without the prefix cache: these tests pin the schedules of an engine
    that has none, block id for block id (tests/test_prefix_cache.py has the cache on)."""
    config = SchedulerConfig(
        max_model_len=num_blocks * block_size,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    )
    allocator = BlockAllocator(num_blocks=num_blocks, block_bytes=BLOCK_BYTES)
    return Scheduler(config, allocator), allocator


class FakeRunner:
    """Executes a plan against a dict of slots, the way a model runner uses its KV cache."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv: dict[int, tuple[str, int, int]] = {}  # slot -> (request_id, position, token_id)

    def slot(self, block_table: Sequence[int], position: int) -> int:
        #   block_size 4, block_table (7, 2):  position 5 -> block 2, offset 1 -> slot 9
        block_size = self.config.block_size
        return block_table[position // block_size] * block_size + position % block_size

    def execute(self, plan: StepPlan) -> dict[str, int]:
        config = self.config
        request_ids = [chunk.request_id for chunk in plan.chunks]
        assert len(set(request_ids)) == len(request_ids), "a request is twice in one plan"
        assert not set(request_ids) & set(plan.preempted_ids), "a preempted request was scheduled"
        assert set(plan.preempted_ids) <= set(plan.finished_ids)
        assert 0 < plan.num_tokens <= config.max_num_batched_tokens or plan.is_empty
        assert len(plan.chunks) <= config.max_num_seqs
        # A request that left must recompute from scratch: forget everything it wrote.
        gone = set(plan.finished_ids)
        self.kv = {slot: entry for slot, entry in self.kv.items() if entry[0] not in gone}

        for chunk in plan.chunks:
            assert chunk.num_tokens > 0
            assert len(chunk.block_table) == blocks_for_tokens(chunk.context_len, config.block_size)
            for offset, token_id in enumerate(chunk.token_ids):
                position = chunk.start_position + offset
                self.kv[self.slot(chunk.block_table, position)] = (chunk.request_id, position, token_id)
        sampled: dict[str, int] = {}
        for chunk in plan.chunks:
            context = []
            for position in range(chunk.context_len):
                entry = self.kv.get(self.slot(chunk.block_table, position))
                assert entry is not None and entry[:2] == (chunk.request_id, position), (
                    f"{chunk.request_id} position {position}: KV slot holds {entry}"
                )
                context.append(entry[2])
            if chunk.sample:
                sampled[chunk.request_id] = next_token(context)
        return sampled


def finish_long_enough(scheduler: Scheduler, plan: StepPlan) -> None:
    """What the engine does after commit: finish requests that reached max_tokens."""
    for chunk in plan.chunks:
        if not chunk.sample:
            continue
        request = scheduler.get_request(chunk.request_id)
        if request is not None and request.num_output_tokens >= request.params.max_tokens:
            assert scheduler.finish_request(chunk.request_id, FinishReason.LENGTH) is request


def run_plan(scheduler: Scheduler, runner: FakeRunner, plan: StepPlan) -> None:
    scheduler.commit(plan, runner.execute(plan))
    finish_long_enough(scheduler, plan)


def step(scheduler: Scheduler, runner: FakeRunner) -> StepPlan:
    """One engine step: schedule, run, commit, finish by length."""
    plan = scheduler.schedule()
    scheduler.check_invariants()
    run_plan(scheduler, runner, plan)
    scheduler.check_invariants()
    return plan


def chunk_summary(plan: StepPlan) -> list[tuple[str, int, int, tuple[int, ...], bool]]:
    """(request_id, start_position, num_tokens, block_table, sample) per chunk."""
    return [(c.request_id, c.start_position, c.num_tokens, c.block_table, c.sample) for c in plan.chunks]


def drain(scheduler: Scheduler, runner: FakeRunner, max_steps: int) -> list[StepPlan]:
    plans: list[StepPlan] = []
    while scheduler.has_unfinished:
        assert len(plans) < max_steps, f"not done after {max_steps} steps: deadlock or livelock"
        plans.append(step(scheduler, runner))
    return plans


# -- exact scenarios ---------------------------------------------------------------


@pytest.mark.parametrize(("prompt_len", "num_blocks"), [(3, 1), (4, 1), (5, 2), (7, 2), (8, 2), (9, 3)])
def test_prompt_gets_exactly_ceil_blocks(prompt_len: int, num_blocks: int) -> None:
    scheduler, allocator = make_scheduler(num_blocks=8)
    request = make_request("r", prompt_len)
    scheduler.add_request(request)
    plan = scheduler.schedule()
    assert chunk_summary(plan) == [("r", 0, prompt_len, tuple(range(num_blocks)), True)]
    assert plan.chunks[0].token_ids == request.prompt_ids
    assert scheduler.block_table("r") == tuple(range(num_blocks))
    assert allocator.num_free_blocks == 8 - num_blocks
    assert request.status is SchedulingState.RUNNING
    scheduler.check_invariants()


def test_prompts_straddling_boundaries_in_one_step() -> None:
    scheduler, allocator = make_scheduler(num_blocks=16)
    for n in (3, 4, 5, 7, 8, 9):
        scheduler.add_request(make_request(f"p{n}", n))
    plan = scheduler.schedule()
    assert chunk_summary(plan) == [
        ("p3", 0, 3, (0,), True),
        ("p4", 0, 4, (1,), True),
        ("p5", 0, 5, (2, 3), True),
        ("p7", 0, 7, (4, 5), True),
        ("p8", 0, 8, (6, 7), True),
        ("p9", 0, 9, (8, 9, 10), True),
    ]
    assert allocator.num_free_blocks == 16 - 11
    assert allocator.free_kv_bytes == 5 * BLOCK_BYTES
    assert plan.preempted_ids == () and plan.finished_ids == ()
    scheduler.check_invariants()


def test_decode_allocates_one_block_exactly_at_the_boundary() -> None:
    scheduler, allocator = make_scheduler(num_blocks=8)
    runner = FakeRunner(scheduler.config)
    request = make_request("r", 3, max_tokens=8)
    scheduler.add_request(request)

    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("r", 0, 3, (0,), True)]
    assert request.num_computed_tokens == 3 and request.num_output_tokens == 1

    # Positions 3 (still block 0), 4 (needs block 1), 5..7 (block 1), 8 (needs block 2), 9.
    expected = [
        (3, (0,), 7),
        (4, (0, 1), 6),
        (5, (0, 1), 6),
        (6, (0, 1), 6),
        (7, (0, 1), 6),
        (8, (0, 1, 2), 5),
        (9, (0, 1, 2), 5),
    ]
    for position, table, num_free in expected:
        output_before = request.output_ids
        plan = scheduler.schedule()
        assert chunk_summary(plan) == [("r", position, 1, table, True)]
        assert plan.chunks[0].token_ids == (request.token_ids[-1],)
        assert allocator.num_free_blocks == num_free
        run_plan(scheduler, runner, plan)
        assert request.output_ids[:-1] == output_before
    assert request.is_finished and request.finish_reason is FinishReason.LENGTH
    assert request.output_ids == reference_output(request.prompt_ids, 8)
    assert allocator.num_free_blocks == 8


def test_chunked_prefill_splits_the_prompt_and_samples_only_at_the_end() -> None:
    scheduler, allocator = make_scheduler(num_blocks=8, budget=6)
    runner = FakeRunner(scheduler.config)
    request = make_request("r", 10, max_tokens=3)
    scheduler.add_request(request)

    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("r", 0, 6, (0, 1), False)]
    assert plan.chunks[0].token_ids == request.prompt_ids[:6]
    assert request.num_computed_tokens == 6 and request.num_output_tokens == 0

    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("r", 6, 4, (0, 1, 2), True)]
    assert plan.chunks[0].token_ids == request.prompt_ids[6:]
    assert request.num_computed_tokens == 10 and request.num_output_tokens == 1

    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("r", 10, 1, (0, 1, 2), True)]
    step(scheduler, runner)
    assert request.is_finished
    assert request.output_ids == reference_output(request.prompt_ids, 3)
    assert allocator.num_free_blocks == 8


def test_prefill_chunks_and_decodes_share_one_budget() -> None:
    scheduler, _ = make_scheduler(num_blocks=16, budget=6)
    runner = FakeRunner(scheduler.config)
    first = make_request("a", 10, max_tokens=5)
    second = make_request("b", 5, max_tokens=5)
    scheduler.add_request(first)
    scheduler.add_request(second)

    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("a", 0, 6, (0, 1), False)]  # budget spent: b waits
    assert scheduler.num_waiting == 1

    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("a", 6, 4, (0, 1, 2), True), ("b", 0, 2, (3,), False)]

    plan = step(scheduler, runner)  # a decodes while b finishes its prefill
    assert chunk_summary(plan) == [("a", 10, 1, (0, 1, 2), True), ("b", 2, 3, (3, 4), True)]

    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("a", 11, 1, (0, 1, 2), True), ("b", 5, 1, (3, 4), True)]
    drain(scheduler, runner, max_steps=10)
    assert first.output_ids == reference_output(first.prompt_ids, 5)
    assert second.output_ids == reference_output(second.prompt_ids, 5)


def test_max_num_seqs_caps_the_running_list() -> None:
    scheduler, _ = make_scheduler(num_blocks=16, max_num_seqs=2)
    runner = FakeRunner(scheduler.config)
    scheduler.add_request(make_request("a", 4, max_tokens=1))
    scheduler.add_request(make_request("b", 4, max_tokens=3))
    scheduler.add_request(make_request("c", 4, max_tokens=3))

    plan = step(scheduler, runner)
    assert [c.request_id for c in plan.chunks] == ["a", "b"]
    # a reached max_tokens and was finished, so c gets its slot next step.
    assert scheduler.num_running == 1 and scheduler.num_waiting == 1

    plan = scheduler.schedule()
    # b's decode at position 4 takes block 2; block 0 went to the back of the free
    # queue when a finished, so c gets block 3.
    assert chunk_summary(plan) == [("b", 4, 1, (1, 2), True), ("c", 0, 4, (3,), True)]
    assert plan.finished_ids == ("a",)
    assert scheduler.num_running == 2 and scheduler.num_waiting == 0
    run_plan(scheduler, runner, plan)


def test_waiting_queue_is_head_of_line() -> None:
    scheduler, allocator = make_scheduler(num_blocks=4)
    runner = FakeRunner(scheduler.config)
    scheduler.add_request(make_request("a", 8, max_tokens=2))
    step(scheduler, runner)
    scheduler.add_request(make_request("big", 12, max_tokens=1))  # 3 blocks
    scheduler.add_request(make_request("small", 1, max_tokens=1))  # 1 block

    plan = step(scheduler, runner)
    # a's decode at position 8 takes block 2; big needs 3 of the 1 left, and small
    # may not overtake it.
    assert chunk_summary(plan) == [("a", 8, 1, (0, 1, 2), True)]
    assert scheduler.num_waiting == 2

    plan = step(scheduler, runner)  # a finished last step and freed its blocks
    assert plan.finished_ids == ("a",)
    assert chunk_summary(plan) == [("big", 0, 12, (3, 0, 1), True), ("small", 0, 1, (2,), True)]
    assert allocator.num_free_blocks == 4


def test_preemption_takes_the_newest_and_it_recomputes() -> None:
    scheduler, allocator = make_scheduler(num_blocks=4)
    runner = FakeRunner(scheduler.config)
    a = make_request("a", 4, max_tokens=8)
    b = make_request("b", 7, max_tokens=8)
    c = make_request("c", 4, max_tokens=4)
    for request in (a, b, c):
        scheduler.add_request(request)

    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("a", 0, 4, (0,), True), ("b", 0, 7, (1, 2), True), ("c", 0, 4, (3,), True)]
    assert allocator.num_free_blocks == 0

    # a's decode at position 4 needs a block; none is free, so the newest (c) goes and
    # a takes its block. b's decode at position 7 fits its own block 2.
    plan = scheduler.schedule()
    assert chunk_summary(plan) == [("a", 4, 1, (0, 3), True), ("b", 7, 1, (1, 2), True)]
    assert plan.preempted_ids == ("c",)
    assert plan.finished_ids == ("c",)
    assert c.status is SchedulingState.WAITING
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert scheduler.block_table("c") == ()
    assert scheduler.num_preemptions == 1
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1
    assert allocator.num_free_blocks == 0
    scheduler.check_invariants()
    run_plan(scheduler, runner, plan)
    c_tokens_at_preemption = tuple(c.token_ids)
    assert len(c_tokens_at_preemption) == 5  # prompt and its first output

    # b's decode at position 8 needs a block; b is now the newest, so it preempts
    # itself, and no waiting request is admitted in a step that preempted.
    plan = scheduler.schedule()
    assert chunk_summary(plan) == [("a", 5, 1, (0, 3), True)]
    assert plan.preempted_ids == ("b",)
    assert b.status is SchedulingState.WAITING and b.num_computed_tokens == 0
    assert allocator.num_free_blocks == 2
    assert scheduler.num_preemptions == 2
    scheduler.check_invariants()
    run_plan(scheduler, runner, plan)
    b_tokens_at_preemption = tuple(b.token_ids)

    plans = drain(scheduler, runner, max_steps=40)
    b_chunks = [chunk for p in plans for chunk in p.chunks if chunk.request_id == "b"]
    c_chunks = [chunk for p in plans for chunk in p.chunks if chunk.request_id == "c"]
    # The most recently preempted went to the front: b is readmitted before c.
    first_step: dict[str, int] = {}
    for index, p in enumerate(plans):
        for chunk in p.chunks:
            first_step.setdefault(chunk.request_id, index)
    assert first_step["b"] < first_step["c"]
    # Each recomputes from position 0: prompt and outputs so far, then samples on.
    assert b_chunks[0].start_position == 0 and b_chunks[0].token_ids == b_tokens_at_preemption
    assert b_chunks[0].sample
    assert c_chunks[0].start_position == 0 and c_chunks[0].token_ids == c_tokens_at_preemption
    assert c_chunks[0].sample
    for request in (a, b, c):
        assert request.finish_reason is FinishReason.LENGTH
        assert request.output_ids == reference_output(request.prompt_ids, request.params.max_tokens)
    assert allocator.free_kv_bytes == allocator.total_kv_bytes


def test_no_admission_in_a_step_that_preempted() -> None:
    # Small budget, so a preempted request's first chunk would fit the blocks it freed.
    scheduler, allocator = make_scheduler(num_blocks=3, budget=2, max_num_seqs=2)
    runner = FakeRunner(scheduler.config)
    old = make_request("old", 2, max_tokens=10)
    new = make_request("new", 6, max_tokens=2)
    scheduler.add_request(old)
    scheduler.add_request(new)

    summaries = [chunk_summary(step(scheduler, runner)) for _ in range(5)]
    assert summaries == [
        [("old", 0, 2, (0,), True)],
        [("old", 2, 1, (0,), True), ("new", 0, 1, (1,), False)],
        [("old", 3, 1, (0,), True), ("new", 1, 1, (1,), False)],
        [("old", 4, 1, (0, 2), True), ("new", 2, 1, (1,), False)],
        [("old", 5, 1, (0, 2), True), ("new", 3, 1, (1,), False)],
    ]
    # new's position 4 needs a second block: it preempts itself. Its block is free
    # again and its one-token chunk would fit, but it is not readmitted this step.
    plan = scheduler.schedule()
    assert chunk_summary(plan) == [("old", 6, 1, (0, 2), True)]
    assert plan.preempted_ids == ("new",)
    assert allocator.num_free_blocks == 1
    run_plan(scheduler, runner, plan)

    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("old", 7, 1, (0, 2), True), ("new", 0, 1, (1,), False)]
    drain(scheduler, runner, max_steps=40)
    assert new.output_ids == reference_output(new.prompt_ids, 2)
    assert old.output_ids == reference_output(old.prompt_ids, 10)


def test_finish_request_frees_blocks_now_and_reports_next_plan() -> None:
    scheduler, allocator = make_scheduler(num_blocks=8)
    runner = FakeRunner(scheduler.config)
    request = make_request("r", 5, max_tokens=4)
    scheduler.add_request(request)
    step(scheduler, runner)
    assert allocator.num_free_blocks == 6

    assert scheduler.finish_request("r", FinishReason.STOP) is request
    assert allocator.num_free_blocks == 8
    assert allocator.free_kv_bytes == allocator.total_kv_bytes
    assert request.status is SchedulingState.FINISHED and request.finish_reason is FinishReason.STOP
    assert scheduler.get_request("r") is None
    assert scheduler.block_table("r") == ()
    assert not scheduler.has_unfinished
    assert scheduler.finish_request("r", FinishReason.STOP) is None
    assert scheduler.finish_request("nobody", FinishReason.CANCELLED) is None
    scheduler.check_invariants()

    plan = scheduler.schedule()
    assert plan.is_empty and plan.finished_ids == ("r",)
    assert scheduler.schedule().finished_ids == ()


def test_abort_of_a_waiting_request() -> None:
    scheduler, allocator = make_scheduler(num_blocks=8, max_num_seqs=1)
    runner = FakeRunner(scheduler.config)
    running = make_request("running", 4, max_tokens=3)
    waiting = make_request("waiting", 4, max_tokens=3)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler, runner)
    assert scheduler.num_waiting == 1
    free_before = allocator.num_free_blocks

    assert scheduler.finish_request("waiting", FinishReason.CANCELLED) is waiting
    assert waiting.status is SchedulingState.FINISHED and waiting.finish_reason is FinishReason.CANCELLED
    assert scheduler.num_waiting == 0 and allocator.num_free_blocks == free_before
    scheduler.check_invariants()

    plan = step(scheduler, runner)
    assert plan.finished_ids == ("waiting",)
    assert [c.request_id for c in plan.chunks] == ["running"]
    drain(scheduler, runner, max_steps=5)
    assert waiting.output_ids == []


def test_commit_skips_requests_aborted_after_schedule() -> None:
    scheduler, allocator = make_scheduler(num_blocks=8)
    runner = FakeRunner(scheduler.config)
    keep = make_request("keep", 4)
    gone = make_request("gone", 4)
    scheduler.add_request(keep)
    scheduler.add_request(gone)
    plan = scheduler.schedule()
    sampled = runner.execute(plan)
    scheduler.finish_request("gone", FinishReason.CANCELLED)
    scheduler.commit(plan, sampled)
    assert keep.num_computed_tokens == 4 and keep.num_output_tokens == 1
    assert gone.num_computed_tokens == 0 and gone.num_output_tokens == 0
    assert allocator.num_free_blocks == 7
    scheduler.check_invariants()


def test_duplicate_request_id_is_refused() -> None:
    scheduler, _ = make_scheduler(num_blocks=8)
    scheduler.add_request(make_request("r", 4))
    with pytest.raises(DuplicateRequestError):
        scheduler.add_request(make_request("r", 4))
    assert scheduler.num_waiting == 1


def test_tiny_pool_preempts_and_every_output_matches_the_reference() -> None:
    scheduler, allocator = make_scheduler(num_blocks=5, budget=8, max_num_seqs=4)
    runner = FakeRunner(scheduler.config)
    requests = [make_request(f"r{i}", 2 + (5 * i) % 9, max_tokens=3 + (3 * i) % 8) for i in range(10)]
    for request in requests:
        scheduler.add_request(request)
    drain(scheduler, runner, max_steps=sum(r.max_num_tokens for r in requests) + 1)
    assert scheduler.num_preemptions > 0
    for request in requests:
        assert request.output_ids == reference_output(request.prompt_ids, request.params.max_tokens)
    assert allocator.free_kv_bytes == allocator.total_kv_bytes


# -- random sequences --------------------------------------------------------------


@dataclass
class Harness:
    """The engine's side of the contract, with the bookkeeping the checks need."""

    scheduler: Scheduler
    allocator: BlockAllocator
    runner: FakeRunner
    requests: list[Request] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)

    def check(self) -> None:
        self.scheduler.check_invariants()
        self.allocator.check_invariants()

    def add(self, prompt_len: int, max_tokens: int) -> None:
        request = make_request(f"r{len(self.requests)}", prompt_len, max_tokens)
        self.requests.append(request)
        self.scheduler.add_request(request)

    def abort(self, index: int) -> None:
        if self.requests:
            request = self.requests[index % len(self.requests)]
            if self.scheduler.finish_request(request.request_id, FinishReason.CANCELLED) is not None:
                self.aborted.add(request.request_id)

    def step(self, abort_index: int | None = None) -> None:
        plan = self.scheduler.schedule()
        self.check()
        sampled = self.runner.execute(plan)
        if abort_index is not None:
            self.abort(abort_index)  # between the runner and commit, as a cancel can land
            self.check()
        self.scheduler.commit(plan, sampled)
        finish_long_enough(self.scheduler, plan)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Harness, list[tuple[str, int, int]]]:
    block_size = draw(st.integers(min_value=1, max_value=4))
    num_blocks = draw(st.integers(min_value=1, max_value=10))
    config = SchedulerConfig(
        max_model_len=num_blocks * block_size,
        block_size=block_size,
        max_num_seqs=draw(st.integers(min_value=1, max_value=6)),
        max_num_batched_tokens=draw(st.integers(min_value=1, max_value=16)),
        enable_prefix_caching=False,  # this fake runner forgets a request's KV when it leaves
    )
    allocator = BlockAllocator(num_blocks=num_blocks, block_bytes=BLOCK_BYTES)
    harness = Harness(Scheduler(config, allocator), allocator, FakeRunner(config))
    capacity = num_blocks * block_size  # tokens of KV the whole pool holds
    add = st.tuples(
        st.just("add"),
        st.integers(min_value=1, max_value=capacity),
        st.integers(min_value=1, max_value=capacity),
    )
    other = st.tuples(
        st.sampled_from(["step", "step", "step", "abort", "abort_mid_step"]),
        st.integers(min_value=0, max_value=30),
        st.just(0),
    )
    ops = draw(st.lists(st.one_of(add, add, other), min_size=4, max_size=50))
    return harness, ops


@given(scenarios())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_add_step_abort(scenario: tuple[Harness, list[tuple[str, int, int]]]) -> None:
    harness, ops = scenario
    capacity = harness.allocator.num_blocks * harness.scheduler.config.block_size
    for op, a, b in ops:
        if op == "add":
            # Only requests that fit the whole pool, as the engine guarantees:
            # prompt + max_tokens - 1 tokens of KV <= capacity.
            prompt_len, max_tokens = a, min(b, capacity - a + 1)
            harness.add(prompt_len, max_tokens)
        elif op == "step":
            harness.step()
        elif op == "abort":
            harness.abort(a)
        else:
            harness.step(abort_index=a)
        harness.check()

    # The oldest running request computes a token every step and is never preempted,
    # so this bound holds unless the scheduler deadlocks or livelocks.
    max_steps = sum(r.max_num_tokens for r in harness.requests if not r.is_finished) + 1
    for _ in range(max_steps):
        if not harness.scheduler.has_unfinished:
            break
        harness.step()
        harness.check()
    assert not harness.scheduler.has_unfinished, "requests left after the step bound"
    event(f"preempted: {harness.scheduler.num_preemptions > 0}")
    event(f"aborted: {bool(harness.aborted)}")

    for request in harness.requests:
        assert request.is_finished
        expected = reference_output(request.prompt_ids, request.params.max_tokens)
        if request.request_id in harness.aborted:
            assert request.finish_reason is FinishReason.CANCELLED
            assert request.output_ids == expected[: request.num_output_tokens]
        else:
            assert request.finish_reason is FinishReason.LENGTH
            assert request.output_ids == expected
    assert harness.allocator.num_used_blocks == 0
    assert harness.allocator.free_kv_bytes == harness.allocator.total_kv_bytes
    assert harness.scheduler.num_running == 0 and harness.scheduler.num_waiting == 0

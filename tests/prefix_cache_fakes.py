"""A fake runner for prefix-cache tests: KV slots that remember what they were computed from.

Real KV at position p is a function of every token at positions 0..p, so here a slot
holds exactly that tuple. A chunk reads the KV before its start position as it stood
before this step (KV another request writes in the same step is not there yet, as the
scheduler promises), writes its own tokens' KV, and samples from the context it read.
The context must equal the request's own tokens: a block served to the wrong request,
a block evicted under a reader, or a block read before it was written fails at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from tests.test_scheduler import finish_long_enough, next_token
from workers.engine.block_allocator import BlockAllocator
from workers.engine.config import SchedulerConfig, blocks_for_tokens
from workers.engine.plan import SampledToken, StepPlan
from workers.engine.scheduler import Scheduler

BLOCK_SIZE = 4
BLOCK_BYTES = 64


class ContentKVRunner:
    """Executes a plan against slots holding the context each KV entry was computed from."""

    def __init__(self, block_size: int, tokens_of: Callable[[str], Sequence[int]]) -> None:
        self.block_size = block_size
        self.tokens_of = tokens_of  # the request's known tokens, as the scheduler has them
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> tokens at positions 0..p
        self.num_computed_tokens = 0  # tokens of KV written, over all steps

    def slot(self, block_table: Sequence[int], position: int) -> int:
        #   block_size 4, block_table (7, 2):  position 5 -> block 2, offset 1 -> slot 9
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, plan: StepPlan) -> dict[str, int]:
        before = dict(self.kv)
        read: set[int] = set()
        written: set[int] = set()
        sampled: dict[str, int] = {}
        for chunk in plan.chunks:
            assert len(chunk.block_table) == blocks_for_tokens(chunk.context_len, self.block_size)
            truth = tuple(self.tokens_of(chunk.request_id))
            start = chunk.start_position
            assert chunk.token_ids == truth[start : chunk.context_len], f"{chunk.request_id}: wrong chunk tokens"
            for position in range(start):
                slot = self.slot(chunk.block_table, position)
                read.add(slot)
                assert before.get(slot) == truth[: position + 1], (
                    f"{chunk.request_id} position {position}: slot {slot} holds KV of {before.get(slot)}"
                )
            context = truth[:start]
            for token_id in chunk.token_ids:
                context += (token_id,)
                slot = self.slot(chunk.block_table, len(context) - 1)
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
                self.kv[slot] = context
            self.num_computed_tokens += chunk.num_tokens
            if chunk.sample:
                sampled[chunk.request_id] = next_token(context)
        assert not read & written, f"slots {sorted(read & written)} were overwritten while another request read them"
        return sampled

    def execute_engine(self, plan: StepPlan) -> Mapping[str, SampledToken]:
        """The same, as an LLMEngine Runner."""
        return {request_id: SampledToken(token_id) for request_id, token_id in self.execute(plan).items()}


class EngineRunner:
    """ContentKVRunner behind LLMEngine's Runner protocol (the engine owns the scheduler)."""

    def __init__(self, block_size: int) -> None:
        self.scheduler: Scheduler | None = None
        self.inner = ContentKVRunner(block_size, self._tokens_of)
        self.plans: list[StepPlan] = []

    def _tokens_of(self, request_id: str) -> Sequence[int]:
        assert self.scheduler is not None
        request = self.scheduler.get_request(request_id)
        assert request is not None, f"{request_id} scheduled but unknown"
        return request.token_ids

    def execute(self, plan: StepPlan) -> Mapping[str, SampledToken]:
        self.plans.append(plan)
        return self.inner.execute_engine(plan)


def make_scheduler(
    num_blocks: int,
    budget: int = 64,
    max_num_seqs: int = 8,
    block_size: int = BLOCK_SIZE,
    enable_prefix_caching: bool = True,
) -> tuple[Scheduler, BlockAllocator, ContentKVRunner]:
    config = SchedulerConfig(
        max_model_len=num_blocks * block_size,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=enable_prefix_caching,
    )
    allocator = BlockAllocator(num_blocks=num_blocks, block_bytes=BLOCK_BYTES)
    scheduler = Scheduler(config, allocator)

    def tokens_of(request_id: str) -> Sequence[int]:
        request = scheduler.get_request(request_id)
        assert request is not None, f"{request_id} scheduled but unknown"
        return request.token_ids

    return scheduler, allocator, ContentKVRunner(block_size, tokens_of)


def step(scheduler: Scheduler, runner: ContentKVRunner) -> StepPlan:
    """One engine step: schedule, run, commit, finish by length; invariants either side."""
    plan = scheduler.schedule()
    scheduler.check_invariants()
    scheduler.commit(plan, runner.execute(plan))
    finish_long_enough(scheduler, plan)
    scheduler.check_invariants()
    return plan


def drain(scheduler: Scheduler, runner: ContentKVRunner, max_steps: int = 200) -> list[StepPlan]:
    plans: list[StepPlan] = []
    while scheduler.has_unfinished:
        assert len(plans) < max_steps, f"not done after {max_steps} steps: deadlock or livelock"
        plans.append(step(scheduler, runner))
    return plans

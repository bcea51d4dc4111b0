"""Cached equals uncached on the real model code path: the tiny random preset through
LLMEngine and ModelRunner, with the prefix cache on and off, greedy and seeded sampling.

block_size 4, so short byte prompts share prefixes that end just before, on and just
after block edges; some prompts repeat an earlier one whole (a full-prompt hit, whose
last block is recomputed) or are a prefix of one.
"""

from __future__ import annotations

import pytest

from collections.abc import Mapping

from workers.engine.collect import PromptSpec, run_to_completion
from workers.engine.engine import LLMEngine, Runner
from workers.engine.plan import SampledToken, StepPlan
from workers.engine.sampling import SamplingParams
from workers.model.build import EngineArgs, create_engine, load
from workers.model.loader import LoadedModel

BLOCK_SIZE = 4
MAX_TOKENS = 16
BASE = tuple(b"Blocks of the paged KV cache are shared")  # 39 tokens
# Shared lengths around the edges at 4, 8 and 16, then whole and partial repeats.
PROMPTS = [
    BASE[:3] + tuple(b" first"),
    BASE[:4] + tuple(b" second"),
    BASE[:5] + tuple(b" third"),
    BASE[:7] + tuple(b"?"),
    BASE[:8] + tuple(b" fifth"),
    BASE[:9] + tuple(b"!"),
    BASE[:16] + tuple(b" seventh one"),
    BASE,
    BASE,  # the whole prompt again: every full block hits but the last is recomputed
    BASE[:12],  # a prefix of BASE, 3 full blocks: the last one recomputed
    BASE[:17],
]
PARAMS = {
    "greedy": [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)] * len(PROMPTS),
    "seeded": [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=500 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ],
}


class Recording:
    """The engine's runner, keeping every plan it ran."""

    def __init__(self, inner: Runner) -> None:
        self.inner = inner
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> Mapping[str, SampledToken]:
        self.plans.append(plan)
        return self.inner.execute(plan)


def num_rehits_after_preemption(plans: list[StepPlan]) -> int:
    """Readmissions of preempted requests that started past position 0 (a cache hit)."""
    preempted: set[str] = set()
    count = 0
    for plan in plans:
        for chunk in plan.chunks:
            if chunk.request_id in preempted:
                preempted.discard(chunk.request_id)
                count += chunk.start_position > 0
        preempted.update(plan.preempted_ids)
    return count


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load(EngineArgs(model="tiny", device="cpu"))


def make_engine(tiny: LoadedModel, caching: bool, num_blocks: int = 256, budget: int = 2048) -> LLMEngine:
    block_bytes = BLOCK_SIZE * tiny.config.kv_bytes_per_token(4)
    args = EngineArgs(
        model="tiny",
        device="cpu",
        block_size=BLOCK_SIZE,
        max_model_len=128,
        kv_cache_memory=num_blocks * block_bytes,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
    )
    engine = create_engine(args, tiny, quiet=True)
    assert engine.stats().num_total_blocks == num_blocks
    return engine


def outputs(engine: LLMEngine, waves: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Run each wave (indices into PROMPTS) to completion in turn, on one engine."""
    result: dict[int, list[int]] = {}
    for wave in waves:
        specs = [PromptSpec(PROMPTS[i], params[i], f"p{i}") for i in wave]
        for i, output in zip(wave, run_to_completion(engine, specs)):
            assert output.error is None
            result[i] = output.output_ids
    stats = engine.stats()
    assert stats.num_used_blocks == 0 and stats.free_kv_bytes == stats.total_kv_bytes
    return [result[i] for i in sorted(result)]


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_one_at_a_time_hits_and_equals_uncached(tiny: LoadedModel, name: str) -> None:
    """Each request after the first finds the blocks of those before it (evictable by then)."""
    waves = [[i] for i in range(len(PROMPTS))]
    cached = make_engine(tiny, caching=True)
    expected = outputs(make_engine(tiny, caching=False), waves, PARAMS[name])
    assert outputs(cached, waves, PARAMS[name]) == expected
    stats = cached.stats()
    # BASE: 9 blocks, all but the last hit by its repeat; 2 of BASE[:12]'s 3; and so on.
    assert stats.prefix_cache_hit_tokens >= (8 + 2 + 4) * BLOCK_SIZE
    assert stats.num_evictable_blocks > 0


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_concurrent_sharers_equal_uncached(tiny: LoadedModel, name: str) -> None:
    """All at once with a small token budget: admissions spread over steps, so a later one
    hits blocks an earlier one committed, while those admitted together compute their own."""
    waves = [list(range(len(PROMPTS))), list(range(len(PROMPTS)))]  # then everything again, warm
    cached = make_engine(tiny, caching=True, budget=24)
    expected = outputs(make_engine(tiny, caching=False, budget=24), waves, PARAMS[name])
    assert outputs(cached, waves, PARAMS[name]) == expected
    assert cached.stats().prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_preempted_requests_rehit_and_equal_uncached(tiny: LoadedModel, name: str) -> None:
    """A pool of 16 blocks: the longest request needs ceil((39 + 16 - 1) / 4) = 14 alone."""
    waves = [list(range(len(PROMPTS)))]
    cached = make_engine(tiny, caching=True, num_blocks=16)
    uncached = make_engine(tiny, caching=False, num_blocks=16)
    recording = cached.runner = Recording(cached.runner)
    assert outputs(cached, waves, PARAMS[name]) == outputs(uncached, waves, PARAMS[name])
    stats = cached.stats()
    assert stats.num_preemptions > 0 and uncached.stats().num_preemptions > 0
    assert num_rehits_after_preemption(recording.plans) > 0
    assert uncached.stats().prefix_cache_queried_tokens == 0

"""Decode steps from step graphs (workers/model/step_graphs.py), checked on CPU.

CPU has no graph recorder, so the runner's graphs here replay by running the recorded
function again (replay_capture) over the same static buffers a CUDA graph would read:
the bucketing, padding, pad slot, masks and output rows are what is checked, against an
engine that runs every step eagerly. The recording itself is checked by `make gpu-check`
on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from workers.engine.collect import PromptSpec, RequestOutput, run_to_completion
from workers.engine.engine import LLMEngine
from workers.engine.sampling import SamplingParams
from workers.model.build import EngineArgs, create_engine, kv_pool_size, load
from workers.model.loader import LoadedModel
from workers.model.runner import ModelRunner, StepGraphLimits
from workers.model.step_graphs import DecodeGraphs, bucket_of, buckets

# aten linears: the kernels a GPU runs the model with, and no native decoder to compare against.
ARGS = EngineArgs(model="tiny", device="cpu", kv_cache_memory=96 * 128 * 1024, max_model_len=256, max_num_seqs=12,
                  max_num_batched_tokens=64, linear_backend="aten")


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load(ARGS)


def _engines(tiny: LoadedModel, max_context: int = 256) -> tuple[LLMEngine, LLMEngine]:
    eager = create_engine(ARGS, tiny, quiet=True)
    pool = kv_pool_size(ARGS, tiny)
    runner = ModelRunner(tiny.model, tiny.config, pool.num_blocks, ARGS.block_size,
                         step_graphs=StepGraphLimits(ARGS.max_num_seqs, max_context))
    graphed = LLMEngine(runner, eager.config, pool, eager.limits, decoder=tiny.tokenizer, seed=ARGS.seed)
    return eager, graphed


def _workload(seed: int, n: int) -> list[PromptSpec]:
    rng = random.Random(seed)
    specs = []
    for index in range(n):
        # lengths straddling block edges (16), some past a 64-token chunk: mixed steps too
        length = rng.choice((1, 15, 16, 17, 31, 33, 70))
        prompt = tuple(rng.randrange(256) for _ in range(length))
        if index % 2:
            params = SamplingParams(max_tokens=rng.randrange(5, 40), temperature=0.0, ignore_eos=True, logprobs=2)
        else:
            params = SamplingParams(max_tokens=rng.randrange(5, 40), temperature=0.9, top_p=0.9, seed=index,
                                    ignore_eos=True)
        specs.append(PromptSpec(prompt, params))
    return specs


def _outputs(engine: LLMEngine, specs: list[PromptSpec]) -> list[tuple[tuple[int, ...], list[float]]]:
    outs: list[RequestOutput] = run_to_completion(engine, specs)
    return [(tuple(o.output_ids), [s.logprob for s in o.logprobs if s.logprob is not None]) for o in outs]


def _assert_same(graphed: LLMEngine, eager: LLMEngine, specs: list[PromptSpec]) -> None:
    """Token-identical; logprobs within 1e-4 nats: a padded step is a matmul of more rows,
    whose blocking may round the last bits of a row differently (seen: 1e-7)."""
    got, expected = _outputs(graphed, specs), _outputs(eager, specs)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert len(a) == len(b)
        assert all(abs(x - y) <= 1e-4 for x, y in zip(a, b)), (a, b)


def test_buckets_are_powers_of_two_up_to_the_limit() -> None:
    assert buckets(1) == (1,)
    assert buckets(12) == (1, 2, 4, 8, 12)
    assert buckets(16) == (1, 2, 4, 8, 16)
    assert bucket_of(5, buckets(12)) == 8
    assert bucket_of(9, buckets(12)) == 12
    assert bucket_of(13, buckets(12)) is None
    with pytest.raises(ValueError, match="limit"):
        buckets(0)


def test_graphed_decode_gives_what_eager_decode_gives(tiny: LoadedModel) -> None:
    """Greedy and seeded requests arriving together (batches of every bucket, padded
    rows among them): the same tokens and logprobs; and the graphs were what ran."""
    eager, graphed = _engines(tiny)
    specs = _workload(7, 23)
    _assert_same(graphed, eager, specs)
    graphs = graphed.runner.graphs  # type: ignore[attr-defined]
    assert isinstance(graphs, DecodeGraphs)
    assert graphs.num_graphs >= 4  # several (batch, context) buckets were used


def test_a_step_past_the_graphs_context_runs_eagerly_with_the_same_output(tiny: LoadedModel) -> None:
    eager, graphed = _engines(tiny, max_context=32)
    specs = [PromptSpec(tuple(range(40, 70)), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))]
    _assert_same(graphed, eager, specs)
    graphs = graphed.runner.graphs  # type: ignore[attr-defined]
    assert {blocks for _, blocks in graphs._graphs} == {2}  # contexts 31..32 in graphs, 33.. eager


def test_padding_rows_write_only_the_pad_block(tiny: LoadedModel) -> None:
    """Three requests in a batch bucket of 4: the fourth row's K/V goes to the spare
    block past the allocator's, and no block a request owns changes but its own slots."""
    _, graphed = _engines(tiny)
    runner = graphed.runner
    assert isinstance(runner, ModelRunner) and runner.graphs is not None
    pool = kv_pool_size(ARGS, tiny)
    assert runner.kv_pool.shape[3] == pool.num_blocks + 1
    torch.manual_seed(0)
    runner.kv_pool.normal_()
    before = runner.kv_pool.clone()
    starts, tables = [5, 20, 0], [[3], [7, 9], [11]]
    key = runner.graphs.key(3, 2)
    assert key == (4, 2)
    logits = runner.graphs.run(starts, [1, 2, 3], tables, key)
    assert logits.shape == (3, tiny.config.vocab_size)
    changed = (runner.kv_pool != before).any(dim=(0, 1, 2, 5))  # [blocks, block_size]: slots written
    written = {(b, s) for b, s in changed.nonzero().tolist()}
    bs = ARGS.block_size
    expected = {(3, 5), (9, 20 - bs), (11, 0)}
    assert written - {(pool.num_blocks, 0)} == expected
    assert (pool.num_blocks, 0) in written  # the padding row's K/V


def test_graphed_rows_do_not_depend_on_the_padding(tiny: LoadedModel) -> None:
    """A request's logits are the same in a step of 1 (bucket 1) and of 3 (bucket 4, one
    padding row), and the same whatever stale rows the static buffers held before."""
    _, graphed = _engines(tiny)
    graphs = graphed.runner.graphs  # type: ignore[attr-defined]
    alone = graphs.run([9], [42], [[4]], graphs.key(1, 1)).clone()
    graphs.run([15, 3, 8, 1, 0], [1, 2, 3, 4, 5], [[6], [7], [8], [10], [12]], graphs.key(5, 1))  # stale rows
    graphs.run([9], [42], [[4]], graphs.key(1, 1))  # rewrite request 0's own slot as it was
    together = graphs.run([9, 2, 4], [42, 7, 8], [[4], [13], [14]], graphs.key(3, 1))
    torch.testing.assert_close(together[0], alone[0], rtol=1e-5, atol=1e-5)


def test_capture_at_start_up_records_every_bucket_largest_first(tiny: LoadedModel) -> None:
    """What create_engine does on CUDA, replayed here: every (batch, context) bucket is
    recorded before the first step, the largest first, and serving adds none."""
    eager, graphed = _engines(tiny, max_context=64)
    runner = graphed.runner
    assert isinstance(runner, ModelRunner) and runner.graphs is not None
    assert runner.capture_graphs() == len(buckets(ARGS.max_num_seqs)) * len(buckets(64 // ARGS.block_size)) == 15
    assert next(iter(runner.graphs._graphs)) == (12, 4)
    specs = _workload(11, 9)
    _assert_same(graphed, eager, specs)
    assert runner.graphs.num_graphs == 15

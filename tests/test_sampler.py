"""The sampler: filters, seeds keyed on position, and the distribution it draws from."""

from __future__ import annotations

import math

import pytest
import torch

from workers.engine.plan import ScheduledChunk
from workers.engine.sampling import SamplingParams
from workers.model.sampler import sample_next_tokens, uniform_noise


def _chunk(params: SamplingParams, seed: int = 0, position: int = 10) -> ScheduledChunk:
    return ScheduledChunk("r", (1,), position - 1, (0,), True, params, seed)


def _logits(vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_noise_is_a_pure_function_of_seed_position_and_index() -> None:
    seeds = torch.tensor([1, 1, 2, 2**62 + 3])
    positions = torch.tensor([5, 6, 5, 5])
    u = uniform_noise(seeds, positions, 1000)
    assert u.shape == (4, 1000)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert torch.equal(u, uniform_noise(seeds, positions, 1000))
    assert torch.equal(u[1:2], uniform_noise(seeds[1:2], positions[1:2], 1000))  # batch-independent
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(float(u.mean()) - 0.5) < 0.02


def test_greedy_top_k_1_and_tiny_top_p_agree_with_argmax() -> None:
    logits = _logits()
    best = int(logits.argmax())
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
    ):
        for seed in range(5):
            assert sample_next_tokens(logits, [_chunk(params, seed)])[0].token_id == best


def test_a_temperature_below_the_greedy_bound_samples_greedily_even_where_float32_overflows() -> None:
    """A temperature the API accepts (>= 0) but that overflows float32 logits when divided
    by (1e-39, 1e-300, the smallest double) gave every token id 0 (an outside check, from a
    Node.js client); below GREEDY_BELOW_TEMPERATURE a request is greedy, as vLLM's and
    SGLang's are. At the bound itself it still samples, and stays at the argmax."""
    from workers.engine.sampling import GREEDY_BELOW_TEMPERATURE

    logits = _logits(vocab=300) * 20  # logits in the tens, as a model's are
    best = int(logits.argmax())
    for temperature in (5e-324, 1e-300, 1e-39, 1e-20, 1e-6):
        params = SamplingParams(temperature=temperature)
        assert params.greedy
        picked = [sample_next_tokens(logits, [_chunk(params, seed)])[0].token_id for seed in range(5)]
        assert picked == [best] * 5, temperature
    at_bound = SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE)
    assert not at_bound.greedy
    assert sample_next_tokens(logits, [_chunk(at_bound, 3)])[0].token_id == best


def test_top_k_restricts_the_choice_to_the_k_most_likely() -> None:
    logits = _logits()
    allowed = set(logits[0].topk(3).indices.tolist())
    params = SamplingParams(temperature=5.0, top_k=3)
    seen = {sample_next_tokens(logits, [_chunk(params, seed)])[0].token_id for seed in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_samples_follow_the_softmax_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    expected = logits.softmax(-1)[0].tolist()
    params = SamplingParams(temperature=1.0)
    n = 4000
    counts = [0] * 4
    for seed in range(n):
        counts[sample_next_tokens(logits, [_chunk(params, seed)])[0].token_id] += 1
    for count, p in zip(counts, expected):
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(count - n * p) < 5 * sigma


def test_a_row_samples_the_same_whatever_else_is_in_the_batch() -> None:
    logits = torch.cat([_logits(seed=1), _logits(seed=2), _logits(seed=3)])
    chunks = [
        _chunk(SamplingParams(temperature=0.8, top_p=0.9), seed=11, position=7),
        _chunk(SamplingParams(temperature=0.0), seed=0, position=3),
        _chunk(SamplingParams(temperature=1.5, top_k=10), seed=12, position=9),
    ]
    together = [t.token_id for t in sample_next_tokens(logits, chunks)]
    alone = [sample_next_tokens(logits[i : i + 1], [chunks[i]])[0].token_id for i in range(3)]
    assert together == alone


def test_logprobs_are_the_model_distribution_with_top_alternatives() -> None:
    logits = _logits()
    reference = logits.log_softmax(-1)[0]
    token = sample_next_tokens(logits, [_chunk(SamplingParams(temperature=0.0, logprobs=4))])[0]
    assert token.logprob is not None
    assert math.isclose(token.logprob, float(reference.max()), abs_tol=1e-6)
    assert [t.token_id for t in token.top_logprobs] == reference.topk(4).indices.tolist()
    assert token.top_logprobs[0].token_id == token.token_id
    plain = sample_next_tokens(logits, [_chunk(SamplingParams(temperature=0.0))])[0]
    assert plain.logprob is None and plain.top_logprobs == ()


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [
    (1.0, 3, 0.5), (1.3, 10, 0.9), (0.7, 5, 0.3), (1.0, 40, 0.95), (1.0, 0, 0.8), (1.0, 7, 1.0),
    (0.5, 100, 1.0), (0.7, 50, 0.9),
])  # fmt: skip
@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16-ties"])
def test_the_filtered_distribution_is_transformers(
    temperature: float, top_k: int, top_p: float, logit_dtype: torch.dtype
) -> None:
    """Temperature, then top-k, then top-p on what top-k kept (renormalized), as transformers'
    generate() and vLLM apply them. top_p's mass was taken on the whole distribution, so with
    both filters set kvserve kept tokens transformers drops (an outside check on the real
    model: k=3, p=0.5 sampled a third token, TV 0.32 from transformers' distribution). Ties
    at the k-th logit all stay (bf16 logits, rounded, tie often), and top_p 1 is no top-p
    (float32 sums reached 1.0 before the tail of a top_k and cut it): a second review."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from workers.model.sampler import _filtered_logprobs

    for seed in range(5):
        logits = (torch.randn(1, 4000, generator=torch.Generator().manual_seed(seed)) * 6).to(logit_dtype).float()
        warpers = [TemperatureLogitsWarper(temperature)]
        warpers += [TopKLogitsWarper(top_k)] if top_k else []
        warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
        reference = LogitsProcessorList(warpers)(None, logits.clone()).softmax(-1)[0]
        ours = _filtered_logprobs(logits, [_chunk(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))])
        ours = ours.exp()[0]
        assert torch.equal(ours > 0, reference > 0), (seed, int((ours > 0).sum()), int((reference > 0).sum()))
        assert torch.allclose(ours, reference, atol=1e-6), seed


def test_top_k_keeps_every_token_tied_at_the_kth_logit() -> None:
    """transformers' TopKLogitsWarper and vLLM drop only logits strictly below the k-th:
    tied tokens all stay. The rank cut kept exactly k, the tied ones chosen by the sort's
    order (a review's find); a bf16 model's logits tie often (k=50 of 32k: 52 kept)."""
    from transformers.generation.logits_process import TopKLogitsWarper

    from workers.model.sampler import _filtered_logprobs

    for logits, top_k in (
        (torch.tensor([[3.0, 1.0, 2.0, 1.0, 0.0, 1.0, -1.0, 0.5]]), 3),
        ((torch.randn(1, 32000, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16).float(), 50),
    ):
        reference = TopKLogitsWarper(top_k)(None, logits.clone()) > float("-inf")
        ours = _filtered_logprobs(logits, [_chunk(SamplingParams(temperature=1.0, top_k=top_k))]) > float("-inf")
        assert torch.equal(ours, reference), (top_k, int(ours.sum()), int(reference.sum()))

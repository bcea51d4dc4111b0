"""Turns the last logits of each sampled chunk into next tokens.

A seeded request's sample at position p depends only on (seed, p, logits): the random
numbers come from a counter-based hash of (seed, position, vocab index) computed with
integer tensor ops, so they are the same whatever else is in the batch, and on any
device. Sampling is the Gumbel-max trick in its exponential form:

    token = argmax_i  p_i / E_i,   E_i = -log(u_i),  u_i = hash(seed, p, i) in (0, 1)

which draws token i with probability p_i.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.plan import SampledToken, ScheduledChunk, TokenLogprob

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27, so a 32-bit value times it stays inside int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of 32-bit values held in int64 (no overflow: products < 2**59)."""
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u in (0, 1) for every (row, vocab index), a pure function of (seed, position, index).

    seeds, positions: [num_rows] int64, seeds in [0, 2**63). Returns [num_rows, vocab_size] float64.
    """
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    row = _mix32(lo ^ _mix32(hi ^ _mix32(positions & _MASK32)))  # [num_rows]
    index = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [vocab_size]
    bits = _mix32(row[:, None] ^ _mix32(index + 0x9E3779B9 & _MASK32)[None, :])  # [num_rows, vocab_size]
    return (bits.to(torch.float64) + 0.5) / 4294967296.0


def _filtered_logprobs(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
    """Temperature, top-k and top-p applied; returns log-probs with -inf outside the kept set.

    logits: [num_rows, vocab_size] float32 of rows that sample (temperature > 0).
    """
    device = logits.device
    temperature = torch.tensor([c.params.temperature for c in chunks], dtype=logits.dtype, device=device)
    scaled = logits / temperature[:, None]  # [num_rows, vocab_size]
    vocab_size = logits.shape[1]
    top_k = torch.tensor(
        [c.params.top_k if 0 < c.params.top_k < vocab_size else vocab_size for c in chunks], device=device
    )
    top_p = torch.tensor([c.params.top_p for c in chunks], dtype=logits.dtype, device=device)
    needs_filter = bool((top_k < vocab_size).any()) or bool((top_p < 1.0).any())
    if needs_filter:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [num_rows, vocab_size]
        # top_k keeps every logit at least the k-th's: tokens tied with the k-th all stay,
        # as in transformers and vLLM, not k chosen by the sort's order among ties (bf16
        # logits tie often: k=50 of 32k kept 50 where transformers keeps 52: a review).
        kth = sorted_logits.gather(1, (top_k - 1).clamp(min=0)[:, None])
        drop = sorted_logits < kth
        # top_p's mass is of what top_k kept, renormalized, as in transformers and vLLM: on
        # the whole distribution it kept more (k=3, p=0.5 sampled a third token transformers
        # drops, TV 0.32 from its distribution: an outside check).
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # strictly before it already reaches top_p. The first token is always kept.
        mass_before = probs.cumsum(dim=-1) - probs
        # top_p 1 is no top-p (float32 sums reach 1.0 before the tail of a top_k: it cut
        # 52 of 100 tokens: a review).
        drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    return scaled.log_softmax(dim=-1)


def sample_next_tokens(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> list[SampledToken]:
    """Sample one token per row. logits: [num_rows, vocab_size] float32, row i for chunks[i]."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    token_ids = logits.argmax(dim=-1)  # [num_rows] greedy choice, replaced below for sampled rows
    sampled_rows = [i for i, c in enumerate(chunks) if not c.params.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=device)
        row_chunks = [chunks[i] for i in sampled_rows]
        logprobs = _filtered_logprobs(logits[rows], row_chunks)  # [num_sampled, vocab_size]
        seeds = torch.tensor([c.seed for c in row_chunks], dtype=torch.int64, device=device)
        positions = torch.tensor([c.sample_position for c in row_chunks], dtype=torch.int64, device=device)
        noise = uniform_noise(seeds, positions, vocab_size)  # [num_sampled, vocab_size]
        # argmax p/E == argmax (log p - log E); float64 keeps ties out of the picture.
        score = logprobs.to(torch.float64) - torch.log(-torch.log(noise))
        token_ids[rows] = score.argmax(dim=-1)

    want = [c.params.logprobs for c in chunks]
    if all(n is None for n in want):
        return [SampledToken(int(t)) for t in token_ids.tolist()]
    raw_logprobs = logits.log_softmax(dim=-1)  # [num_rows, vocab_size], the model's own distribution
    chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    max_n = max(n for n in want if n is not None)
    top_values, top_ids = raw_logprobs.topk(max_n, dim=-1) if max_n > 0 else (None, None)
    results: list[SampledToken] = []
    for i, token_id in enumerate(token_ids.tolist()):
        n = want[i]
        if n is None:
            results.append(SampledToken(int(token_id)))
            continue
        top: tuple[TokenLogprob, ...] = ()
        if n > 0 and top_values is not None and top_ids is not None:
            top = tuple(
                TokenLogprob(int(t), float(v)) for t, v in zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist())
            )
        results.append(SampledToken(int(token_id), float(chosen[i]), top))
    return results

"""The seed chapter's request trace: Poisson arrivals, prompts 32-96 tokens, outputs 16-48."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_time: float  # seconds from the start of the trace
    prompt_ids: tuple[int, ...]
    output_len: int


def poisson_trace(
    num_requests: int,
    rate: float,
    seed: int = 7,
    prompt_len: tuple[int, int] = (32, 96),
    output_len: tuple[int, int] = (16, 48),
    vocab_size: int = 256,
) -> list[TraceRequest]:
    """Requests with exponential inter-arrival gaps at `rate` per second.

    Lengths and token ids come from one seeded generator and do not depend on the rate,
    so every rate replays the same requests, only closer together or further apart.
    rate=math.inf puts every arrival at t=0 (a saturating burst).
    """
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    shapes = random.Random(seed)
    gaps = random.Random(seed + 1)
    clock = 0.0
    trace = []
    for index in range(num_requests):
        n_prompt = shapes.randint(*prompt_len)
        prompt = tuple(shapes.randrange(vocab_size) for _ in range(n_prompt))
        n_out = shapes.randint(*output_len)
        trace.append(TraceRequest(f"trace-{index}", clock, prompt, n_out))
        if math.isfinite(rate):
            clock += gaps.expovariate(1.0) / rate
    return trace

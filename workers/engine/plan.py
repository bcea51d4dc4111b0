"""The values that cross between scheduler, model runner and engine in one step.

A step is a frozen StepPlan (what runs) going into the runner and a mapping of sampled
tokens coming out. The runner executes the plan and knows nothing about scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.request import FinishReason
from workers.engine.sampling import SamplingParams


@dataclass(frozen=True)
class ScheduledChunk:
    """The new tokens of one request that this step computes KV for.

    Positions are explicit: token_ids[i] sits at position start_position + i. The block
    table covers every position in [0, start_position + len(token_ids)):

        block_table = (7, 2, 9), block_size = 4
        positions:   0 1 2 3 | 4 5 6 7 | 8 9 ..
        block:          7    |    2    |   9
        slot(pos) = block_table[pos // block_size] * block_size + pos % block_size

    When sample is True the chunk reaches the end of the known sequence, and the runner
    samples the token at position start_position + len(token_ids) from the last logits.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    sample: bool
    params: SamplingParams
    seed: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens of KV this request has once the chunk is written."""
        return self.start_position + len(self.token_ids)

    @property
    def sample_position(self) -> int:
        """Position of the token sampled from this chunk's last logits."""
        return self.context_len


@dataclass(frozen=True)
class StepPlan:
    """What runs in one engine step.

    finished_ids names requests that left since the last plan (finished, aborted or
    preempted), so a runner that keeps per-request state can drop it.
    """

    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...] = ()
    finished_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class TokenLogprob:
    """A token with its log-probability under the model's raw distribution."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class SampledToken:
    """What the runner returns for one chunk with sample=True."""

    token_id: int
    logprob: float | None = None  # set when the request asked for logprobs
    top_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """New output of one request in one step: the unit the engine emits.

    offset is the index in the request's output of token_ids[0]. A finished request's
    last event carries its finish reason (and, for ERROR, a message).
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    offset: int
    logprobs: tuple[SampledToken, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Prompt tokens whose KV came from the prefix cache at the request's first admission
    # here (Usage.cached_prompt_tokens); the same on every event of the request.
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

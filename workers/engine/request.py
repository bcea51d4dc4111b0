"""A request as the engine core sees it: its tokens, its progress and its outcome."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from workers.engine.sampling import SamplingParams


class SchedulingState(enum.Enum):
    """Where the scheduler has a request; its lifecycle (queued at the router, cancelled,
    failed) is the router's router.records.RequestStatus, a different concept."""

    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class Resume:
    """Where a request goes on from when it moves to another engine (its worker died, or a
    router adopted it): the output it already produced, which is prefilled here as context,
    and how many characters of its text the client already has.

    With the sampler keyed on (seed, position), the continuation equals the uninterrupted
    run for greedy and for seeded requests.
    """

    output_ids: tuple[int, ...]
    num_text_chars: int = 0


@dataclass
class Request:
    """One generation. The scheduler advances num_computed_tokens; the engine appends outputs.

    token_ids is prompt then output: [p0 p1 ... p(n-1) | o0 o1 ...]. Tokens before
    num_computed_tokens have their KV in the cache; the rest are scheduled next.

    cache_salt: an extra key of every block hash, so requests with different salts (other
    tenants) never share KV. num_cached_tokens: tokens whose KV came from the prefix cache
    when the request was first admitted (readmissions after preemption do not change it);
    for a resumed request they can reach into its resumed output.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int  # the params' seed, or one the engine chose
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SchedulingState = SchedulingState.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    cache_salt: str | None = None
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_cached_prompt_tokens(self) -> int:
        """Prompt tokens served from the prefix cache at first admission (Usage's cached_prompt_tokens)."""
        return min(self.num_cached_tokens, len(self.prompt_ids))

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def max_num_tokens(self) -> int:
        """The longest this request can grow: prompt plus max_tokens."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def max_kv_tokens(self) -> int:
        """Tokens whose KV this request can ever hold: the last sampled token is never fed back."""
        return self.max_num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SchedulingState.FINISHED

"""Per-request sampling parameters, validated at the boundary."""

from __future__ import annotations

import math
from dataclasses import dataclass

from workers.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
# A temperature below this samples greedily, as in vLLM and SGLang (their _SAMPLING_EPS):
# the softmax at such a temperature is one-hot at the argmax anyway, and dividing float32
# logits by a much smaller one overflows (at 1e-39 every logit became inf, the log-probs
# NaN, and every token id 0: an outside check's find).
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy. top_k 0 and top_p 1
    disable those filters. A request's sample at output position p depends only on (seed,
    p, logits); the engine gives an unseeded request a seed of its own when it is added,
    so it is reproducible too.
    logprobs None returns none; n >= 0 returns the sampled token's logprob and the n
    most likely alternatives.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _require_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        _require_number("temperature", self.temperature)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        _require_number("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _require_int("top_k", self.top_k)
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None:
            _require_int("seed", self.seed)
            if not (0 <= self.seed < 2**63):
                raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop", "must be a tuple of strings")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must not be empty")
        if not isinstance(self.stop_token_ids, tuple):
            raise InvalidRequestError("stop_token_ids", "must be a tuple of ints")
        for token_id in self.stop_token_ids:
            _require_int("stop_token_ids", token_id)
            if token_id < 0:
                raise InvalidRequestError("stop_token_ids", f"token ids must be >= 0, got {token_id}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs)
            if not (0 <= self.logprobs <= MAX_LOGPROBS):
                raise InvalidRequestError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _require_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(field, f"must be an integer, got {value!r}")


def _require_number(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(field, f"must be a number, got {value!r}")

"""The engine: validation, scheduling, running and output processing, one step at a time.

This is the interface the Ray actor wraps: add a request, run one step (which returns
the token events of every request in it together), abort, and stats. It imports no
torch: the model runner and the tokenizer are handed in.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from workers.engine.block_allocator import BlockAllocator
from workers.engine.block_hash import BlockHash
from workers.engine.cache_events import CacheEvent
from workers.engine.config import SchedulerConfig, blocks_for_tokens
from workers.engine.detokenizer import Decoder, IncrementalDetokenizer
from workers.engine.errors import DuplicateRequestError, InvalidRequestError, RequestTooLargeError
from workers.engine.plan import SampledToken, StepPlan, TokenEvent
from workers.engine.request import FinishReason, Request, Resume
from workers.engine.sampling import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.stats import EngineStats


class Runner(Protocol):
    """Executes a plan; returns the sampled token of every chunk with sample=True."""

    def execute(self, plan: StepPlan) -> Mapping[str, SampledToken]: ...


@dataclass(frozen=True)
class ModelLimits:
    """What the engine must know about the model to validate requests."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVPool:
    """The KV pool the runner allocated: found at run time, passed on, never written to config."""

    num_blocks: int
    block_bytes: int


class _OutputState:
    """Per-request output processing: detokenization and finish checks."""

    def __init__(self, request: Request, decoder: Decoder | None, resume: Resume | None = None) -> None:
        self.detokenizer = (
            IncrementalDetokenizer(decoder, request.prompt_ids, request.params.stop) if decoder is not None else None
        )
        if self.detokenizer is not None and resume is not None:
            # Replay the output it had, so the text goes on where the client's text ends.
            for token_id in resume.output_ids:
                self.detokenizer.push(token_id)
            self.detokenizer.skip_emitted(resume.num_text_chars)


class LLMEngine:
    """Continuous batching over a paged KV cache, driven one step() at a time."""

    def __init__(
        self,
        runner: Runner,
        config: SchedulerConfig,
        pool: KVPool,
        limits: ModelLimits,
        decoder: Decoder | None = None,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.max_model_len > limits.max_model_len:
            raise ValueError(
                f"SchedulerConfig.max_model_len {config.max_model_len} exceeds the model's {limits.max_model_len}"
            )
        self.runner = runner
        self.config = config
        self.limits = limits
        self.allocator = BlockAllocator(pool.num_blocks, pool.block_bytes)
        self.scheduler = Scheduler(config, self.allocator)
        self._decoder = decoder
        self._rng = random.Random(seed)
        self._clock = clock
        self._outputs: dict[str, _OutputState] = {}
        self._eos = frozenset(limits.eos_token_ids)
        self._num_steps = 0
        self._need_blocks: dict[str, int] = {}  # unfinished request_id -> blocks committed (reserve_tokens)

    # -- requests -------------------------------------------------------------------

    def validate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError naming the field if this request can never run here."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if request_id in self._outputs:
            raise DuplicateRequestError("request_id", f"request {request_id!r} is already in the engine")
        if len(prompt_ids) == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.limits.vocab_size
        for index, token_id in enumerate(prompt_ids):
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab:
                raise InvalidRequestError(
                    "prompt_ids", f"token id {token_id!r} at index {index} is outside the vocabulary [0, {vocab})"
                )
        for token_id in params.stop_token_ids:
            if token_id >= vocab:
                raise InvalidRequestError("stop_token_ids", f"token id {token_id} is outside the vocabulary [0, {vocab})")
        max_len = self.config.max_model_len
        if len(prompt_ids) > max_len:
            raise RequestTooLargeError("prompt", f"{len(prompt_ids)} tokens exceed max_model_len {max_len}")
        if len(prompt_ids) + params.max_tokens > max_len:
            raise RequestTooLargeError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds max_model_len {max_len}",
            )
        need = self.blocks_needed(len(prompt_ids), params.max_tokens)
        if need > self.allocator.num_blocks:
            raise RequestTooLargeError(
                "max_tokens",
                f"prompt plus max_tokens needs {need} KV blocks; the whole pool has {self.allocator.num_blocks}",
            )

    def _validate_resume(self, resume: Resume, params: SamplingParams) -> None:
        if len(resume.output_ids) >= params.max_tokens:
            raise InvalidRequestError(
                "resume.output_ids",
                f"{len(resume.output_ids)} tokens already reach max_tokens {params.max_tokens}: nothing to resume",
            )
        vocab = self.limits.vocab_size
        for index, token_id in enumerate(resume.output_ids):
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab:
                raise InvalidRequestError(
                    "resume.output_ids", f"token id {token_id!r} at index {index} is outside the vocabulary [0, {vocab})"
                )
        if resume.num_text_chars < 0:
            raise InvalidRequestError("resume.num_text_chars", f"must be >= 0, got {resume.num_text_chars}")

    @staticmethod
    def _validate_cache_salt(cache_salt: str | None) -> None:
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt", f"must be a non-empty string when given, got {cache_salt!r}")

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """KV blocks a request holds at its longest; the last sampled token is never fed back."""
        return blocks_for_tokens(num_prompt_tokens + max_tokens - 1, self.config.block_size)

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        resume: Resume | None = None,
        cache_salt: str | None = None,
        reserve_tokens: int | None = None,
    ) -> Request:
        """Validate and queue a request. Raises InvalidRequestError; a refused request costs no KV.

        With `resume`, the request goes on from output it produced elsewhere: that output is
        prefilled with the prompt, and events continue at offset len(resume.output_ids).
        With `cache_salt`, it shares prefix-cache blocks only with requests of the same salt.
        With `reserve_tokens`, its commitment (num_committed_blocks) counts that many output
        tokens rather than max_tokens; growing past them, it holds what it holds.
        """
        params = params if params is not None else SamplingParams()
        self.validate(request_id, prompt_ids, params)
        if resume is not None:
            self._validate_resume(resume, params)
        self._validate_cache_salt(cache_salt)
        if reserve_tokens is None:
            reserve_tokens = params.max_tokens
        elif isinstance(reserve_tokens, bool) or not isinstance(reserve_tokens, int) or not (
                1 <= reserve_tokens <= params.max_tokens):
            raise InvalidRequestError("reserve_tokens", f"must be in [1, max_tokens={params.max_tokens}], "
                                                        f"got {reserve_tokens!r}")
        seed = params.seed if params.seed is not None else self._rng.randrange(2**63)
        output_ids = resume.output_ids if resume is not None else ()
        request = Request(
            request_id=request_id,
            prompt_ids=tuple(prompt_ids),
            params=params,
            seed=seed,
            arrival_time=self._clock() if arrival_time is None else arrival_time,
            token_ids=[*prompt_ids, *output_ids],
            cache_salt=cache_salt,
        )
        self._outputs[request_id] = _OutputState(request, self._decoder, resume)
        self.scheduler.add_request(request)
        self._need_blocks[request_id] = self.blocks_needed(len(prompt_ids), reserve_tokens)
        return request

    def abort(self, request_id: str) -> TokenEvent | None:
        """Cancel a request; its blocks are free when this returns. Unknown id: None."""
        return self._finish(request_id, FinishReason.CANCELLED)

    # -- stepping -------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[TokenEvent]:
        """Schedule, run the model once, and return this step's token events for all requests."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if plan.finished_ids:
                self.runner.execute(plan)  # lets a runner with per-request state drop it
            return []
        self._num_steps += 1
        try:
            sampled = self.runner.execute(plan)
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its requests, not the engine
            return self._fail_plan(plan, exc)
        self.scheduler.commit(plan, {request_id: s.token_id for request_id, s in sampled.items()})
        events: list[TokenEvent] = []
        for request_id, token in sampled.items():
            event = self._process_token(request_id, token)
            if event is not None:
                events.append(event)
        return events

    def _process_token(self, request_id: str, token: SampledToken) -> TokenEvent | None:
        request = self.scheduler.get_request(request_id)
        state = self._outputs.get(request_id)
        if request is None or state is None:
            return None
        params = request.params
        reason: FinishReason | None = None
        detokenizer = state.detokenizer
        if detokenizer is not None:
            detokenizer.push(token.token_id)
        if token.token_id in params.stop_token_ids:
            reason = FinishReason.STOP
        elif token.token_id in self._eos and not params.ignore_eos:
            reason = FinishReason.EOS
        elif detokenizer is not None and detokenizer.stopped:
            reason = FinishReason.STOP
        elif request.num_output_tokens >= params.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish_request(request_id, reason)
            del self._outputs[request_id]
            self._need_blocks.pop(request_id, None)
            if detokenizer is not None:
                detokenizer.finish()
        text = detokenizer.take_delta(final=reason is not None) if detokenizer is not None else ""
        return TokenEvent(
            request_id=request_id,
            token_ids=(token.token_id,),
            text=text,
            offset=request.num_output_tokens - 1,
            logprobs=(token,) if params.logprobs is not None else (),
            finish_reason=reason,
            num_cached_tokens=request.num_cached_prompt_tokens,
        )

    def _finish(self, request_id: str, reason: FinishReason, error: str | None = None) -> TokenEvent | None:
        state = self._outputs.pop(request_id, None)
        request = self.scheduler.finish_request(request_id, reason)
        if request is None:
            return None
        self._need_blocks.pop(request_id, None)
        text = ""
        if state is not None and state.detokenizer is not None:
            state.detokenizer.finish()
            text = state.detokenizer.take_delta(final=True)
        return TokenEvent(
            request_id, (), text, request.num_output_tokens, finish_reason=reason, error=error,
            num_cached_tokens=request.num_cached_prompt_tokens,
        )

    def _fail_plan(self, plan: StepPlan, exc: Exception) -> list[TokenEvent]:
        message = f"model runner failed: {type(exc).__name__}: {exc}"
        events = [self._finish(c.request_id, FinishReason.ERROR, message) for c in plan.chunks]
        return [e for e in events if e is not None]

    # -- the prefix cache, for the router's index ----------------------------------------

    def drain_kv_events(self) -> list[CacheEvent]:
        """The prefix cache's changes since the last call, (stored, block_hash) oldest
        first, and forget them (see workers/engine/cache_events.py). Replayed onto
        cached_block_hashes() as it was at the last call, they give it as it is now.
        Always empty with prefix caching off."""
        return self.allocator.drain_events()

    def cached_block_hashes(self) -> tuple[BlockHash, ...]:
        """Every block hash the prefix cache can hit now."""
        return self.allocator.cached_hashes()

    # -- stats ----------------------------------------------------------------------

    def num_committed_blocks(self) -> int:
        """EngineStats.num_committed_blocks: held blocks, each once, plus every unfinished
        request's growth to its reserve_tokens (max_tokens unless told), less the cached
        blocks waiting requests would share.
        O(unfinished requests + the waiting ones' cached prefix blocks)."""
        growth = 0
        for request_id, need in self._need_blocks.items():
            num_held = self.scheduler.num_table_blocks(request_id)
            if need > num_held:
                growth += need - num_held
        return self.allocator.num_used_blocks + growth - self.scheduler.num_shared_waiting_blocks()

    def stats(self) -> EngineStats:
        a = self.allocator
        counters = self.scheduler.prefix_cache_counters
        return EngineStats(
            num_total_blocks=a.num_blocks,
            num_free_blocks=a.num_free_blocks,
            num_evictable_blocks=a.num_evictable_blocks,
            num_used_blocks=a.num_used_blocks,
            block_size=self.config.block_size,
            block_bytes=a.block_bytes,
            free_kv_bytes=a.free_kv_bytes,
            total_kv_bytes=a.total_kv_bytes,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            num_committed_blocks=self.num_committed_blocks(),
            prefix_cache_queried_tokens=counters.num_queried_tokens,
            prefix_cache_hit_tokens=counters.num_hit_tokens,
        )

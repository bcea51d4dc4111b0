"""One request's live state inside a router: where it runs, what it produced, who listens."""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any

from workers.engine.block_hash import BlockHash
from workers.engine.plan import SampledToken, TokenEvent
from workers.engine.request import FinishReason
from workers.engine.sampling import SamplingParams

DEFAULT_MAX_PENDING_TOKENS = 4096  # a client's output not yet taken, beyond which its call ends
_TEXT_PARTS = 64  # text deltas a pending delta keeps apart before it joins them


@dataclass
class RequestTracker:
    """Created when a request is accepted; forgotten once it has finished and been recorded.

    Each client attached here has a Listener: the events it has not taken yet, merged and
    bounded. Events are published before their Redis write lands, so a Stream that
    re-attaches reads Redis only up to the listener's `start_offset` (what was published
    before it subscribed) and takes the rest from the listener.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    need_blocks: int  # at its longest: prompt and max_tokens
    block_hashes: tuple[BlockHash, ...] = ()  # its prompt's full blocks, for the prefix index
    cache_salt: str | None = None  # GenerateRequest.cache_salt: the worker hashes its blocks with it
    created_at: float = field(default_factory=time.time)
    worker_id: str = ""
    first_token_at: float = 0.0
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Times it moved to another worker (a migration, or an adoption by a restarted router);
    # its current placement is known to its worker as engine_key(request_id, num_migrations).
    num_migrations: int = 0
    # What it produced so far, which a move to another worker resumes from.
    output_ids: list[int] = field(default_factory=list)
    num_text_chars: int = 0
    # Prompt tokens its current placement found in the worker's prefix cache.
    num_cached_tokens: int = 0
    # The output tokens its current placement committed KV for (Router._commitment):
    # None, all of max_tokens.
    reserve_tokens: int | None = None
    # Times this router sent it to a worker (a first placement, a place after a refusal or a
    # worker's death).
    num_placements: int = 0
    # Unix time of the placement the first worker that took it accepted (0.0: none yet): the
    # queue-time metric ends there, not at a placement a worker refused. Kept in Redis, so
    # an adopter knows.
    accepted_at: float = 0.0
    cancel_requested: bool = False
    # Why the router, not a client, cancelled it (a drain's end): its finish's error.
    cancel_reason: str | None = None
    # Its worker ended it (an event with a finish came from there), not this router: the
    # worker holds nothing of it any more.
    ended_on_worker: bool = False
    listeners: list[Listener] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Its Redis create, made while it is placed (Router.create with wait=False; awaited by
    # Router.recorded); None when the create came first.
    creating: asyncio.Future[Any] | None = None
    # Another router serves it now (hand_over): this router writes nothing more of it.
    handed_over: bool = False
    # The recorder's write of its end, once it has ended (TokenFlow.apply): a client is told
    # `finished` once Redis holds the end (service._live), so GetRequest answers it then.
    end_recorded: asyncio.Future[None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def engine_key(self) -> str:
        return engine_key(self.request_id, self.num_migrations)

    def subscribe(self, max_pending_tokens: int = DEFAULT_MAX_PENDING_TOKENS, stream_interval: int = 1) -> Listener:
        """A listener for the events published from now on. On a finished request it
        already holds the finish, so nobody waits on a request that will publish nothing."""
        listener = Listener(self.request_id, self.num_output_tokens, max_pending_tokens, stream_interval)
        if self.finish_reason is not None:
            listener.put(TokenEvent(self.request_id, (), "", self.num_output_tokens,
                                    finish_reason=self.finish_reason, error=self.error))
        else:
            self.listeners.append(listener)
        return listener

    def unsubscribe(self, listener: Listener) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def publish(self, event: TokenEvent) -> None:
        if event.num_cached_tokens:
            self.num_cached_tokens = min(event.num_cached_tokens, len(self.prompt_ids))
        if event.token_ids:
            if self.num_output_tokens == 0:
                self.first_token_at = time.time()
            del self.output_ids[event.offset :]
            self.output_ids.extend(event.token_ids)
        self.num_text_chars += len(event.text)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.error = event.error
        for listener in self.listeners:
            listener.put(event)
        if event.finish_reason is not None:
            self.done.set()

    def hand_over(self, why: str) -> None:
        """Another router serves the request now: each listener ends with RequestMoved."""
        self.handed_over = True
        for listener in self.listeners:
            listener.end_with(RequestMoved(self.request_id, why))
        self.listeners.clear()
        self.done.set()


class RequestMoved(Exception):
    """The request is served by another router now; the client re-attaches with Stream."""

    def __init__(self, request_id: str, why: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id!r} left this router: {why}")


class PendingOutputOverflow(Exception):
    """A client fell behind by more than its listener's max_pending_tokens."""

    def __init__(self, request_id: str, num_pending_tokens: int, max_pending_tokens: int) -> None:
        self.request_id = request_id
        self.num_pending_tokens = num_pending_tokens
        self.max_pending_tokens = max_pending_tokens
        super().__init__(
            f"the client fell behind: {num_pending_tokens} tokens of request {request_id!r} waited to be sent, "
            f"over max_pending_tokens={max_pending_tokens}"
        )


class _PendingDelta:
    """Events merged into one: tokens, logprobs and text appended, the last finish kept."""

    def __init__(self, event: TokenEvent) -> None:
        self.offset = event.offset
        self.token_ids: list[int] = []
        self.logprobs: list[SampledToken] = []
        self.texts: list[str] = []
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.num_cached_tokens = 0
        self.add(event)

    @property
    def end_offset(self) -> int:
        return self.offset + len(self.token_ids)

    def takes(self, event: TokenEvent) -> bool:
        """Whether `event` goes on where this delta ends (or repeats some of its tokens)."""
        return self.finish_reason is None and self.offset <= event.offset <= self.end_offset

    def add(self, event: TokenEvent) -> int:
        """Append the event's part past this delta's end; returns how many tokens it added."""
        skip = self.end_offset - event.offset  # tokens of the event this delta already has
        new_ids = event.token_ids[skip:]
        # An event whose tokens are all here already is a repeat: its text is too. One that
        # goes past the end brings its whole text (a text delta belongs to its last token).
        if new_ids or not event.token_ids:
            self.token_ids.extend(new_ids)
            self.logprobs.extend(event.logprobs[skip:])
            if event.text:
                self.texts.append(event.text)
                if len(self.texts) >= _TEXT_PARTS:  # one string, not a small object per token
                    self.texts = ["".join(self.texts)]
        if event.finish_reason is not None:
            self.finish_reason, self.error = event.finish_reason, event.error
        self.num_cached_tokens = event.num_cached_tokens or self.num_cached_tokens
        return len(new_ids)

    def event(self, request_id: str) -> TokenEvent:
        return TokenEvent(
            request_id, tuple(self.token_ids), "".join(self.texts), self.offset, tuple(self.logprobs),
            self.finish_reason, self.error, self.num_cached_tokens,
        )


class Listener:
    """One client's output that it has not taken yet, coalesced, and bounded.

    Events put here merge into one pending delta (token ids, logprobs and text appended in
    order, the finish kept), so a client that reads slowly costs one growing delta, not an
    object per event, and takes all of it at its next read. Nothing is dropped, up to
    `max_pending_tokens` waiting tokens: past that the listener lets go of what it holds
    and `get()` raises PendingOutputOverflow; the request itself goes on.

    `start_offset` is the request's output length when it subscribed: the listener holds
    the events from there on.

    `stream_interval` (vLLM's and SGLang's --stream-interval): after the first delta, the
    client is woken only once that many tokens wait, or the request finished, so a
    client costs the router one gRPC message per that many tokens, not per token
    (router CPU against smoothness). 1: every event as it comes.
    """

    def __init__(self, request_id: str, start_offset: int, max_pending_tokens: int = DEFAULT_MAX_PENDING_TOKENS,
                 stream_interval: int = 1) -> None:
        if max_pending_tokens < 1:
            raise ValueError(f"max_pending_tokens must be >= 1, got {max_pending_tokens}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.request_id = request_id
        self.start_offset = start_offset
        self.max_pending_tokens = max_pending_tokens
        self.stream_interval = stream_interval
        self._taken_any = False  # the first delta goes at once, whatever the interval
        # Normally one delta; a new one starts only after a finish or at an offset gap.
        self._pending: collections.deque[_PendingDelta] = collections.deque()
        self.num_pending_tokens = 0
        self.overflow: PendingOutputOverflow | None = None
        self.ended_by: RequestMoved | None = None
        self._ready = asyncio.Event()

    @property
    def overflowed(self) -> bool:
        return self.overflow is not None

    def put(self, event: TokenEvent) -> None:
        if self.overflow is not None:
            return
        if self._pending and self._pending[-1].takes(event):
            self.num_pending_tokens += self._pending[-1].add(event)
        else:
            self._pending.append(_PendingDelta(event))
            self.num_pending_tokens += len(event.token_ids)
        if self.num_pending_tokens > self.max_pending_tokens:
            self.overflow = PendingOutputOverflow(self.request_id, self.num_pending_tokens, self.max_pending_tokens)
            self._pending.clear()
        if self._deliverable():
            self._ready.set()

    def _deliverable(self) -> bool:
        """Whether get() hands something out now (see stream_interval)."""
        if self.overflow is not None or self.ended_by is not None:
            return True
        if not self._pending:
            return False
        return (
            self.stream_interval == 1
            or not self._taken_any
            or len(self._pending) > 1
            or self._pending[0].finish_reason is not None
            or self.num_pending_tokens >= self.stream_interval
        )

    def end_with(self, error: RequestMoved) -> None:
        """Let go of what is pending: get() raises error from now on."""
        self.ended_by = error
        self._pending.clear()
        self._ready.set()

    async def get(self) -> TokenEvent:
        """Everything pending, merged into one event (waits until there is something to
        hand out: see stream_interval)."""
        while not self._deliverable():
            self._ready.clear()
            await self._ready.wait()
        if self.overflow is not None:
            raise self.overflow
        if self.ended_by is not None:
            raise self.ended_by
        delta = self._pending.popleft()
        self.num_pending_tokens -= len(delta.token_ids)
        self._taken_any = True
        return delta.event(self.request_id)


def engine_key(request_id: str, attempt: int) -> str:
    """The id a worker's engine knows a placement by: the request id, then "#n" from the
    first move on ('#' never occurs in a request id)."""
    return request_id if attempt == 0 else f"{request_id}#{attempt}"


def split_engine_key(key: str) -> tuple[str, int]:
    request_id, sep, attempt = key.rpartition("#")
    if not sep:
        return key, 0
    return request_id, int(attempt)

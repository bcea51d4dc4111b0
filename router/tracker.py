"""One request's live state inside a router: where it runs, what it produced, who listens."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from workers.engine.block_hash import BlockHash
from workers.engine.plan import TokenEvent
from workers.engine.request import FinishReason
from workers.engine.sampling import SamplingParams


@dataclass
class RequestTracker:
    """Created when a request is accepted; forgotten once it has finished and been recorded.

    Listeners are queues of TokenEvents; a Stream that re-attaches subscribes before it
    reads the Redis log, and drops live events below the offset it has already sent.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    need_blocks: int
    block_hashes: tuple[BlockHash, ...] = ()  # its prompt's full blocks, for the prefix index
    created_at: float = field(default_factory=time.time)
    worker_id: str = ""
    first_token_at: float = 0.0
    finish_reason: FinishReason | None = None
    error: str | None = None
    keep_running_without_client: bool = False
    # Times it moved to another worker (a migration, or an adoption by a restarted router);
    # its current placement is known to its worker as engine_key(request_id, num_migrations).
    num_migrations: int = 0
    # What it produced so far, which a move to another worker resumes from.
    output_ids: list[int] = field(default_factory=list)
    num_text_chars: int = 0
    # Prompt tokens its current placement found in the worker's prefix cache.
    num_cached_tokens: int = 0
    cancel_requested: bool = False
    listeners: list[asyncio.Queue[TokenEvent]] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def engine_key(self) -> str:
        return engine_key(self.request_id, self.num_migrations)

    def subscribe(self) -> asyncio.Queue[TokenEvent]:
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.listeners.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[TokenEvent]) -> None:
        if queue in self.listeners:
            self.listeners.remove(queue)

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
        for queue in self.listeners:
            queue.put_nowait(event)
        if event.finish_reason is not None:
            self.done.set()


def engine_key(request_id: str, attempt: int) -> str:
    """The id a worker's engine knows a placement by: the request id, then "#n" from the
    first move on ('#' never occurs in a request id)."""
    return request_id if attempt == 0 else f"{request_id}#{attempt}"


def split_engine_key(key: str) -> tuple[str, int]:
    request_id, sep, attempt = key.rpartition("#")
    if not sep:
        return key, 0
    return request_id, int(attempt)

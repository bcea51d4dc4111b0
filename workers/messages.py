"""What crosses between a worker actor and the router: plain, picklable values.

A request's full data goes to its worker once (AddRequest); after that only what
changed travels: one StepBatch per engine step per worker, carrying the token events of
every request in that step and the worker's KV report.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.block_hash import BlockHash
from workers.engine.stats import EngineStats
from workers.engine.plan import TokenEvent
from workers.engine.request import Resume
from workers.engine.sampling import SamplingParams
from workers.model.tokenizer import TokenizerSpec


@dataclass(frozen=True)
class WorkerInfo:
    """Sent once when a worker is up: what the router validates and places against."""

    worker_id: str
    node_id: str
    model: str
    device: str
    dtype: str
    vocab_size: int
    max_model_len: int
    block_size: int
    block_bytes: int
    num_blocks: int
    tokenizer: TokenizerSpec


@dataclass(frozen=True)
class AddRequest:
    """A request for a worker's engine. request_id is the router's key for this placement
    (see router.core.engine_key): a moved request gets a new one, so the events of an
    earlier placement can never be taken for this one's."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    resume: Resume | None = None  # set when the request moved here from another worker
    cache_salt: str | None = None  # prefix-cache isolation: shares KV only within one salt


@dataclass(frozen=True)
class KVReport:
    """A worker's KV state. committed blocks are what its admitted requests would hold at
    max_tokens, a block they share counted once (EngineStats.num_committed_blocks);
    total - committed is what the router may still promise on this worker.

    free blocks include the evictable ones (cached KV nobody holds, reused on a prefix
    hit and otherwise allocated like free ones). The prefix-cache counters are cumulative
    tokens since the worker started: hit / queried is its hit rate."""

    worker_id: str
    seq: int
    sent_at: float  # the worker's time.time()
    num_total_blocks: int
    num_free_blocks: int
    num_committed_blocks: int
    block_bytes: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_steps: int
    num_evictable_blocks: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0

    @classmethod
    def from_stats(cls, worker_id: str, seq: int, sent_at: float, stats: EngineStats) -> KVReport:
        return cls(
            worker_id=worker_id,
            seq=seq,
            sent_at=sent_at,
            num_total_blocks=stats.num_total_blocks,
            num_free_blocks=stats.num_free_blocks,
            num_committed_blocks=stats.num_committed_blocks,
            block_bytes=stats.block_bytes,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_preemptions=stats.num_preemptions,
            num_steps=stats.num_steps,
            num_evictable_blocks=stats.num_evictable_blocks,
            prefix_cache_queried_tokens=stats.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=stats.prefix_cache_hit_tokens,
        )

    @property
    def free_kv_bytes(self) -> int:
        return self.num_free_blocks * self.block_bytes

    @property
    def total_kv_bytes(self) -> int:
        return self.num_total_blocks * self.block_bytes

    @property
    def num_uncommitted_blocks(self) -> int:
        """What the router may still promise here: 0, never negative, when the worker has
        more committed than its pool holds."""
        return max(0, self.num_total_blocks - self.num_committed_blocks)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests: total minus free (evictable ones count as free)."""
        return self.num_total_blocks - self.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Hit tokens over queried tokens; None before anything was queried."""
        if self.prefix_cache_queried_tokens == 0:
            return None
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens


@dataclass(frozen=True)
class KVEventBatch:
    """A worker's prefix-cache changes since its previous batch, in order: stored True is
    a block cached (full, its KV written), False one evicted. seq counts the batches that
    carry changes, from 1 per worker process, so a gap shows a lost batch."""

    seq: int
    events: tuple[tuple[bool, BlockHash], ...]


@dataclass(frozen=True)
class KVSnapshot:
    """Everything a worker's cache holds, as of its batch number seq."""

    seq: int
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class StepBatch:
    """Everything a worker has to say since its last batch.

    added_ids: requests the engine took in since the last batch (their KV is now inside
    report.num_committed_blocks, so the router drops its in-flight reservation for them).
    """

    report: KVReport
    events: tuple[TokenEvent, ...] = ()
    added_ids: tuple[str, ...] = ()
    heartbeat: bool = False  # sent by the actor's event loop: nothing new, still alive
    kv_events: KVEventBatch | None = None  # prefix-cache changes since the last batch that had some

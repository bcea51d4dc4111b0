"""EngineStats: a snapshot of one engine's KV pool, queues and prefix-cache counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's KV pool and queues.

    Blocks: num_free_blocks can be allocated now (FREE plus EVICTABLE, the cached blocks
    nobody holds); num_evictable_blocks of those still keep KV for a prefix-cache hit;
    num_used_blocks are held by requests; free + used = total. The prefix-cache counters
    are cumulative tokens (see PrefixCacheCounters): hit / queried is the hit rate.

    num_committed_blocks: the blocks the unfinished requests hold now, a block shared
    through the prefix cache counted once, plus what each can still grow by up to its
    max_tokens:

        committed = used + sum over unfinished requests of (blocks at max_tokens - blocks in its table)

        block_size 4, a and b share cached blocks 0 1, each needs 4 at max_tokens
        a: 0 1 | 2        b: 0 1 | 3          used 4 (0 1 2 3)
        committed = 4 + (4 - 3) + (4 - 3) = 6    (8 if each counted its own 0 1)

    A waiting request holds no table, so it counts its whole need, less the blocks of
    its cached prefix it would share rather than take: those some request holds now
    (already in used), and those an earlier waiting request already counts (one cached
    block is taken once, however many wait for it):

        c holds cached blocks 0 1 (used 2), d and e wait, each needing 4, both hit 0 1
        committed = 2 + (c's growth) + (4 - 2) + (4 - 2)
        f and g wait, each needing 4, both hit evictable blocks 5 6
        committed += (4 - 0) + (4 - 2)        (f takes 5 6; g shares them)
    """

    num_total_blocks: int
    num_free_blocks: int
    num_evictable_blocks: int
    num_used_blocks: int
    block_size: int
    block_bytes: int
    free_kv_bytes: int
    total_kv_bytes: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_steps: int
    num_committed_blocks: int  # blocks the unfinished requests can hold at max_tokens (see above)
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Hit tokens over queried tokens; None before anything was queried."""
        if self.prefix_cache_queried_tokens == 0:
            return None
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens

    @property
    def num_uncommitted_blocks(self) -> int:
        """Blocks no admitted request can ever claim: what a new request may be promised.
        0, never negative, when more is committed than the pool holds."""
        return max(0, self.num_total_blocks - self.num_committed_blocks)

    @classmethod
    def of_pool(
        cls,
        num_total_blocks: int,
        num_committed_blocks: int,
        block_bytes: int,
        block_size: int = 16,
        num_running: int = 0,
        num_waiting: int = 0,
        num_steps: int = 0,
    ) -> EngineStats:
        """A snapshot from pool totals alone, for simulated workers and tests: the blocks not
        committed are free, nothing is evictable, no prefix-cache traffic."""
        num_free = max(0, num_total_blocks - num_committed_blocks)
        return cls(
            num_total_blocks=num_total_blocks,
            num_free_blocks=num_free,
            num_evictable_blocks=0,
            num_used_blocks=num_total_blocks - num_free,
            block_size=block_size,
            block_bytes=block_bytes,
            free_kv_bytes=num_free * block_bytes,
            total_kv_bytes=num_total_blocks * block_bytes,
            num_running=num_running,
            num_waiting=num_waiting,
            num_preemptions=0,
            num_steps=num_steps,
            num_committed_blocks=num_committed_blocks,
            prefix_cache_queried_tokens=0,
            prefix_cache_hit_tokens=0,
        )

"""Automatic prefix caching, the scheduler's side: which cached blocks a request can reuse
when it is admitted, and which of its blocks become reusable after a step wrote them.

The allocator owns the hash -> block map and the refcounts; this class keeps, per
request, the chained hashes of its full blocks (workers/engine/block_hash.py) and how
many leading blocks of its table are already registered, and asks the allocator.

Two rules keep every hit correct:

* A block enters the hash map only after the step that wrote its KV committed
  (cache_written_blocks, called from Scheduler.commit), so no request reads blocks not
  yet written. A waiting request whose next uncached block a running request is still
  computing (pending_hashes) is not admitted until it is written (Scheduler.schedule),
  and then hits it: two requests that bring the same new prefix compute it once.
* A hit never covers a request's last known token, whose logits the next token is
  sampled from; the hit is whole blocks, so at most (num_tokens - 1) // block_size.
  A request therefore never writes into a block it shares: it writes only positions
  from its first uncached block on.

      block_size 4, num_tokens 8, all of it cached:
      tokens:  t0 t1 t2 t3 | t4 t5 t6 t7
      hit:     block 0     | recomputed (t7's logits are needed; block 1 is shared)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.engine.block_allocator import BlockAllocator
from workers.engine.block_hash import BlockHash, extend_block_hashes, request_extra_keys
from workers.engine.request import Request


@dataclass(frozen=True)
class PrefixCacheCounters:
    """Cumulative since the engine started. queried: the known tokens of every admitted
    request, at each admission (readmissions after preemption too); hit: those of them
    whose KV came from the cache. hit / queried is the hit rate."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0


class PrefixCache:
    """Per-request block hashes and the hit and registration bookkeeping."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self._allocator = allocator
        self._block_size = block_size
        self._hashes: dict[str, list[BlockHash]] = {}  # every unfinished request looked up
        self._num_cached_blocks: dict[str, int] = {}  # running requests: registered leading blocks
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0

    @property
    def counters(self) -> PrefixCacheCounters:
        return PrefixCacheCounters(self._num_queried_tokens, self._num_hit_tokens)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks of known tokens; each is computed once."""
        hashes = self._hashes.setdefault(request.request_id, [])
        extend_block_hashes(hashes, request.token_ids, self._block_size, request_extra_keys(request.cache_salt))
        return hashes

    def find_hit(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's known tokens, leaving
        its last token to compute. Changes nothing in the allocator."""
        return self._allocator.lookup(self._hittable_hashes(request))

    def _hittable_hashes(self, request: Request) -> list[BlockHash]:
        """The hashes a hit may cover: every full block but the one with the last token."""
        return self.block_hashes(request)[: (request.num_tokens - 1) // self._block_size]

    def pending_hashes(self, request: Request) -> list[BlockHash]:
        """A running request's full blocks of known tokens whose KV is not registered yet:
        being computed, findable once a step writes them."""
        hashes = self._hashes.get(request.request_id, ())
        return list(hashes[self._num_cached_blocks.get(request.request_id, 0) :])

    def hit_and_pending(self, request: Request, pending: set[BlockHash]) -> tuple[list[int], int]:
        """The request's cached prefix (find_hit's block ids), and how many blocks after it
        are in pending: ones a running request is computing, which it would hit later."""
        hashes = self._hittable_hashes(request)
        hit = self._allocator.lookup(hashes)
        num_pending = 0
        if pending:
            for block_hash in hashes[len(hit) :]:
                if block_hash not in pending:
                    break
                num_pending += 1
        return hit, num_pending

    def admitted(self, request: Request, num_hit_blocks: int) -> None:
        """The request now holds its hit blocks at the head of its table."""
        assert request.request_id not in self._num_cached_blocks, f"{request.request_id!r} admitted twice"
        self._num_cached_blocks[request.request_id] = num_hit_blocks
        if request.num_preemptions == 0:
            # The hit rate is of prompts (serving.proto: prompt tokens found cached over
            # prompt tokens looked up), each counted as its Usage counts it: not a resumed
            # request's output, which made a moved request's new worker count more than its
            # clients' Usage said (an outside check: 75 looked up for a 70-token prompt), and
            # not a preempted request finding its own KV again: counted, that made it read
            # 0.92 where no prompt had anything cached (as vLLM #25780).
            num_prompt_tokens = len(request.prompt_ids)
            self._num_queried_tokens += num_prompt_tokens
            self._num_hit_tokens += min(num_hit_blocks * self._block_size, num_prompt_tokens)

    def cache_written_blocks(self, request: Request, block_table: Sequence[int]) -> None:
        """Register the blocks that filled with committed KV since the last call.

            block_size 4, num_computed_tokens 10, registered 1
            positions:  0 1 2 3 | 4 5 6 7 | 8 9
            table:      b0      | b1      | b2 (not full)
                        (had)   | cached now
        """
        num_cached = self._num_cached_blocks[request.request_id]
        num_full = request.num_computed_tokens // self._block_size
        if num_full <= num_cached:
            return
        hashes = self.block_hashes(request)
        for index in range(num_cached, num_full):
            # False: an equal block is cached already; this one stays private, still correct.
            self._allocator.cache_full_block(block_table[index], hashes[index])
        self._num_cached_blocks[request.request_id] = num_full

    def released(self, request_id: str) -> None:
        """The request let go of its table (preempted or finished); its hashes stay
        while it is unfinished, so a readmission does not hash again."""
        self._num_cached_blocks.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request finished: drop everything about it."""
        self._num_cached_blocks.pop(request_id, None)
        self._hashes.pop(request_id, None)

    def check_invariants(self, request: Request, block_table: Sequence[int]) -> None:
        """Assert a running request's table agrees with the cache.

        Its first registered blocks are cached under its own hashes (or, a duplicate of
        a block cached elsewhere, held by it alone); every later block is uncached and
        held by it alone, so nobody else can read a block it is still writing.
        """
        num_cached = self._num_cached_blocks.get(request.request_id)
        assert num_cached is not None, f"running {request.request_id!r} is not registered"
        assert num_cached <= request.num_computed_tokens // self._block_size, (
            f"{request.request_id!r} registered {num_cached} blocks but computed {request.num_computed_tokens} tokens"
        )
        hashes = self._hashes.get(request.request_id, [])
        assert len(hashes) >= num_cached
        for index, block_id in enumerate(block_table):
            block_hash = self._allocator.block_hash(block_id)
            if index < num_cached and block_hash is not None:
                assert block_hash == hashes[index], f"block {block_id} at {index} is cached under a foreign hash"
            else:
                assert block_hash is None, f"block {block_id} at {index} is cached before it was registered"
                assert self._allocator.refcount(block_id) == 1, f"uncached block {block_id} is shared"

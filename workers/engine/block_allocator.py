"""KV block ids and their refcounts: the allocator is the only owner of both.

A block holds block_size tokens of KV for every layer; the allocator never sees tokens,
only ids 0 .. num_blocks-1 and how many holders each id has. Block tables (which
request holds which ids) belong to the scheduler.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class BlockAllocator:
    """A refcounted pool of KV block ids.

    A block is free (refcount 0, in the free queue exactly once) or used (refcount >= 1,
    not in the free queue). allocate() hands out blocks with refcount 1; retain() adds a
    holder to a used block (sharing, for prefix caching); release() drops one and
    the block goes back to the free queue when the last holder lets go.

    The free queue is FIFO: allocate() takes from the front, release() appends at the
    back. A freed block is therefore reused as late as possible, which keeps its KV
    intact longest (what a prefix cache will want), and a fresh pool hands out
    0, 1, 2, ... in order, which keeps tests readable.

        free queue:  front [3 5 0] back
        allocate(2) -> [3, 5]          free: [0]
        release([5])                   free: [0 5]
    """

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_bytes", block_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockAllocator.{name} must be a positive integer, got {value!r}")
        self._num_blocks = num_blocks
        self._block_bytes = block_bytes
        self._refcounts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, free or used."""
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free)

    @property
    def block_bytes(self) -> int:
        """Bytes of KV one block holds (all layers, K and V)."""
        return self._block_bytes

    @property
    def free_kv_bytes(self) -> int:
        """Exactly num_free_blocks * block_bytes: what the router may still place here."""
        return len(self._free) * self._block_bytes

    @property
    def total_kv_bytes(self) -> int:
        return self._num_blocks * self._block_bytes

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take num_blocks free blocks, each with refcount 1, or None (taking nothing).

        All or nothing, so a caller that cannot get what it needs never holds a partial
        grant. Costs O(num_blocks), independent of the pool size.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"allocate: num_blocks must be an integer >= 0, got {num_blocks!r}")
        if num_blocks > len(self._free):
            return None
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            assert self._refcounts[block_id] == 0, f"block {block_id} was in the free queue while used"
            self._refcounts[block_id] = 1
        return block_ids

    def retain(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block (a block listed twice gains two).

        Only used blocks can be retained; a free one raises ValueError and nothing changes.
        """
        ids = list(block_ids)
        for block_id in ids:
            self._check_id(block_id)
            if self._refcounts[block_id] == 0:
                raise ValueError(f"retain: block {block_id} is free; only allocated blocks can be shared")
        for block_id in ids:
            self._refcounts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; a block whose last holder left becomes free.

        Releasing more times than a block is held is a caller bug: ValueError, and
        nothing changes (the whole call is checked before any refcount moves).
        """
        ids = list(block_ids)
        for block_id in ids:
            self._check_id(block_id)
        for block_id, count in Counter(ids).items():
            if count > self._refcounts[block_id]:
                raise ValueError(
                    f"release: block {block_id} released {count} time(s) but has refcount "
                    f"{self._refcounts[block_id]}"
                )
        for block_id in ids:
            self._refcounts[block_id] -= 1
            if self._refcounts[block_id] == 0:
                self._free.append(block_id)

    def refcount(self, block_id: int) -> int:
        """Holders of block_id; 0 means free."""
        self._check_id(block_id)
        return self._refcounts[block_id]

    def check_invariants(self) -> None:
        """Assert the pool is consistent: O(num_blocks), for tests and debugging."""
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a block is in the free queue twice"
        for block_id, count in enumerate(self._refcounts):
            assert count >= 0, f"block {block_id} has negative refcount {count}"
            if block_id in free_set:
                assert count == 0, f"free block {block_id} has refcount {count}"
            else:
                assert count > 0, f"block {block_id} is neither free nor held"
        num_used = sum(1 for count in self._refcounts if count > 0)
        assert num_used + len(self._free) == self._num_blocks, "free + used != total"

    def _check_id(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id must be in [0, {self._num_blocks}), got {block_id!r}")

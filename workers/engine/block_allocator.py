"""KV block ids, their refcounts and the prefix cache's hash map: the allocator owns all three.

A block holds block_size tokens of KV for every layer; the allocator never sees tokens,
only ids 0 .. num_blocks-1, how many holders each id has, and for a cached block the
hash naming its contents (workers/engine/block_hash.py). Block tables (which request
holds which ids) belong to the scheduler.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence

from workers.engine.block_hash import BlockHash
from workers.engine.cache_events import CacheEvent, CacheEventLog


class BlockState(enum.Enum):
    FREE = "free"  # refcount 0, no KV worth keeping
    EVICTABLE = "evictable"  # refcount 0, keeps its KV and hash until allocate() needs it
    USED = "used"  # refcount >= 1: that many holders


class BlockAllocator:
    """A refcounted pool of KV block ids with a cache of full, written blocks.

    Every block is in exactly one state:

        FREE       refcount 0, no hash           in the free queue (FIFO)
        EVICTABLE  refcount 0, hash kept         in the LRU, least recently used first
        USED       refcount >= 1, hash or not    held by that many block tables

        allocate          FREE -> USED, and only when no FREE is left EVICTABLE -> USED
                          (the least recently used first; its hash is dropped)
        release           USED -> FREE (no hash) or EVICTABLE (hash; appended to the LRU)
                          when the last holder lets go
        touch             EVICTABLE -> USED (a cache hit), or one more holder on USED
        cache_full_block  a USED block gets its hash: from now on lookup() finds it

    The hash map holds exactly the blocks that have a hash, USED or EVICTABLE, one block
    per hash; every change to it is recorded for drain_events() (a hash stored by
    cache_full_block, a hash dropped by allocate or evict_all). The free queue is FIFO,
    so a fresh pool hands out 0, 1, 2, ... in order and tests stay readable:

        free: front [3 5] back    LRU: oldest [0 2] newest
        allocate(3) -> [3, 5, 0]  (0 evicted: its hash is gone)
        release([5])  (no hash)   free: [5]    LRU: [2]
    """

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_bytes", block_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockAllocator.{name} must be a positive integer, got {value!r}")
        self._num_blocks = num_blocks
        self._block_bytes = block_bytes
        self._refcounts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently used
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._events = CacheEventLog()

    # -- sizes ------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, in any state."""
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate() can hand out: FREE plus EVICTABLE."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        """Unheld blocks that still keep their KV for a cache hit."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with at least one holder."""
        return self._num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks lookup() can find, USED or EVICTABLE."""
        return len(self._cached)

    @property
    def block_bytes(self) -> int:
        """Bytes of KV one block holds (all layers, K and V)."""
        return self._block_bytes

    @property
    def free_kv_bytes(self) -> int:
        """Exactly num_free_blocks * block_bytes: what the router may still place here."""
        return self.num_free_blocks * self._block_bytes

    @property
    def total_kv_bytes(self) -> int:
        return self._num_blocks * self._block_bytes

    # -- allocation -------------------------------------------------------------------

    def can_allocate(self, num_blocks: int, touching: Sequence[int] = ()) -> bool:
        """Whether allocate(num_blocks) succeeds after touch(touching).

        A touched EVICTABLE block stops being available, a touched USED one costs
        nothing (it is shared, so counted once), and a block listed twice counts once.
        """
        num_touched_evictable = sum(1 for b in set(touching) if b in self._evictable)
        return num_blocks <= self.num_free_blocks - num_touched_evictable

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take num_blocks blocks, each with refcount 1, or None (taking nothing).

        FREE blocks go first; then EVICTABLE ones, least recently used first, losing
        their hash. All or nothing, so a caller that cannot get what it needs never
        holds a partial grant. Costs O(num_blocks), independent of the pool size.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"allocate: num_blocks must be an integer >= 0, got {num_blocks!r}")
        if num_blocks > self.num_free_blocks:
            return None
        block_ids: list[int] = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block_hash = self._hashes[block_id]
                assert block_hash is not None, f"evictable block {block_id} has no hash"
                del self._cached[block_hash]
                self._hashes[block_id] = None
                self._events.record(False, block_hash)
            assert self._refcounts[block_id] == 0, f"block {block_id} was available while used"
            self._refcounts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def retain(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block (a block listed twice gains two).

        Only USED blocks can be retained; another raises ValueError and nothing changes.
        """
        ids = list(block_ids)
        for block_id in ids:
            self._check_id(block_id)
            if self._refcounts[block_id] == 0:
                raise ValueError(f"retain: block {block_id} is not used; only allocated blocks can be shared")
        for block_id in ids:
            self._refcounts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block, in the order given.

        A block whose last holder left becomes EVICTABLE if it has a hash (appended to
        the LRU, so of the blocks released here the first listed is evicted first) and
        FREE otherwise. Releasing more times than a block is held is a caller bug:
        ValueError, and nothing changes (the call is checked before any refcount moves).
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
                if self._hashes[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None

    # -- the prefix cache -------------------------------------------------------------

    def lookup(self, block_hashes: Iterable[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of a chain of hashes; changes nothing.

            hashes:  h0 h1 h2 h3     cached: h0 -> 4, h1 -> 0, h3 -> 2
            lookup -> [4, 0]         (h2 missing: h3 is past the end of the prefix)
        """
        # In C (map, index): this runs for every waiting request each step (the committed count).
        block_ids = list(map(self._cached.get, block_hashes))
        if None in block_ids:
            del block_ids[block_ids.index(None) :]
        return block_ids  # type: ignore[return-value]  # no None is left

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each cached block (a cache hit): an EVICTABLE block leaves
        the LRU and becomes USED. A block without a hash raises ValueError, and nothing
        changes."""
        ids = list(block_ids)
        for block_id in ids:
            self._check_id(block_id)
            if self._hashes[block_id] is None:
                raise ValueError(f"touch: block {block_id} is not cached")
        for block_id in ids:
            if self._refcounts[block_id] == 0:
                del self._evictable[block_id]
            self._refcounts[block_id] += 1

    def cache_full_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Make a USED block, full and with its KV written, findable under block_hash.

        Returns True if lookup(block_hash) now finds this block. If another block is
        already cached under the same hash (two requests computed the same block at
        once), that mapping stays, this block stays uncached, and False comes back:
        both hold equal KV and each holder keeps its own. Caching a block again under
        its own hash is a no-op; under another hash it is a caller bug (ValueError).
        """
        self._check_id(block_id)
        if self._refcounts[block_id] == 0:
            raise ValueError(f"cache_full_block: block {block_id} is not used")
        current = self._hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"cache_full_block: block {block_id} is already cached under another hash")
            return True
        if block_hash in self._cached:
            return False
        self._hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        self._events.record(True, block_hash)
        return True

    def evict_all(self) -> int:
        """Forget the KV of every EVICTABLE block (they become FREE); returns how many.
        USED blocks keep their hashes. For a reset of the cache, and for tests."""
        evicted = list(self._evictable)
        for block_id in evicted:
            block_hash = self._hashes[block_id]
            assert block_hash is not None
            del self._cached[block_hash]
            self._hashes[block_id] = None
            self._events.record(False, block_hash)
            self._free.append(block_id)
        self._evictable.clear()
        return len(evicted)

    def drain_events(self) -> list[CacheEvent]:
        """The hash map's net changes since the last call, oldest first, and forget them:
        replayed onto cached_hashes() as it was then, they give cached_hashes() now."""
        return self._events.drain()

    def cached_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash lookup() can find now, USED or EVICTABLE."""
        return tuple(self._cached)

    # -- queries ----------------------------------------------------------------------

    def refcount(self, block_id: int) -> int:
        """Holders of block_id; 0 means FREE or EVICTABLE."""
        self._check_id(block_id)
        return self._refcounts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash block_id is cached under, or None."""
        self._check_id(block_id)
        return self._hashes[block_id]

    def block_state(self, block_id: int) -> BlockState:
        self._check_id(block_id)
        if self._refcounts[block_id] > 0:
            return BlockState.USED
        return BlockState.FREE if self._hashes[block_id] is None else BlockState.EVICTABLE

    def evictable_among(self, block_ids: Iterable[int]) -> set[int]:
        """Those of block_ids that are EVICTABLE (cached, nobody holds them)."""
        return self._evictable.keys() & block_ids

    def evictable_blocks(self) -> list[int]:
        """EVICTABLE block ids, the next one allocate() would evict first."""
        return list(self._evictable)

    # -- checks -----------------------------------------------------------------------

    def check_invariants(self, block_tables: Iterable[Sequence[int]] | None = None) -> None:
        """Assert the pool is consistent: O(num_blocks), for tests and debugging.

        With block_tables (every holder's list of ids), also assert that each block's
        refcount is the number of times the tables name it: no leak, no double hold.
        """
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a block is in the free queue twice"
        assert not free_set & set(self._evictable), "a block is both free and evictable"
        for block_id, count in enumerate(self._refcounts):
            assert count >= 0, f"block {block_id} has negative refcount {count}"
            block_hash = self._hashes[block_id]
            if block_id in free_set:
                assert count == 0, f"free block {block_id} has refcount {count}"
                assert block_hash is None, f"free block {block_id} keeps a hash"
            elif block_id in self._evictable:
                assert count == 0, f"evictable block {block_id} has refcount {count}"
                assert block_hash is not None, f"evictable block {block_id} has no hash"
            else:
                assert count > 0, f"block {block_id} is neither free, evictable nor held"
            if block_hash is not None:
                assert self._cached.get(block_hash) == block_id, f"block {block_id}'s hash maps elsewhere"
        assert len(self._cached) == sum(1 for h in self._hashes if h is not None), "hash map has stale entries"
        assert len(self._events) <= 2 * self._num_blocks, "the event log keeps more than the net changes"
        num_used = sum(1 for count in self._refcounts if count > 0)
        assert num_used + len(self._free) + len(self._evictable) == self._num_blocks, "states do not add up"
        if block_tables is not None:
            held = Counter(block_id for table in block_tables for block_id in table)
            for block_id, count in enumerate(self._refcounts):
                assert count == held.get(block_id, 0), (
                    f"block {block_id} has refcount {count} but {held.get(block_id, 0)} holder(s)"
                )

    def _check_id(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id must be in [0, {self._num_blocks}), got {block_id!r}")

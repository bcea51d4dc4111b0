"""BlockAllocator: exact scenarios with named block ids, then random operation sequences.

Block states (see BlockAllocator): FREE (no KV worth keeping), EVICTABLE (unheld, keeps
its KV and hash, in LRU order) and USED (held). H0, H1, ... are block hashes.
"""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from workers.engine.block_allocator import BlockAllocator, BlockState
from workers.engine.block_hash import BlockHash

BLOCK_BYTES = 1000
H0, H1, H2, H3 = (BlockHash(bytes([i]) * 32) for i in range(4))
FREE, EVICTABLE, USED = BlockState.FREE, BlockState.EVICTABLE, BlockState.USED


def assert_free(allocator: BlockAllocator, num_free: int, num_evictable: int = 0) -> None:
    allocator.check_invariants()
    assert allocator.num_free_blocks == num_free
    assert allocator.num_evictable_blocks == num_evictable
    assert allocator.num_used_blocks == allocator.num_blocks - num_free
    assert allocator.free_kv_bytes == num_free * BLOCK_BYTES
    assert allocator.total_kv_bytes == allocator.num_blocks * BLOCK_BYTES


def test_fresh_pool_is_all_free() -> None:
    allocator = BlockAllocator(num_blocks=4, block_bytes=BLOCK_BYTES)
    assert allocator.num_blocks == 4
    assert allocator.block_bytes == BLOCK_BYTES
    assert [allocator.refcount(b) for b in range(4)] == [0, 0, 0, 0]
    assert_free(allocator, 4)


def test_allocate_is_all_or_nothing() -> None:
    allocator = BlockAllocator(num_blocks=4, block_bytes=BLOCK_BYTES)
    assert allocator.allocate(3) == [0, 1, 2]
    assert_free(allocator, 1)
    assert [allocator.refcount(b) for b in range(4)] == [1, 1, 1, 0]

    assert allocator.allocate(2) is None  # only one free: takes nothing
    assert_free(allocator, 1)
    assert allocator.refcount(3) == 0

    assert allocator.allocate(0) == []
    assert_free(allocator, 1)

    assert allocator.allocate(1) == [3]
    assert_free(allocator, 0)
    assert allocator.allocate(1) is None
    assert allocator.allocate(0) == []


def test_freed_blocks_go_to_the_back_of_the_queue() -> None:
    allocator = BlockAllocator(num_blocks=4, block_bytes=BLOCK_BYTES)
    assert allocator.allocate(3) == [0, 1, 2]
    allocator.release([1])
    assert_free(allocator, 2)
    allocator.release([0])
    assert_free(allocator, 3)
    # Queue is now [3, 1, 0]: the never-used block first, then in order of release.
    assert allocator.allocate(2) == [3, 1]
    assert allocator.allocate(1) == [0]
    assert_free(allocator, 0)


def test_retain_shares_and_release_frees_at_zero() -> None:
    allocator = BlockAllocator(num_blocks=4, block_bytes=BLOCK_BYTES)
    assert allocator.allocate(2) == [0, 1]
    allocator.retain([0])
    assert allocator.refcount(0) == 2
    assert allocator.refcount(1) == 1
    assert_free(allocator, 2)  # sharing takes no extra block

    allocator.release([0, 1])
    assert allocator.refcount(0) == 1
    assert allocator.refcount(1) == 0
    assert_free(allocator, 3)

    allocator.retain([0, 0])  # listed twice: two more holders
    assert allocator.refcount(0) == 3
    allocator.release([0, 0])
    assert allocator.refcount(0) == 1
    assert_free(allocator, 3)
    allocator.release(iter([0]))  # any iterable
    assert allocator.refcount(0) == 0
    assert_free(allocator, 4)


def test_release_of_a_free_block_is_refused_and_changes_nothing() -> None:
    allocator = BlockAllocator(num_blocks=4, block_bytes=BLOCK_BYTES)
    assert allocator.allocate(2) == [0, 1]
    with pytest.raises(ValueError, match="block 3"):
        allocator.release([3])
    with pytest.raises(ValueError, match="block 0"):
        allocator.release([1, 0, 0])  # block 0 has only one holder
    assert allocator.refcount(0) == 1
    assert allocator.refcount(1) == 1  # the valid part of the call did not go through
    assert_free(allocator, 2)

    allocator.release([1])
    with pytest.raises(ValueError, match="block 1"):
        allocator.release([1])  # double free
    assert_free(allocator, 3)


def test_retain_of_a_free_block_is_refused() -> None:
    allocator = BlockAllocator(num_blocks=4, block_bytes=BLOCK_BYTES)
    assert allocator.allocate(1) == [0]
    with pytest.raises(ValueError, match="block 2"):
        allocator.retain([0, 2])
    assert allocator.refcount(0) == 1
    assert_free(allocator, 3)


@pytest.mark.parametrize("bad_id", [-1, 4, 100])
def test_out_of_range_ids_are_refused(bad_id: int) -> None:
    allocator = BlockAllocator(num_blocks=4, block_bytes=BLOCK_BYTES)
    allocator.allocate(4)
    for call in (allocator.release, allocator.retain):
        with pytest.raises(ValueError, match="block id"):
            call([bad_id])
    with pytest.raises(ValueError, match="block id"):
        allocator.refcount(bad_id)
    assert_free(allocator, 0)


def test_allocate_negative_is_refused() -> None:
    allocator = BlockAllocator(num_blocks=4, block_bytes=BLOCK_BYTES)
    with pytest.raises(ValueError, match="num_blocks"):
        allocator.allocate(-1)


@pytest.mark.parametrize(
    ("num_blocks", "block_bytes", "field"),
    [(0, 10, "num_blocks"), (-3, 10, "num_blocks"), (4, 0, "block_bytes"), (True, 10, "num_blocks")],
)
def test_constructor_names_the_bad_field(num_blocks: int, block_bytes: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BlockAllocator(num_blocks=num_blocks, block_bytes=block_bytes)


def states(allocator: BlockAllocator) -> list[BlockState]:
    return [allocator.block_state(b) for b in range(allocator.num_blocks)]


def test_free_used_evictable_rehit_evicted() -> None:
    allocator = BlockAllocator(num_blocks=4, block_bytes=BLOCK_BYTES)
    assert allocator.allocate(2) == [0, 1]
    assert allocator.lookup([H0]) == []  # allocated is not cached: its KV is not written yet
    assert allocator.cache_full_block(0, H0)
    assert allocator.lookup([H0, H1]) == [0]
    assert states(allocator) == [USED, USED, FREE, FREE]

    allocator.release([0, 1])  # 0 keeps its KV and hash, 1 had none
    assert states(allocator) == [EVICTABLE, FREE, FREE, FREE]
    assert_free(allocator, 4, num_evictable=1)  # evictable counts as available
    assert allocator.free_kv_bytes == 4 * BLOCK_BYTES
    assert allocator.num_cached_blocks == 1

    # A hit takes the evictable block back: counted against what is available.
    assert allocator.can_allocate(4) and not allocator.can_allocate(4, touching=[0])
    assert allocator.can_allocate(3, touching=[0, 0])  # listed twice, counted once
    allocator.touch(allocator.lookup([H0]))
    assert states(allocator) == [USED, FREE, FREE, FREE] and allocator.refcount(0) == 1
    assert_free(allocator, 3)
    allocator.touch([0])  # a second sharer
    assert allocator.refcount(0) == 2
    allocator.release([0, 0])
    assert_free(allocator, 4, num_evictable=1)

    # Free blocks go first (queue: 2 3 1), and only then is block 0 evicted.
    assert allocator.allocate(3) == [2, 3, 1]
    assert allocator.lookup([H0]) == [0]
    assert allocator.allocate(1) == [0]
    assert allocator.lookup([H0]) == [] and allocator.block_hash(0) is None
    assert_free(allocator, 0)


def test_lru_evicts_a_released_table_tail_first() -> None:
    allocator = BlockAllocator(num_blocks=5, block_bytes=BLOCK_BYTES)
    table = allocator.allocate(3)
    assert table == [0, 1, 2]
    for block_id, block_hash in zip(table, (H0, H1, H2)):
        assert allocator.cache_full_block(block_id, block_hash)
    allocator.release(reversed(table))  # how the scheduler releases a request's table
    assert allocator.evictable_blocks() == [2, 1, 0]
    assert_free(allocator, 5, num_evictable=3)

    assert allocator.allocate(3) == [3, 4, 2]  # the two free ones, then the table's tail
    assert allocator.lookup([H0, H1, H2]) == [0, 1]  # the head still hits
    assert allocator.allocate(1) == [1]
    assert allocator.lookup([H0, H1, H2]) == [0]
    assert allocator.evictable_blocks() == [0]


def test_a_touched_block_goes_to_the_back_of_the_lru() -> None:
    allocator = BlockAllocator(num_blocks=2, block_bytes=BLOCK_BYTES)
    assert allocator.allocate(2) == [0, 1]
    allocator.cache_full_block(0, H0)
    allocator.cache_full_block(1, H1)
    allocator.release([0, 1])
    assert allocator.evictable_blocks() == [0, 1]
    allocator.touch([0])
    allocator.release([0])  # used again just now: evicted last
    assert allocator.evictable_blocks() == [1, 0]
    assert allocator.allocate(1) == [1]


def test_the_same_hash_cached_twice_keeps_one_mapping() -> None:
    allocator = BlockAllocator(num_blocks=4, block_bytes=BLOCK_BYTES)
    assert allocator.allocate(2) == [0, 1]  # two requests computed the same block
    assert allocator.cache_full_block(0, H0)
    assert not allocator.cache_full_block(1, H0)  # the first mapping stays
    assert allocator.block_hash(1) is None and allocator.lookup([H0]) == [0]
    assert allocator.cache_full_block(0, H0)  # again, same hash: a no-op
    with pytest.raises(ValueError, match="another hash"):
        allocator.cache_full_block(0, H1)
    allocator.release([0, 1])
    assert states(allocator) == [EVICTABLE, FREE, FREE, FREE]  # the duplicate is simply freed
    with pytest.raises(ValueError, match="not used"):
        allocator.cache_full_block(0, H0)  # unheld blocks cannot be (re)cached
    with pytest.raises(ValueError, match="not used"):
        allocator.cache_full_block(1, H1)
    assert_free(allocator, 4, num_evictable=1)


def test_touch_of_an_uncached_block_is_refused_and_changes_nothing() -> None:
    allocator = BlockAllocator(num_blocks=4, block_bytes=BLOCK_BYTES)
    assert allocator.allocate(2) == [0, 1]
    allocator.cache_full_block(0, H0)
    with pytest.raises(ValueError, match="block 1"):
        allocator.touch([0, 1])
    with pytest.raises(ValueError, match="block 3"):
        allocator.touch([3])
    assert allocator.refcount(0) == 1 and allocator.refcount(1) == 1
    assert_free(allocator, 2)


def test_evict_all_forgets_only_unheld_kv() -> None:
    allocator = BlockAllocator(num_blocks=3, block_bytes=BLOCK_BYTES)
    assert allocator.allocate(2) == [0, 1]
    allocator.cache_full_block(0, H0)
    allocator.cache_full_block(1, H1)
    allocator.release([1])
    assert allocator.evict_all() == 1
    assert states(allocator) == [USED, FREE, FREE]
    assert allocator.lookup([H0, H1]) == [0]
    assert_free(allocator, 2)


def test_check_invariants_compares_refcounts_with_the_tables() -> None:
    allocator = BlockAllocator(num_blocks=4, block_bytes=BLOCK_BYTES)
    assert allocator.allocate(2) == [0, 1]
    allocator.cache_full_block(0, H0)
    allocator.touch([0])
    allocator.check_invariants([[0, 1], [0]])
    with pytest.raises(AssertionError, match="block 0"):
        allocator.check_invariants([[0, 1]])  # a holder the tables do not know: a leak
    with pytest.raises(AssertionError, match="block 2"):
        allocator.check_invariants([[0, 1], [0, 2]])


def replay_events(cached: set[BlockHash], events: list[tuple[bool, BlockHash]]) -> None:
    """Apply drained KV events to a set, strictly: the events are the net change since the
    last drain, so a stored hash was absent then and an evicted one present."""
    for stored, block_hash in events:
        if stored:
            assert block_hash not in cached, f"{block_hash.hex()[:8]} stored while cached"
            cached.add(block_hash)
        else:
            assert block_hash in cached, f"{block_hash.hex()[:8]} evicted while not cached"
            cached.remove(block_hash)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / retain / release / cache / lookup-and-touch / evict sequences
    against an exact model of the pool.

    Each holder is one reference to a list of blocks, as a block table (or a cache hit
    sharing its prefix) would be. The model keeps the free queue, the LRU and the hash
    map as the BlockAllocator docstring specifies them; after every step each block's
    state, refcount and hash must match it, and the refcounts must equal the holders.
    The allocator's KV events, drained after every step and replayed onto a set as the
    router's index does, must give exactly its hash map.
    """

    holders = Bundle("holders")

    def __init__(self) -> None:
        super().__init__()
        self.allocator = BlockAllocator(num_blocks=1, block_bytes=BLOCK_BYTES)
        self.held: list[list[int]] = []
        self.free: list[int] = [0]
        self.lru: list[int] = []
        self.hashes: dict[int, BlockHash] = {}  # block -> hash, for cached blocks
        self.replayed: set[BlockHash] = set()  # the hash map, as the drained events tell it

    @initialize(num_blocks=st.integers(min_value=1, max_value=12))
    def make_pool(self, num_blocks: int) -> None:
        self.allocator = BlockAllocator(num_blocks=num_blocks, block_bytes=BLOCK_BYTES)
        self.free = list(range(num_blocks))

    def expected_refcount(self, block_id: int) -> int:
        return sum(held.count(block_id) for held in self.held)

    def cached_block(self, block_hash: BlockHash) -> int | None:
        return next((b for b, h in self.hashes.items() if h == block_hash), None)

    @rule(target=holders, num_blocks=st.integers(min_value=0, max_value=6))
    def allocate(self, num_blocks: int) -> list[int]:
        block_ids = self.allocator.allocate(num_blocks)
        if num_blocks > len(self.free) + len(self.lru):
            assert block_ids is None
            return []
        expected = (self.free + self.lru)[:num_blocks]  # free first, then least recently used
        assert block_ids == expected
        for block_id in expected:
            if block_id in self.free:
                self.free.remove(block_id)
            else:
                self.lru.remove(block_id)
                del self.hashes[block_id]  # evicted: its KV is gone
                event("allocate evicted a cached block")
        self.held.append(block_ids)
        return block_ids

    @rule(target=holders, block_ids=holders)
    def retain(self, block_ids: list[int]) -> list[int]:
        if block_ids not in self.held:
            return []  # that holder was released already
        self.allocator.retain(block_ids)
        self.held.append(list(block_ids))
        return list(block_ids)

    @rule(block_ids=consumes(holders), tail_first=st.booleans())
    def release(self, block_ids: list[int], tail_first: bool) -> None:
        if block_ids not in self.held:
            return
        self.held.remove(block_ids)
        order = list(reversed(block_ids)) if tail_first else list(block_ids)
        self.allocator.release(order)
        remaining = {b: self.expected_refcount(b) for b in set(order)}
        seen: dict[int, int] = {}
        for block_id in order:
            # A block becomes unheld at its last release in this call, if nobody else holds it.
            seen[block_id] = seen.get(block_id, 0) + 1
            if remaining[block_id] == 0 and seen[block_id] == order.count(block_id):
                (self.lru if block_id in self.hashes else self.free).append(block_id)

    @rule(num_blocks=st.integers(min_value=1, max_value=4), first_key=st.integers(min_value=0, max_value=5))
    def request_lifecycle(self, num_blocks: int, first_key: int) -> None:
        """What a request does: allocate, cache its written blocks, release tail first."""
        block_ids = self.allocate(num_blocks)
        for index in range(len(block_ids)):
            self.cache(block_ids, index, (first_key + index) % 6)
        self.release(block_ids, tail_first=True)

    @rule(block_ids=holders, index=st.integers(min_value=0, max_value=5), key=st.integers(min_value=0, max_value=5))
    def cache(self, block_ids: list[int], index: int, key: int) -> None:
        if block_ids not in self.held or not block_ids:
            return
        block_id = block_ids[index % len(block_ids)]
        block_hash = BlockHash(bytes([key]) * 32)
        current = self.hashes.get(block_id)
        if current is not None and current != block_hash:
            with pytest.raises(ValueError):
                self.allocator.cache_full_block(block_id, block_hash)
            return
        owner = self.cached_block(block_hash)
        expected = current is not None or owner is None
        assert self.allocator.cache_full_block(block_id, block_hash) is expected
        event(f"cache_full_block -> {expected}")
        if expected:
            self.hashes[block_id] = block_hash

    @rule(target=holders, data=st.data())
    def lookup_and_touch(self, data: st.DataObject) -> list[int]:
        # Chains mostly of hashes cached now (so hits happen), sometimes a miss.
        known = sorted(set(self.hashes.values())) + [BlockHash(bytes([9]) * 32)]
        chain = data.draw(st.lists(st.sampled_from(known), max_size=4), label="chain")
        expected: list[int] = []
        for block_hash in chain:
            owner = self.cached_block(block_hash)
            if owner is None:
                break
            expected.append(owner)
        assert self.allocator.lookup(chain) == expected
        touched_evictable = len({b for b in expected if b in self.lru})
        assert self.allocator.can_allocate(len(self.free) + len(self.lru) - touched_evictable, touching=expected)
        assert not self.allocator.can_allocate(len(self.free) + len(self.lru) - touched_evictable + 1, expected)
        if not expected:
            return []
        event(f"hit touching evictable: {touched_evictable > 0}")
        self.allocator.touch(expected)
        for block_id in expected:
            if block_id in self.lru:
                self.lru.remove(block_id)
        self.held.append(expected)
        return expected

    @rule()
    def evict_all(self) -> None:
        assert self.allocator.evict_all() == len(self.lru)
        for block_id in self.lru:
            del self.hashes[block_id]
        self.free.extend(self.lru)
        self.lru.clear()

    @invariant()
    def matches_the_model(self) -> None:
        allocator = self.allocator
        allocator.check_invariants(self.held)
        for block_id in range(allocator.num_blocks):
            assert allocator.refcount(block_id) == self.expected_refcount(block_id)
            assert allocator.block_hash(block_id) == self.hashes.get(block_id)
        assert allocator.evictable_blocks() == self.lru
        assert allocator.num_free_blocks == len(self.free) + len(self.lru)
        assert allocator.num_evictable_blocks == len(self.lru)
        assert allocator.num_used_blocks == allocator.num_blocks - len(self.free) - len(self.lru)
        assert allocator.free_kv_bytes == allocator.num_free_blocks * BLOCK_BYTES
        replay_events(self.replayed, allocator.drain_events())
        assert self.replayed == set(allocator.cached_hashes()) == set(self.hashes.values())
        assert len(allocator.cached_hashes()) == allocator.num_cached_blocks

    def teardown(self) -> None:
        for block_ids in self.held:
            self.allocator.release(block_ids)
        self.held.clear()
        self.allocator.check_invariants([])
        # No block leaked: every one is free or evictable, and evicting leaves all free.
        assert self.allocator.num_used_blocks == 0
        assert self.allocator.num_free_blocks == self.allocator.num_blocks
        assert self.allocator.free_kv_bytes == self.allocator.total_kv_bytes
        self.allocator.evict_all()
        assert all(self.allocator.block_state(b) is BlockState.FREE for b in range(self.allocator.num_blocks))


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)

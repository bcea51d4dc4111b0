"""BlockAllocator: exact scenarios with named block ids, then random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from workers.engine.block_allocator import BlockAllocator

BLOCK_BYTES = 1000


def assert_free(allocator: BlockAllocator, num_free: int) -> None:
    allocator.check_invariants()
    assert allocator.num_free_blocks == num_free
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


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / retain / release sequences against a model of holders.

    Each holder is one reference to a list of blocks, as a block table (or a cached
    prefix sharing one) would be. A block's refcount must equal the holders naming it.
    """

    holders = Bundle("holders")

    def __init__(self) -> None:
        super().__init__()
        self.allocator = BlockAllocator(num_blocks=1, block_bytes=BLOCK_BYTES)
        self.held: list[list[int]] = []

    @initialize(num_blocks=st.integers(min_value=1, max_value=12))
    def make_pool(self, num_blocks: int) -> None:
        self.allocator = BlockAllocator(num_blocks=num_blocks, block_bytes=BLOCK_BYTES)

    @rule(target=holders, num_blocks=st.integers(min_value=0, max_value=6))
    def allocate(self, num_blocks: int) -> list[int]:
        free_before = self.allocator.num_free_blocks
        block_ids = self.allocator.allocate(num_blocks)
        if num_blocks > free_before:
            assert block_ids is None
            assert self.allocator.num_free_blocks == free_before
            return []
        assert block_ids is not None and len(block_ids) == num_blocks
        assert len(set(block_ids)) == num_blocks
        assert all(self.allocator.refcount(b) == 1 for b in block_ids)
        assert self.allocator.num_free_blocks == free_before - num_blocks
        self.held.append(block_ids)
        return block_ids

    @rule(target=holders, block_ids=holders)
    def retain(self, block_ids: list[int]) -> list[int]:
        if block_ids not in self.held:
            return []  # that holder was released already
        self.allocator.retain(block_ids)
        self.held.append(list(block_ids))
        return list(block_ids)

    @rule(block_ids=consumes(holders))
    def release(self, block_ids: list[int]) -> None:
        if block_ids not in self.held:
            return
        self.held.remove(block_ids)
        free_before = self.allocator.num_free_blocks
        self.allocator.release(block_ids)
        newly_free = sum(1 for b in set(block_ids) if self.expected_refcount(b) == 0)
        assert self.allocator.num_free_blocks == free_before + newly_free

    def expected_refcount(self, block_id: int) -> int:
        return sum(held.count(block_id) for held in self.held)

    @invariant()
    def refcounts_match_holders(self) -> None:
        self.allocator.check_invariants()
        for block_id in range(self.allocator.num_blocks):
            assert self.allocator.refcount(block_id) == self.expected_refcount(block_id)
        assert self.allocator.free_kv_bytes == self.allocator.num_free_blocks * BLOCK_BYTES

    def teardown(self) -> None:
        for block_ids in self.held:
            self.allocator.release(block_ids)
        self.held.clear()
        self.allocator.check_invariants()
        assert self.allocator.num_free_blocks == self.allocator.num_blocks
        assert self.allocator.free_kv_bytes == self.allocator.total_kv_bytes


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

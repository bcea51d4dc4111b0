"""The router's prefix index (which worker holds which block) and the `prefix` policy."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.placement import CacheHits, PrefixPolicy, PrefixWeights, WorkerView
from router.prefix_index import PrefixIndex
from workers.messages import KVEventBatch, KVSnapshot
from tests.test_placement import _cached_view, _view
from workers.engine.block_hash import BlockHash, hash_blocks
from workers.engine.shared_prefix import SharedPrefixes

H = hash_blocks(list(range(64)), 16)  # four chained hashes h0..h3


def _index(**stored: list[BlockHash]) -> PrefixIndex:
    index = PrefixIndex()
    for worker_id, hashes in stored.items():
        index.reset(worker_id, KVSnapshot(seq=0, hashes=tuple(hashes)))
    return index


def test_hits_count_leading_blocks_and_a_chain_breaks_at_its_first_miss() -> None:
    index = _index(w0=[H[0], H[1], H[2]], w1=[H[0], H[2], H[3]], w3=[H[1], H[2]])
    index.predict("w2", H[:2], now=0.0)
    assert index.hits(H, now=1.0) == {"w0": 3, "w1": 1, "w2": 2}
    assert index.hits(H, now=5.0) == {"w0": 3, "w1": 1}  # the prediction lapsed
    index.check_invariants()


def test_events_apply_in_order_and_a_gap_asks_for_a_resync() -> None:
    index = _index(w0=[])
    assert index.apply("w0", KVEventBatch(1, ((True, H[0]), (True, H[1]))))
    assert index.hits(H) == {"w0": 2}
    assert index.apply("w0", KVEventBatch(2, ((False, H[1]),)))
    assert index.hits(H) == {"w0": 1}
    assert not index.apply("w0", KVEventBatch(4, ((True, H[1]),)))  # batch 3 was lost
    assert index.hits(H) == {"w0": 1}  # nothing of batch 4 applied
    assert not index.apply("w9", KVEventBatch(1, ((True, H[0]),)))  # never synced
    index.reset("w0", KVSnapshot(seq=4, hashes=(H[0], H[1], H[2])))
    assert index.hits(H) == {"w0": 3} and index.apply("w0", KVEventBatch(5, ()))
    assert index.apply("w0", KVEventBatch(3, ((False, H[0]),)))  # in the snapshot already: ignored
    assert index.hits(H) == {"w0": 3}
    index.check_invariants()


def test_a_forgotten_worker_holds_nothing_at_once() -> None:
    index = _index(w0=list(H), w1=list(H[:1]))
    index.predict("w0", H)
    index.forget("w0")  # e.g. its actor died: a Ray-restarted one starts empty
    assert index.hits(H) == {"w1": 1}
    assert not index.synced("w0")
    index.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["w0", "w1"]), st.booleans(), st.integers(0, 3)), max_size=40))
def test_the_index_equals_replaying_the_events(operations: list[tuple[str, bool, int]]) -> None:
    index = _index(w0=[], w1=[])
    truth: dict[str, set[BlockHash]] = {"w0": set(), "w1": set()}
    seq = {"w0": 0, "w1": 0}
    for worker_id, stored, block in operations:
        seq[worker_id] += 1
        assert index.apply(worker_id, KVEventBatch(seq[worker_id], ((stored, H[block]),)))
        (truth[worker_id].add if stored else truth[worker_id].discard)(H[block])
        index.check_invariants()
    for worker_id, held in truth.items():
        expected = next((i for i, h in enumerate(H) if h not in held), len(H))
        assert index.hits(H).get(worker_id, 0) == expected


def _views(*headrooms: int, total: int = 100) -> list[WorkerView]:
    return [_view(f"w{i}", total, committed=total - headroom) for i, headroom in enumerate(headrooms)]


def test_prefix_goes_where_the_prompt_is_cached_if_it_has_room() -> None:
    w0, w1 = _views(60, 90)
    policy = PrefixPolicy(max_outstanding=64)
    assert policy.choose([w0, w1], 10, CacheHits(8, {"w0": 8})) is w0
    # Without hits it is the kv policy: the most free share.
    assert policy.choose([w0, w1], 10, CacheHits(8, {})) is w1
    assert policy.choose([w0, w1], 10, None) is w1
    # No room for what it would add there: never placed there, however cached.
    w0.place("other", 59)  # headroom 1
    assert policy.choose([w0, w1], 10, CacheHits(8, {"w0": 8})) is w1
    w1.place("other", 90)
    assert policy.choose([w0, w1], 10, CacheHits(8, {"w0": 8})) is None
    # Room is judged on the whole need: a cached block nobody holds is committed again.
    w0.release("other")
    w0.place("other", 58)  # headroom 2
    assert policy.choose([w0, w1], 10, CacheHits(8, {"w0": 8})) is None
    w0.release("other")
    w0.place("other", 50)  # headroom 10: just room
    assert policy.choose([w0, w1], 10, CacheHits(8, {"w0": 8})) is w0


def test_prefix_never_piles_a_burst_on_one_hot_worker() -> None:
    """A burst of one shared prefix: the first lands anywhere, the next follow it while the
    load stays within the balance bounds, then the rest spread."""
    views = _views(100, 100, 100, 100)
    weights = PrefixWeights(balance_abs=4, balance_rel=1.5)
    policy = PrefixPolicy(max_outstanding=64, weights=weights)
    index = PrefixIndex()
    placed: dict[str, int] = {}
    for n in range(40):
        hits = CacheHits(4, index.hits(H))
        chosen = policy.choose(views, 5, hits)
        assert chosen is not None
        chosen.place(f"r{n}", 5)
        index.predict(chosen.worker_id, H)
        placed[chosen.worker_id] = placed.get(chosen.worker_id, 0) + 1
    assert len(placed) == 4, placed
    assert max(placed.values()) - min(placed.values()) <= weights.balance_abs + 1, placed


def test_prefix_counts_the_cached_blocks_a_placement_would_evict() -> None:
    """bench-prefix's miss: w0's 236 blocks hold four groups' prefixes and 33 of the
    prompt's 71 blocks (a tail evicted by the others); w1 holds two groups and has clean
    room. Counting only the hit, w0 wins and its groups go on evicting each other; counting
    the 39 blocks placing there would evict (its clean free blocks: none), w1 wins."""
    need, prompt_blocks, hit = 72, 71, 33

    def views() -> list[WorkerView]:
        return [_cached_view("w0", 236, committed=20, evictable=216),
                _cached_view("w1", 236, committed=20, evictable=132)]

    hits = CacheHits(prompt_blocks, {"w0": hit})
    w0, w1 = views()
    assert PrefixPolicy(64, PrefixWeights(evict_weight=0)).choose([w0, w1], need, hits) is w0
    w0, w1 = views()
    assert PrefixPolicy(64).choose([w0, w1], need, hits) is w1  # evict_weight 1, the default
    # With clean room for its new blocks on w0 nothing is evicted: the hit wins again.
    w0, w1 = _cached_view("w0", 236, committed=20, evictable=170), views()[1]
    assert PrefixPolicy(64).choose([w0, w1], need, hits) is w0
    # A full hit evicts at most its new blocks, and still goes where it is cached.
    w0, w1 = views()
    assert PrefixPolicy(64).choose([w0, w1], need, CacheHits(prompt_blocks, {"w0": prompt_blocks})) is w0


def test_weights_are_validated() -> None:
    with pytest.raises(ValueError, match="balance_rel"):
        PrefixWeights(balance_rel=0.5)
    with pytest.raises(ValueError, match="prefix_weight"):
        PrefixWeights(prefix_weight=-1)
    with pytest.raises(ValueError, match="evict_weight"):
        PrefixWeights(evict_weight=-0.5)


LONG = hash_blocks(list(range(25 * 16)), 16)  # a 25-block prompt prefix


def _caching_view(worker_id: str, total: int, committed: int = 0) -> WorkerView:
    view = _view(worker_id, total, committed)
    view.info = dataclasses.replace(view.info, prefix_caching=True)
    return view


def test_shared_prefixes_count_the_leading_run_of_held_hashes() -> None:
    prompts = SharedPrefixes()
    assert prompts.shared(H) == 0 and prompts.charge(10, H) == 10
    prompts.add("a", H[:3])
    prompts.add("b", H[:2])
    assert prompts.shared(H) == 3 and prompts.charge(10, H) == 7
    other = hash_blocks(list(range(16)) + list(range(500, 548)), 16)  # h0, then a chain of its own
    assert other[0] == H[0] and prompts.shared(other) == 1
    prompts.remove("a")
    assert prompts.shared(H) == 2
    prompts.add("b", H[:1])  # sent again: its hashes are replaced, not added twice
    prompts.remove("b")
    prompts.remove("never-added")
    assert prompts.shared(H) == 0 and len(prompts) == 0


def test_sharers_of_a_long_prompt_on_one_worker_are_charged_its_blocks_once() -> None:
    """A 30-block request of which 25 are a shared system prompt: whole-need counting fits
    three on a 100-block worker, charging the shared blocks once fits fifteen."""
    blind, caching = _view("w0", 100), _caching_view("w1", 100)
    assert [blind.place(f"r{i}", 30, LONG) for i in range(3)] == [30, 30, 30] and blind.headroom_blocks == 10
    charges = [caching.place(f"r{i}", 30, LONG) for i in range(15)]
    assert charges == [30] + [5] * 14 and caching.headroom_blocks == 0
    # A prompt sharing only the first 10 blocks is charged the other 20.
    assert caching.charge(30, LONG[:10] + hash_blocks(list(range(900, 1140)), 16)) == 20
    # The first sharer ends: the others still hold the prefix.
    caching.release("r0")
    assert caching.charge(30, LONG) == 5
    for i in range(1, 15):
        caching.release(f"r{i}")
    assert caching.charge(30, LONG) == 30 and caching.headroom_blocks == 100


def test_prefix_places_a_fourth_sharer_where_its_prompt_is_though_its_whole_need_would_not_fit() -> None:
    hot, cold = _caching_view("w0", 100), _caching_view("w1", 100)
    policy = PrefixPolicy(max_outstanding=64)
    index = PrefixIndex()
    placed = []
    for n in range(6):
        hits = CacheHits(len(LONG), index.hits(LONG), LONG)
        chosen = policy.choose([hot, cold], 30, hits)
        assert chosen is not None
        chosen.place(f"r{n}", 30, LONG)
        index.predict(chosen.worker_id, LONG)
        placed.append(chosen.worker_id)
    assert placed == ["w0"] * 6 and hot.headroom_blocks == 100 - 30 - 5 * 5


@settings(max_examples=200, deadline=None)
@given(
    held=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 8)), max_size=6),
    query=st.tuples(st.integers(0, 3), st.integers(0, 8)),
    hint=st.integers(-1, 10),
)
def test_shared_is_the_leading_run_of_a_chain_however_it_is_found(
    held: list[tuple[int, int]], query: tuple[int, int], hint: int
) -> None:
    """Requests hold chains (prompt_block_hashes); four roots, each chain any length, some
    sharing a root: shared() (a bisection) equals walking the query's chain to its first miss."""
    chains = [hash_blocks([root] * 16 + list(range(1000 * root, 1000 * root + 8 * 16)), 16) for root in range(4)]
    prompts = SharedPrefixes()
    for i, (root, length) in enumerate(held):
        prompts.add(f"r{i}", chains[root][:length])
    asked = chains[query[0]][: query[1]]
    every = {h for root, length in held for h in chains[root][:length]}
    walk = next((i for i, h in enumerate(asked) if h not in every), len(asked))
    assert prompts.shared(asked) == walk
    assert prompts.shared(asked, hint) == walk  # a hint, right or wrong, changes nothing


def test_the_prefix_weights_come_from_the_flags_of_kvserve_up_and_router() -> None:
    from cluster.cli import build_parser
    from cluster.up import router_config_from_args

    default = router_config_from_args(build_parser().parse_args(["up", "--model", "tiny"])).prefix_weights
    assert default == PrefixWeights()
    args = ["--prefix-weight", "2", "--load-weight", "0.5", "--evict-weight", "0", "--balance-abs", "3",
            "--balance-rel", "2"]
    for command in (["up", "--model", "tiny"], ["router", "--ray-address", "auto", "--redis-url", "redis://x"]):
        weights = router_config_from_args(build_parser().parse_args([*command, *args])).prefix_weights
        assert weights == PrefixWeights(prefix_weight=2, load_weight=0.5, evict_weight=0, balance_abs=3, balance_rel=2)

"""PrefixIndex.hits, which runs on every placement, against the plain definition: a worker's
count is the length of the longest leading run of the hashes it holds or is predicted to
hold (predictions count until they lapse, and a lapsed one is forgotten)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.prefix_index import PrefixIndex
from workers.engine.block_hash import BlockHash, hash_blocks
from workers.messages import KVSnapshot

H = hash_blocks(list(range(6 * 4)), 4)  # six chained hashes
WORKERS = ("w0", "w1", "w2", "w3")


def reference_hits(
    stored: dict[str, set[BlockHash]], predicted: dict[str, dict[BlockHash, float]], hashes: list[BlockHash], now: float
) -> dict[str, int]:
    hits: dict[str, int] = {}
    for worker_id in WORKERS:
        held = stored.get(worker_id, set()) | {h for h, at in predicted.get(worker_id, {}).items() if at > now}
        count = 0
        while count < len(hashes) and hashes[count] in held:
            count += 1
        if count:
            hits[worker_id] = count
    return hits


@settings(max_examples=200, deadline=None)
@given(
    stored=st.dictionaries(st.sampled_from(WORKERS), st.sets(st.integers(0, 5)), max_size=4),
    predictions=st.lists(
        st.tuples(st.sampled_from(WORKERS), st.lists(st.integers(0, 5), max_size=6), st.floats(0.0, 4.0)), max_size=5
    ),
    query=st.lists(st.integers(0, 5), max_size=6),
    now=st.floats(0.0, 8.0),
)
def test_hits_equal_the_longest_leading_run(
    stored: dict[str, set[int]],
    predictions: list[tuple[str, list[int], float]],
    query: list[int],
    now: float,
) -> None:
    index = PrefixIndex(prediction_ttl_s=2.0)
    for worker_id, blocks in stored.items():
        index.reset(worker_id, KVSnapshot(0, tuple(H[b] for b in blocks)))
    expires: dict[str, dict[BlockHash, float]] = {}
    for worker_id, predicted_blocks, at in predictions:
        index.predict(worker_id, [H[b] for b in predicted_blocks], now=at)
        for b in predicted_blocks:
            expires.setdefault(worker_id, {})[H[b]] = at + 2.0
    hashes = [H[b] for b in query]
    truth = reference_hits({w: {H[b] for b in bs} for w, bs in stored.items()}, expires, hashes, now)
    assert index.hits(hashes, now=now) == truth
    assert index.hits(hashes, now=now) == truth  # pruning lapsed predictions changed nothing
    index.check_invariants()

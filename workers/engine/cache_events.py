"""What changed in the prefix cache's hash map since someone last asked.

The allocator records here every hash that becomes findable (stored) and every hash it
drops (evicted); a worker drains the log after each step and publishes it, and the
router's index (router/prefix_index.py) replays it. Replayed in order onto the map as
it stood at the previous drain, a drained list gives the map as it stands now.

The log keeps the net change, not the history. A hash's events alternate (it is stored
only while absent and evicted only while present), so a second event for a hash still
in the log cancels the first and both go:

    map at the last drain:  {h0}
    events since:           evict h0, store h1, store h0, evict h1, store h2
    log:                    h0 and h1 each cancel out; h2 stored
    drain ->                [(True, h2)]          map now: {h0, h2}

So the log never holds more than the hashes mapped at the last drain plus those mapped
now, at most twice the pool, however long nobody drains it.
"""

from __future__ import annotations

from workers.engine.block_hash import BlockHash

CacheEvent = tuple[bool, BlockHash]
"""(stored, block_hash): True, the block became findable; False, its hash was dropped."""


class CacheEventLog:
    """The hash map's net changes since the last drain(), oldest first."""

    def __init__(self) -> None:
        self._pending: dict[BlockHash, bool] = {}  # insertion order is event order

    def __len__(self) -> int:
        return len(self._pending)

    def record(self, stored: bool, block_hash: BlockHash) -> None:
        """block_hash was just stored in (True) or dropped from (False) the hash map."""
        previous = self._pending.pop(block_hash, None)
        if previous is None:
            self._pending[block_hash] = stored
        else:
            assert previous is not stored, f"hash {block_hash.hex()[:12]} {'stored' if stored else 'evicted'} twice"

    def drain(self) -> list[CacheEvent]:
        """The changes since the last call, in order; the log is empty afterwards."""
        events = [(stored, block_hash) for block_hash, stored in self._pending.items()]
        self._pending.clear()
        return events

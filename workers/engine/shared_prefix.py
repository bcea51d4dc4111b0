"""How much of a new request's KV a worker already has committed for others: the prompt
blocks of the unfinished requests sent there, counted by hash.

A request placed on a worker whose unfinished requests share its prompt's first blocks
does not commit those blocks again: they are held, or will be, by the request that
brought them, and the prefix cache hands the same blocks to the newcomer. Counting its
whole need instead caps a worker at total / need concurrent sharers of one long system
prompt (three of a 1,000-token prompt on a 236-block worker in `make bench-prefix`),
however little each adds.

The router's view of a worker (router/placement.py, this router's requests) and the
worker actor's commit ledger (workers/actor.py, every router's) both charge a request
this way, and the engine's own count (EngineStats.num_committed_blocks) agrees once the
request is in a report:

    placed: a  h0 h1 h2           new request b: h0 h1 h3 h4
    charge(b) = need(b) - 2       (h0 h1: the chain's first miss, h3, ends the sharing)

Chained hashes (workers/engine/block_hash.py) make a matching block imply a matching
prefix, so the leading run of known hashes is the shared part.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from workers.engine.block_hash import BlockHash


class SharedPrefixes:
    """The prompt block hashes of unfinished requests, each with how many hold it."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, int] = {}
        self._hashes: dict[str, Sequence[BlockHash]] = {}

    def __len__(self) -> int:
        return len(self._hashes)

    def shared(self, block_hashes: Sequence[BlockHash], hint: int = 0) -> int:
        """Leading blocks of a prompt that some request here already holds or will hold.

        block_hashes is a prompt's chain from its first block (prompt_block_hashes), as is
        every request's here, so a held hash means its whole prefix is held (the request
        holding it holds the blocks before it, whose hashes it chains): along the chain the
        held blocks come first, and the first miss is found by bisection, in log2(n)
        lookups. The placement policy asks this of every worker holding the prompt.

        hint: a guess (the blocks the worker's cache holds of the prompt, usually the same
        run), checked in two lookups before any bisection."""
        holders = self._holders
        if not holders or not block_hashes or block_hashes[0] not in holders:
            return 0
        num_blocks = len(block_hashes)
        if 0 < hint <= num_blocks and block_hashes[hint - 1] in holders and (
            hint == num_blocks or block_hashes[hint] not in holders
        ):
            return hint
        return bisect.bisect_left(range(len(block_hashes)), True, key=lambda i: block_hashes[i] not in holders)

    def charge(self, need_blocks: int, block_hashes: Sequence[BlockHash], hint: int = 0) -> int:
        """What a request needing need_blocks at its longest newly commits here (hint: see shared)."""
        return need_blocks - self.shared(block_hashes, hint)

    def add(self, request_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """The request is here now (again: its earlier hashes are replaced)."""
        self.remove(request_id)
        if not block_hashes:
            return
        self._hashes[request_id] = block_hashes
        holders = self._holders
        for block_hash in block_hashes:
            holders[block_hash] = holders.get(block_hash, 0) + 1

    def remove(self, request_id: str) -> None:
        """The request ended or left; unknown ids are ignored."""
        block_hashes = self._hashes.pop(request_id, None)
        if block_hashes is None:
            return
        holders = self._holders
        for block_hash in block_hashes:
            left = holders[block_hash] - 1
            if left:
                holders[block_hash] = left
            else:
                del holders[block_hash]

"""Chained hashes of full KV blocks: the keys of the prefix cache.

A block's hash names everything its KV depends on: the tokens before it (through its
parent's hash), its own token ids, and extra keys such as a tenant's cache salt. Two
blocks with equal hashes therefore hold the same KV, and one can serve for the other.

    block_size 4
    token_ids:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    hashes:     h0          | h1          | (not full: no hash)
    h0 = H(root, [t0 t1 t2 t3], extra_keys)
    h1 = H(h0,   [t4 t5 t6 t7], extra_keys)

Why SHA-256 and not Python's hash() or xxhash: a collision here is not a slow lookup,
it silently hands one request another request's KV, which is wrong output and, across
tenants, a data leak. Fast non-cryptographic hashes collide by accident at scale and
can be made to collide on purpose by anyone who picks their prompt; Python's hash() is
also salted per process, so a router and a worker would disagree. vLLM and SGLang
moved their prefix caches to SHA-256 after collision reports. The cost is well under a
microsecond per token, small beside the forward pass that one hit saves.

The encoding is canonical and length-prefixed (no two different inputs give the same
bytes), little-endian, and independent of the platform, so any process (the router
included: this module imports only the standard library) computes the same hashes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""The 32-byte SHA-256 digest of one full block and its chain."""

ExtraKey = str | int | bytes
"""Something besides the tokens that a block's KV depends on (a cache salt, a LoRA id)."""

_DOMAIN = b"kvserve.block_hash.v1\x00"  # versioned: a new encoding must never match an old hash
_MAX_TOKEN_ID = 2**64 - 1


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()) -> BlockHash:
    """The hash of one full block: its parent's hash (None for the first block), its token
    ids, and its extra keys. Raises ValueError for a token id outside [0, 2**64)."""
    digest = hashlib.sha256(_DOMAIN)
    if parent is None:
        digest.update(b"\x00")
    else:
        digest.update(b"\x01")
        digest.update(parent)
    digest.update(len(token_ids).to_bytes(4, "little"))
    try:
        digest.update(struct.pack(f"<{len(token_ids)}Q", *token_ids))
    except struct.error as exc:
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID), None)
        raise ValueError(f"hash_block: token ids must be integers in [0, 2**64), got {bad!r}") from exc
    digest.update(len(extra_keys).to_bytes(4, "little"))
    for key in extra_keys:
        digest.update(_encode_extra_key(key))
    return BlockHash(digest.digest())


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[ExtraKey] = (),
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of token_ids, chained from parent.

    token_ids must start at a block boundary; parent is the hash of the block just
    before token_ids[0] (None when token_ids starts at position 0). A trailing partial
    block gets no hash. To hash a growing sequence incrementally, use
    extend_block_hashes.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"hash_blocks: block_size must be a positive integer, got {block_size!r}")
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


def request_extra_keys(cache_salt: str | None) -> tuple[ExtraKey, ...]:
    """The extra keys of every block of a request with this cache salt. The engine hashes
    requests' blocks with these; anyone predicting its hits (the router) must too."""
    return () if cache_salt is None else (cache_salt,)


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[ExtraKey] = (),
) -> int:
    """Append to block_hashes (the hashes of token_ids' first full blocks) the hashes of
    the blocks that have filled since; each block is hashed once. Returns how many.

        block_size 4, len(block_hashes) 1, len(token_ids) 10
        token_ids:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
                    (have h0)   | new: h1     | not full
    """
    start = len(block_hashes) * block_size
    assert start <= len(token_ids), "block_hashes covers more blocks than token_ids has"
    parent = block_hashes[-1] if block_hashes else None
    new = hash_blocks(token_ids[start:], block_size, extra_keys, parent)
    block_hashes.extend(new)
    return len(new)


def _encode_extra_key(key: ExtraKey) -> bytes:
    """A type tag, a length, then the value: "a" + "bc" and "ab" + "c" never meet."""
    if isinstance(key, bool):
        raise ValueError(f"hash_block: an extra key must be str, int or bytes, got {key!r}")
    if isinstance(key, str):
        raw, tag = key.encode("utf-8"), b"s"
    elif isinstance(key, bytes):
        raw, tag = key, b"b"
    elif isinstance(key, int):
        raw, tag = str(key).encode("ascii"), b"i"
    else:
        raise ValueError(f"hash_block: an extra key must be str, int or bytes, got {key!r}")
    return tag + len(raw).to_bytes(4, "little") + raw

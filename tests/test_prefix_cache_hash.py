"""Block hashes: chained, canonical, salted, incremental, and free of heavy imports."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.engine.block_hash import BlockHash, extend_block_hashes, hash_block, hash_blocks, request_extra_keys

TOKENS = list(range(100, 110))  # 10 tokens: two full blocks of 4 and a partial one


def test_only_full_blocks_are_hashed_and_each_chains_on_its_parent() -> None:
    hashes = hash_blocks(TOKENS, 4)
    assert len(hashes) == 2
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    assert hashes[0] == hash_block(None, TOKENS[0:4])
    assert hashes[1] == hash_block(hashes[0], TOKENS[4:8])
    assert hash_blocks(TOKENS[:3], 4) == []
    assert hash_blocks(TOKENS, 1) == list(_chain(TOKENS, 1))


def _chain(tokens: list[int], block_size: int) -> list[BlockHash]:
    parent: BlockHash | None = None
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        out.append(parent)
    return out


def test_a_block_depends_on_everything_before_it() -> None:
    same_block_other_prefix = [999] + TOKENS[1:]
    assert hash_blocks(same_block_other_prefix, 4)[1] != hash_blocks(TOKENS, 4)[1]
    # The same four tokens as a first block and as a second block are different blocks.
    assert hash_block(None, TOKENS[4:8]) != hash_blocks(TOKENS, 4)[1]


def test_extra_keys_separate_tenants_and_encode_unambiguously() -> None:
    plain = hash_blocks(TOKENS, 4)
    salted = hash_blocks(TOKENS, 4, extra_keys=("tenant-a",))
    assert hash_blocks(TOKENS, 4, extra_keys=("tenant-a",)) == salted
    assert salted[0] != plain[0] and salted[1] != plain[1]
    assert hash_blocks(TOKENS, 4, extra_keys=("tenant-b",))[0] != salted[0]
    assert hash_block(None, TOKENS[:4], ("ab", "c")) != hash_block(None, TOKENS[:4], ("a", "bc"))
    assert hash_block(None, TOKENS[:4], ("1",)) != hash_block(None, TOKENS[:4], (1,))
    assert hash_block(None, TOKENS[:4], (b"x",)) != hash_block(None, TOKENS[:4], ("x",))
    assert hash_block(None, TOKENS[:4], ("",)) != hash_block(None, TOKENS[:4], ())
    # Token ids are length-prefixed: [1, 2] + key never meets [1] + something else.
    assert hash_block(None, [1, 2]) != hash_block(None, [1])


def test_the_encoding_is_sha256_over_fixed_bytes() -> None:
    # Pinned, so a router on another machine (or a later version) can rely on it.
    expected = hashlib.sha256(
        b"kvserve.block_hash.v1\x00" + b"\x00" + (2).to_bytes(4, "little")
        + (7).to_bytes(8, "little") + (300).to_bytes(8, "little") + (0).to_bytes(4, "little")
    ).digest()
    assert hash_block(None, [7, 300]) == expected


def test_request_extra_keys_are_the_salt_alone() -> None:
    assert request_extra_keys(None) == ()
    assert request_extra_keys("tenant") == ("tenant",)


def test_parent_continues_a_chain() -> None:
    whole = hash_blocks(TOKENS[:8], 4)
    assert hash_blocks(TOKENS[4:8], 4, parent=whole[0]) == whole[1:]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks(TOKENS, 0)
    with pytest.raises(ValueError, match="token ids"):
        hash_block(None, [1, -1])
    with pytest.raises(ValueError, match="token ids"):
        hash_block(None, [2**64])
    with pytest.raises(ValueError, match="extra key"):
        hash_block(None, [1], (True,))
    with pytest.raises(ValueError, match="extra key"):
        hash_block(None, [1], (1.5,))  # type: ignore[arg-type]


@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**20), max_size=40),
    block_size=st.integers(min_value=1, max_value=6),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=6),
)
def test_incremental_hashing_equals_hashing_at_once(tokens: list[int], block_size: int, cuts: list[int]) -> None:
    hashes: list[BlockHash] = []
    num_new = 0
    for cut in sorted(cuts) + [len(tokens)]:
        num_new += extend_block_hashes(hashes, tokens[: min(cut, len(tokens))], block_size, ("salt",))
    assert hashes == hash_blocks(tokens, block_size, ("salt",))
    assert num_new == len(tokens) // block_size


def test_the_module_imports_only_the_standard_library() -> None:
    """The router will import it: nothing heavy, nothing from the rest of kvserve."""
    source = Path(__file__).resolve().parent.parent / "workers" / "engine" / "block_hash.py"
    tree = ast.parse(source.read_text())
    modules = {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert modules <= {"__future__", "hashlib", "struct", "collections.abc", "typing"}

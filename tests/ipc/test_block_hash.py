"""External block hashes against the recipe, computed here independently with cbor2 + hashlib:
sha256(canonical CBOR of (parent digest or NONE_HASH, block tokens, extra keys)), NONE_HASH from
the seed "vllm-none-hash", the low 64 bits big-endian as the id, the salt in the first block."""

from __future__ import annotations

import hashlib

import cbor2
import pytest

from ipc.block_hash import NONE_HASH, BlockHasher, block_hashes, check_cache_salt, next_block_digest
from ipc.codec import pack_ids

TOKENS = list(range(1000, 1040))  # two full blocks of 16 and 8 tokens that are never hashed


def recipe(token_ids, block_size, salt=None):
    none = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    ids, parent = [], none
    for i in range(len(token_ids) // block_size):
        extra = (salt,) if salt is not None and i == 0 else None
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(cbor2.dumps([parent, list(block), extra], canonical=True)).digest()
        ids.append(int.from_bytes(parent, "big") % 2**64)
    return ids


def test_first_and_chained_blocks_follow_the_recipe():
    expected = recipe(TOKENS, 16)
    assert len(expected) == 2
    assert block_hashes(TOKENS, 16) == expected
    assert BlockHasher(16).hashes(TOKENS) == expected
    assert NONE_HASH == hashlib.sha256(b"\x6evllm-none-hash").digest()  # CBOR text, 14 bytes
    # Pinned, so that a change of recipe shows even if this test's copy changed with it.
    assert expected[0] == 0x3417567050A24FDC
    assert block_hashes(TOKENS, 16, "tenant-a")[0] == 0xABB89FF21E94E3B9
    assert all(0 <= h < 2**64 for h in expected)


def test_salt_changes_the_first_block_and_every_later_one():
    plain, salted, other = (
        block_hashes(TOKENS * 2, 16, salt) for salt in (None, "tenant-a", "tenant-b")
    )
    assert salted == recipe(TOKENS * 2, 16, "tenant-a")
    assert len(plain) == 5
    assert all(p != s != o != p for p, s, o in zip(plain, salted, other))
    assert BlockHasher(16).hashes(TOKENS * 2, "tenant-a") == salted


def test_incremental_form_equals_the_whole_prompt_form():
    first = next_block_digest(None, TOKENS[:16], "s")
    second = next_block_digest(first, TOKENS[16:32], "s")  # the salt is only in the first block
    assert [int.from_bytes(d[-8:], "big") for d in (first, second)] == block_hashes(TOKENS, 16, "s")


def test_memo_returns_what_hashing_returns_and_stays_bounded():
    hasher = BlockHasher(4, memo_blocks=16)
    prompts = [[i % 7, i % 5] * 20 + list(range(i)) for i in range(40)]
    for prompt in prompts + prompts[::-1]:
        assert hasher.hashes(prompt) == recipe(prompt, 4)
        assert hasher.hashes(pack_ids(prompt)) == recipe(prompt, 4)
        assert hasher.hashes(prompt, "x") == recipe(prompt, 4, "x")
        assert len(hasher) <= 16
    warm = BlockHasher(4)
    warm.hashes(prompts[9])
    assert warm.hashes(prompts[9] + [1, 2, 3, 4]) == recipe(prompts[9] + [1, 2, 3, 4], 4)
    assert (warm.hits, warm.misses) == (len(prompts[9]) // 4, len(prompts[9]) // 4 + 1)
    assert hasher.hashes([1, 2, 3]) == []  # no full block


@pytest.mark.parametrize("bad", ["", "x" * 257, 3, b"salt", "\ud800"])
def test_cache_salt_is_validated(bad):
    with pytest.raises(ValueError, match="cache_salt"):
        check_cache_salt(bad)
    assert check_cache_salt(None) is None and check_cache_salt("x" * 256) == "x" * 256


def test_a_hasher_learns_announced_blocks_and_then_hashes_their_prompts_from_its_memo():
    """What one worker hashed (or an engine stored) and announced as a BlockStored, another
    learns: its hashes of a prompt holding those blocks are the same ids with no block hashed
    on the request's path. A salted chain is not learned (the event does not carry the salt),
    nor a chain whose parent it does not know."""
    tokens = list(range(1000, 1000 + 5 * 16))
    ids = block_hashes(tokens, 16)
    learner = BlockHasher(16)
    assert learner.learn(None, ids[:3], tokens[: 3 * 16]) == 3
    assert learner.learn(ids[2], ids[3:], tokens[3 * 16 :]) == 2  # a later step's continuation
    misses = learner.misses
    assert learner.hashes(tokens + [7] * 9) == ids and learner.misses == misses
    salted = block_hashes(tokens, 16, cache_salt="tenant")
    assert learner.learn(None, salted[:2], tokens[:32]) == 0
    assert BlockHasher(16).learn(ids[0], ids[1:2], tokens[16:32]) == 0  # unknown parent

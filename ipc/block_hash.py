"""External block hashes: ids for full KV blocks that any process can recompute from token ids.

The recipe is vLLM's ``sha256_cbor`` prefix-cache hash, so that KV-event consumers built for vLLM
(llm-d, Dynamo, Ray's KV-aware router) and our own tokenizer workers agree with the engines:

    digest_0 = sha256(canonical_cbor((NONE_HASH, tuple(tokens_0), extra_0)))
    digest_i = sha256(canonical_cbor((digest_{i-1}, tuple(tokens_i), None)))

with ``NONE_HASH`` the digest of the CBOR text "vllm-none-hash" (vLLM's seed for cryptographic
hashes when PYTHONHASHSEED is unset) and ``extra_0 = (cache_salt,)`` for a salted request, else
None. A digest names a block together with its whole prefix (and salt). Events and routing use
its low 64 bits as an unsigned integer, the block's *external id*. Only full blocks are hashed.

These ids are for routing and for outside consumers. The engine's own prefix-cache matching
stays exact (token ids and parent verified), whatever these hashes do.

Cost: one block is a few microseconds (CBOR + SHA-256), hundreds for a 2k-token prompt. A
tokenizer worker hashes every prompt, and multi-turn chats resend their history, so
``BlockHasher`` remembers recent (parent, tokens) -> digest pairs in a bounded LRU.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

import cbor2

NONE_HASH_SEED = "vllm-none-hash"
NONE_HASH: bytes = hashlib.sha256(cbor2.dumps(NONE_HASH_SEED, canonical=True)).digest()
EXTERNAL_ID_BITS = 64
MAX_CACHE_SALT_CHARS = 256
DEFAULT_MEMO_BLOCKS = 1 << 16  # ~20 MB of memo at 16-token blocks: 512 chats of 2k tokens


def check_cache_salt(value: object) -> str | None:
    """A request's cache_salt: None, or a non-empty string of at most 256 characters that
    encodes as UTF-8 (it is hashed as CBOR text). Raises ValueError naming the field."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
            f"characters, got {value!r:.80}"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("cache_salt is not valid Unicode (a lone surrogate)") from None
    return value


def first_block_extra(cache_salt: str | None) -> tuple[str] | None:
    """The extra keys of a request's first block (vLLM puts the salt there and only there)."""
    return (cache_salt,) if cache_salt else None


def block_digest(parent: bytes | None, tokens: Sequence[int], extra: tuple | None = None) -> bytes:
    """The 32-byte digest of one full block after the prefix whose digest is ``parent`` (None:
    the block starts the prompt)."""
    payload = (parent or NONE_HASH, tuple(tokens), extra)
    return hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()


def external_id(digest: bytes) -> int:
    """The id events and routing use: the digest's low 64 bits, read big-endian, unsigned."""
    return int.from_bytes(digest[-EXTERNAL_ID_BITS // 8 :], "big")


def next_block_digest(
    parent: bytes | None, tokens: Sequence[int], cache_salt: str | None = None
) -> bytes:
    """The incremental form (the engine hashes one new full block at a time): the digest of the
    block after the prefix whose digest is ``parent``; None is the prompt's start, the block
    that carries the salt."""
    return block_digest(parent, tokens, first_block_extra(cache_salt) if parent is None else None)


def block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[int]:
    """The external ids of every full block of ``token_ids`` (no memo; see BlockHasher)."""
    ids: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = next_block_digest(parent, token_ids[start : start + block_size], cache_salt)
        ids.append(external_id(parent))
    return ids


class BlockHasher:
    """``block_hashes`` with a bounded memo of (parent digest, block tokens, extra) -> digest,
    for a process that hashes many prompts sharing prefixes (a tokenizer worker).

    The memo key is the hash's whole input (the parent's 32-byte digest followed by the block's
    packed int32 ids; a salted first block keys on its salt too), so a hit returns exactly what
    hashing would. Eviction is least-recently-used in two generations: a hit in the older one
    moves the entry to the younger; when the younger fills, it becomes the older and the older is
    dropped. That keeps a hit at one or two dict probes (an OrderedDict's move_to_end doubled
    the warm cost) and the memo within ``memo_blocks`` entries.

    ``learn`` fills the memo from another process's stored blocks (a KV event's BlockStored), so
    a worker that never saw a prompt before (several workers take a conversation's turns in
    turn) still finds its history there instead of hashing it on the request's path."""

    def __init__(self, block_size: int, memo_blocks: int = DEFAULT_MEMO_BLOCKS) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self._generation_size = max(1, memo_blocks // 2)
        self._young: dict[object, tuple[bytes, int]] = {}
        self._old: dict[object, tuple[bytes, int]] = {}
        # Digests of learned blocks by external id: an event names a chain's parent by id only.
        self._learned: dict[int, bytes] = {}
        self._unpack = struct.Struct(f"<{block_size}i").unpack
        self.hits = self.misses = self.learned = 0

    def hashes(
        self,
        token_ids: bytes | Sequence[int],
        cache_salt: str | None = None,
        held: Callable[[int], bool] | None = None,
    ) -> list[int]:
        """The external ids of every full block of ``token_ids``: a sequence of ints, or the
        packed little-endian int32 bytes a TokenizedRequest carries (``ipc.codec.pack_ids``).
        With ``held`` (is a block id cached anywhere?), it stops after the first block that is
        not: no later block can extend a cached prefix, and a prompt's new tail (a chat's new
        turn) is what misses the memo."""
        packed = token_ids if isinstance(token_ids, bytes) else _pack(token_ids)
        width = 4 * self.block_size
        young, old = self._young, self._old
        ids: list[int] = []
        parent = NONE_HASH
        for start in range(0, len(packed) - width + 1, width):
            block = packed[start : start + width]
            key: object = parent + block if start or not cache_salt else (cache_salt, block)
            found = young.get(key)
            if found is None:
                found = old.get(key)
                if found is None:
                    self.misses += 1
                    extra = None if start else first_block_extra(cache_salt)
                    digest = block_digest(parent, self._unpack(block), extra)
                    found = (digest, external_id(digest))
                else:
                    self.hits += 1
                young[key] = found
                if len(young) >= self._generation_size:
                    self._old, self._young = young, {}
                    old, young = young, self._young
            else:
                self.hits += 1
            parent = found[0]
            ids.append(found[1])
            if held is not None and not held(found[1]):
                break
        return ids

    def learn(self, parent: int | None, block_ids: Sequence[int], token_ids: Sequence[int]) -> int:
        """Hashes the blocks a BlockStored names (``parent``: the id of the block before the
        first; None: the prompt's start) into the memo, checking each against its id; returns
        how many it learned. It stops at a block whose parent it does not know or whose hash is
        not the event's id (a salted chain: the event does not carry the salt)."""
        digest = NONE_HASH if parent is None else self._learned.get(parent)
        if digest is None or len(token_ids) != len(block_ids) * self.block_size:
            return 0
        for j, block_id in enumerate(block_ids):
            block = token_ids[j * self.block_size : (j + 1) * self.block_size]
            key = digest + _pack(block)
            found = self._young.get(key) or self._old.get(key)
            if found is None:
                new = block_digest(digest, block)
                found = (new, external_id(new))
                self._young[key] = found
                if len(self._young) >= self._generation_size:
                    self._old, self._young = self._young, {}
            if found[1] != block_id:
                return j
            if len(self._learned) >= 2 * self._generation_size:
                self._learned.clear()  # bounded: an unknown parent costs only hashing later
            digest = self._learned[block_id] = found[0]
            self.learned += 1
        return len(block_ids)

    def __len__(self) -> int:
        return len(self._young) + len(self._old)


def _pack(token_ids: Sequence[int]) -> bytes:
    packed = array("i", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()

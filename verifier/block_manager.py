"""Paged-KV bookkeeping: which physical KV blocks each sequence owns, plus the prefix cache.

Plain Python, no torch: the only thing that crosses to the model is a block table, a list
of ints (physical block ids, in token order; token t of a sequence lives in slot
``t % block_size`` of block ``block_table[t // block_size]``).

It sits low in verifier/, beside the hand-off types, because every owner of a paged KV cache
keeps one: the engine's scheduler (spec/) for the target and the small drafter (drafters/) for
its own model, and drafters/ cannot import spec/.

Block states. Every physical block is in exactly one of three states:

- free: ref_count 0, no key, on the free list. Its KV is garbage.
- evictable: ref_count 0, published (the prefix cache's entry for its key), on the LRU
  list. Its KV is still valid, so a later prompt with the same prefix can reuse it, until
  a fresh allocation finds the free list empty and evicts it (least recently freed first).
- used: ref_count > 0, held by exactly ref_count block tables. A published used block
  may be shared by several sequences, so its KV is immutable.

``num_free_blocks`` counts free plus evictable blocks: both can be handed out now.

Prefix cache. Full block i of a token list is keyed by the chained digest
``h_i = BLAKE2b-128_K(h_{i-1} || tokens_i)``, with ``h_{-1}`` sixteen zero bytes and the
tokens packed as 32-bit ints, so a key names the whole prefix up to the end of the block,
not only the block's own tokens (KV depends on every earlier token). A hit therefore
implies that the whole prefix matches, unless BLAKE2b collides. A lookup hit must also
match the stored (parent digest, tokens) exactly, a cheap second check on the last link.

Why a keyed cryptographic digest. Python's ``hash`` of an int tuple is the same in every
process and invertible step by step, so a client could craft a block whose chain hash
equals that of another prompt's block; a later prompt that continues the crafted one
would then be served KV computed after different tokens (vLLM's CVE-2025-25183). The key
K is drawn from ``secrets`` once per process: keys never leave the process (each
replica keeps its own cache), so nothing needs them stable, and a client who cannot see
K cannot even compute the key of its own prompt, let alone search for a collision.
BLAKE2b rather than SHA-256: as fast per block here (docs/performance.md, "Prefix cache"),
and keyed natively, where a key prefixed to SHA-256 is open to length extension.

Lifecycle of one sequence:

1. ``allocate(seq_id, prompt)`` at admission: reuse cached full blocks, allocate the rest;
   returns how many leading tokens need no compute.
2. ``ensure_slots`` before each forward (decode appends, tree nodes need temporary room).
3. ``truncate`` after tree verification drops the slots of rejected nodes.
4. ``publish`` after each forward registers newly full, computed blocks in the cache.
5. ``free`` at finish, cancel or preemption.
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

DIGEST_SIZE = 16  # bytes per prefix-cache key: a blind collision takes ~2**64 tries
ROOT_DIGEST = bytes(DIGEST_SIZE)  # the parent of block 0
# Keyed once per process, copied per block: cheaper than passing key= each time.
_KEYED_BLAKE2B = hashlib.blake2b(key=secrets.token_bytes(32), digest_size=DIGEST_SIZE)


def namespace_root(tag: bytes) -> bytes:
    """The parent of block 0 for prompts that run under `tag` (a LoRA adapter's identity): their
    blocks' keys chain from it, so no other namespace's prompt, however alike, ever hits them."""
    digest = _KEYED_BLAKE2B.copy()
    digest.update(b"namespace:" + tag)
    return digest.digest()


class NoFreeBlocksError(RuntimeError):
    """An allocation needs more blocks than the pool can hand out now. Nothing was changed."""


def _chain_hash(parent_hash: bytes, block_tokens: tuple[int, ...]) -> bytes:
    """Key of one full block: the keyed digest of its parent's key (ROOT_DIGEST for block 0)
    and its tokens. Module-level so tests can swap in weak functions.

    Raises OverflowError for a token outside a 32-bit int, rather than packing it ambiguously.
    """
    digest = _KEYED_BLAKE2B.copy()
    digest.update(parent_hash)  # fixed length, so parent and tokens cannot shift into each other
    digest.update(array("i", block_tokens))
    return digest.digest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _require_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a block count is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class BlockManagerConfig:
    """Size of the KV block pool and whether to share full-block prefixes across requests."""

    num_blocks: int  # physical KV blocks; the engine sizes this from free device memory
    block_size: int = 16  # tokens per block: larger wastes less table, but more tail slots
    enable_prefix_cache: bool = True  # reuse KV of identical full-block prompt prefixes

    def __post_init__(self) -> None:
        _require_int("num_blocks", self.num_blocks, minimum=1)
        _require_int("block_size", self.block_size, minimum=1)
        if not isinstance(self.enable_prefix_cache, bool):
            raise ValueError(
                f"enable_prefix_cache must be a bool (True or False), got {self.enable_prefix_cache!r}"
            )


@dataclass(slots=True)
class _Block:
    """One physical block. ``hash`` is set iff the prefix cache maps that key to this block."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # its prefix-cache key while published
    parent_hash: bytes | None = None  # the previous block's key (ROOT_DIGEST for block 0) when published
    token_ids: tuple[int, ...] | None = None  # the tokens it was published with

    def holds(self, parent_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """True when this block's published key equals (parent_hash, token_ids) exactly."""
        return self.parent_hash == parent_hash and self.token_ids == token_ids


@dataclass(slots=True)
class _Seq:
    """What the manager keeps per sequence."""

    block_table: list[int] = field(default_factory=list)
    # Prefix-cache keys of the leading blocks that are full of computed KV (cache hits and
    # published blocks). These blocks are frozen: truncate() may not cut into them.
    block_hashes: list[bytes] = field(default_factory=list)
    root: bytes = ROOT_DIGEST  # the parent of its block 0 (namespace_root: its adapter's)


@dataclass(frozen=True, slots=True)
class _AdmissionPlan:
    """Result of a read-only prefix-cache lookup: what allocate() would do for a prompt."""

    hit_blocks: tuple[int, ...]  # cached blocks to reuse, in order
    hit_hashes: tuple[bytes, ...]  # their prefix-cache keys
    num_fresh: int  # new blocks needed for the rest of the prompt
    num_evictable_hits: int  # hits now on the LRU list: each also uses up a free block
    num_queried_tokens: int  # tokens in full blocks (0 when the cache is off)
    num_cached_tokens: int  # tokens served from cache


class BlockManager:
    """Hands out KV blocks to sequences and keeps the prefix cache.

    All mutating methods are all-or-nothing: on NoFreeBlocksError or ValueError the
    state is unchanged.
    """

    def __init__(self, config: BlockManagerConfig) -> None:
        self.config = config
        self._blocks = [_Block(i) for i in range(config.num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(config.num_blocks))  # oldest first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._cache: dict[bytes, int] = {}  # prefix-cache key -> block id
        self._seqs: dict[int, _Seq] = {}
        self._roots = {ROOT_DIGEST}  # every block-0 parent seen (namespace_root), for _worthless
        # Metrics, cumulative, in tokens. Counted on successful allocate() only, so an
        # admission retried every step while the pool is full is not counted each time.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ----- sizes -------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_total_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count > 0."""
        return self.num_total_blocks - self.num_free_blocks

    # ----- queries -----------------------------------------------------------------

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        """The seq's physical block ids in token order.

        Returns the live list (no copy per step): it grows and shrinks in place with
        ensure_slots/truncate. Callers must not mutate it.
        """
        return self._seq(seq_id).block_table

    def blocks_needed(self, seq_id: int | None, num_tokens: int) -> int:
        """New blocks needed so the seq (None: not yet allocated) holds num_tokens tokens."""
        held = 0 if seq_id is None else len(self._seq(seq_id).block_table)
        return max(0, _cdiv(num_tokens, self.block_size) - held)

    def can_allocate(self, token_ids: list[int], root: bytes = ROOT_DIGEST) -> bool:
        """True when allocate(token_ids) would succeed now.

        Hits on used blocks cost nothing; hits on evictable blocks cost one free block
        each, because num_free_blocks already counts them.
        """
        plan = self._lookup(token_ids, root)
        return plan.num_fresh + plan.num_evictable_hits <= self.num_free_blocks

    # ----- mutations ---------------------------------------------------------------

    def allocate(self, seq_id: int, token_ids: list[int], root: bytes = ROOT_DIGEST) -> int:
        """Admit a sequence with its prompt; return num_cached_tokens (< len(token_ids)).

        Reuses the longest chain of cached full blocks, then allocates fresh blocks for
        the rest. The result is always a multiple of block_size and below
        len(token_ids): when every token would be cached, the last hit is treated as a
        miss so the model computes at least the last prompt token (its logits are needed).
        Raises ValueError if seq_id is already allocated or token_ids is empty, and
        NoFreeBlocksError (state unchanged) if the pool is short.
        """
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id} is already allocated")
        if not token_ids:
            raise ValueError("token_ids must hold at least one token")
        plan = self._lookup(token_ids, root)
        self._require_free(plan.num_fresh + plan.num_evictable_hits, f"admit seq {seq_id}")
        # Claim hits before taking fresh blocks, so an eviction cannot take a block this
        # prompt is about to reuse.
        seq = _Seq([self._acquire(b) for b in plan.hit_blocks], list(plan.hit_hashes), root)
        self._roots.add(root)
        for _ in range(plan.num_fresh):
            self._grow(seq)
        self._seqs[seq_id] = seq
        self.prefix_queries += plan.num_queried_tokens
        self.prefix_hits += plan.num_cached_tokens
        return plan.num_cached_tokens

    def ensure_slots(self, seq_id: int, num_tokens: int) -> None:
        """Grow the seq's table to hold num_tokens tokens. NoFreeBlocksError: state unchanged."""
        seq = self._seq(seq_id)
        need = self.blocks_needed(seq_id, num_tokens)
        self._require_free(need, f"grow seq {seq_id} to {num_tokens} tokens")
        for _ in range(need):
            self._grow(seq)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Release trailing blocks not needed to hold num_tokens tokens.

        Released blocks lose one reference and, at zero, go back to the pool as in free().
        Blocks still needed are untouched. Raises ValueError if num_tokens would cut into
        the seq's frozen prefix (cached hits and published blocks): that KV may be shared,
        and the tokens written after a truncate would overwrite it.
        """
        seq = self._seq(seq_id)
        frozen_tokens = len(seq.block_hashes) * self.block_size
        if num_tokens < frozen_tokens:
            raise ValueError(
                f"cannot truncate seq {seq_id} to {num_tokens} tokens: its first "
                f"{frozen_tokens} tokens are in cached/published blocks"
            )
        keep = _cdiv(num_tokens, self.block_size)
        # Release tail first, as in free(): the tail is then evicted before the head.
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]  # in place: block_table() handed out this list

    def publish(self, seq_id: int, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register every newly full, computed block of the seq in the prefix cache.

        token_ids is the seq's full token list so far; the model has written KV for its
        first num_computed_tokens tokens. If the cache already maps a block's key to
        another block (same prefix computed twice), the existing entry is kept and this
        block stays unhashed: it is returned to the free list, not the LRU, when
        released. Its key is still recorded for the seq so later blocks chain correctly.
        No-op when the prefix cache is disabled.
        """
        if not self.config.enable_prefix_cache:
            return
        seq = self._seq(seq_id)
        capacity = len(seq.block_table) * self.block_size
        if not 0 <= num_computed_tokens <= min(len(token_ids), capacity):
            raise ValueError(
                f"num_computed_tokens must be in [0, min(len(token_ids)={len(token_ids)}, "
                f"capacity={capacity})], got {num_computed_tokens}"
            )
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.root
        for i in range(len(seq.block_hashes), num_computed_tokens // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = self._register(seq.block_table[i], parent, tokens)
            seq.block_hashes.append(parent)

    def free(self, seq_id: int) -> None:
        """Drop the seq (finish, cancel, preempt). Unknown seq_id raises KeyError.

        Each block loses one reference; at zero, published blocks go to the LRU list and
        the others to the free list. Blocks are released tail first, so the tail of a
        prompt is evicted before its head: a prefix hit needs the chain from block 0,
        so head blocks are worth more.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"unknown seq_id {seq_id}")
        for block_id in reversed(seq.block_table):
            self._release(block_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no sequence holds (they become free); return how many.

        Blocks in use keep their entries: their sequences still own valid KV. Benchmarks
        call this (through the server) so that each run starts as cold as the first.
        """
        dropped = list(self._evictable)
        for block_id in dropped:
            self._unpublish(self._blocks[block_id])
            self._free[block_id] = None
        self._evictable.clear()
        return len(dropped)

    @contextmanager
    def scratch(self, seq_id: int, num_tokens: int) -> Iterator[list[int]]:
        """Fresh blocks for num_tokens slots, lent as a block table for work that is no
        request's (the engine's warm-up forwards) and freed on exit. They bypass the prefix
        cache: no lookup (the counters stay as they were), never published. Raises
        ValueError if seq_id is allocated, NoFreeBlocksError (state unchanged) if the pool is short.
        """
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id} is already allocated")
        self._require_free(_cdiv(num_tokens, self.block_size), f"scratch seq {seq_id}")
        seq = self._seqs[seq_id] = _Seq()
        for _ in range(_cdiv(num_tokens, self.block_size)):
            self._grow(seq)
        try:
            yield seq.block_table
        finally:
            self.free(seq_id)

    # ----- integrity ---------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first inconsistency found.

        Checks: every block is in exactly one state (free list, LRU list, referenced);
        ref counts equal the number of tables holding the block; no table repeats a
        block; hashed blocks and cache entries agree one to one; each seq's frozen
        prefix matches the keys of its blocks. Explicit raises, not `assert`, so it
        still runs under `python -O`; messages are built only on failure (it runs after
        every call in the stress test).
        """
        self._check_pool_states()
        self._check_ref_counts()
        self._check_cache()

    def _check_pool_states(self) -> None:
        free, evictable = list(self._free), list(self._evictable)
        used = [b.block_id for b in self._blocks if b.ref_count > 0]
        if sorted(free + evictable + used) != list(range(self.num_total_blocks)):
            _fail(f"blocks not in exactly one state: free={free} evictable={evictable} used={used}")
        for block_id in free:
            if self._blocks[block_id].hash is not None:
                _fail(f"free block {self._blocks[block_id]} is hashed")
        for block_id in evictable:
            if self._blocks[block_id].hash is None:
                _fail(f"evictable block {self._blocks[block_id]} is not hashed")

    def _check_ref_counts(self) -> None:
        holders = [0] * self.num_total_blocks
        for seq_id, seq in self._seqs.items():
            self._check_seq(seq_id, seq)
            for block_id in seq.block_table:
                holders[block_id] += 1
        for block, held in zip(self._blocks, holders):
            if block.ref_count != held:
                _fail(f"{block} is held by {held} tables")

    def _check_seq(self, seq_id: int, seq: _Seq) -> None:
        table, hashes = seq.block_table, seq.block_hashes
        if len(set(table)) != len(table):
            _fail(f"seq {seq_id} has duplicate blocks: {table}")
        if len(hashes) > len(table):
            _fail(f"seq {seq_id} has {len(hashes)} keys for {len(table)} blocks")
        for i, block_id in enumerate(table):
            stored = self._blocks[block_id].hash
            # A frozen block is published under its key or is an unhashed duplicate;
            # a block past the frozen prefix is this seq's own and never published.
            expected = (None, hashes[i]) if i < len(hashes) else (None,)
            if stored not in expected:
                _fail(f"seq {seq_id} block {i} ({block_id}) has key {_show(stored)}, "
                      f"expected one of {[_show(e) for e in expected]}")

    def _check_cache(self) -> None:
        if self._cache and not self.config.enable_prefix_cache:
            _fail("prefix cache disabled but has entries")
        for h, block_id in self._cache.items():
            if self._blocks[block_id].hash != h:
                _fail(f"cache entry {_show(h)} -> {self._blocks[block_id]}: key mismatch")
        hashed = sum(b.hash is not None for b in self._blocks)
        if hashed != len(self._cache):
            _fail(f"{hashed} published blocks but {len(self._cache)} cache entries")

    # ----- internals ---------------------------------------------------------------

    def _seq(self, seq_id: int) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown seq_id {seq_id}")
        return seq

    def _require_free(self, num_blocks: int, what: str) -> None:
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"{what}: need {num_blocks} blocks, {self.num_free_blocks} free")

    def _lookup(self, token_ids: list[int], root: bytes = ROOT_DIGEST) -> _AdmissionPlan:
        """Read-only: walk the prefix cache over the full blocks of token_ids, chained from `root`."""
        bs = self.block_size
        hits: list[int] = []
        hashes: list[bytes] = []
        num_full = len(token_ids) // bs
        if self.config.enable_prefix_cache:
            parent = root
            for i in range(num_full):
                tokens = tuple(token_ids[i * bs : (i + 1) * bs])
                h = _chain_hash(parent, tokens)
                block_id = self._cache.get(h)
                if block_id is None or not self._blocks[block_id].holds(parent, tokens):
                    break
                hits.append(block_id)
                hashes.append(h)
                parent = h
            if hits and len(hits) * bs >= len(token_ids):
                # Everything cached: recompute the last block so the last token has logits.
                hits.pop()
                hashes.pop()
        return _AdmissionPlan(
            hit_blocks=tuple(hits),
            hit_hashes=tuple(hashes),
            num_fresh=_cdiv(len(token_ids), bs) - len(hits),
            num_evictable_hits=sum(self._blocks[b].ref_count == 0 for b in hits),
            num_queried_tokens=num_full * bs if self.config.enable_prefix_cache else 0,
            num_cached_tokens=len(hits) * bs,
        )

    def _acquire(self, block_id: int) -> int:
        """Add a reference to a cached block; a block at ref 0 leaves the LRU list."""
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1
        return block_id

    def _grow(self, seq: _Seq) -> None:
        """Append one fresh block to the seq's table, preferring the one after its last."""
        table, hashes = seq.block_table, seq.block_hashes
        last_hash = hashes[-1] if hashes and len(hashes) == len(table) else None   # last block frozen
        table.append(self._take_fresh_block(table[-1] if table else None, last_hash))

    def _take_fresh_block(self, after: int | None = None, after_hash: bytes | None = None) -> int:
        """A block for new KV: the free list first, else evict the least recently freed.

        Block `after + 1` (after: the sequence's last block) is preferred, so that a
        sequence's blocks form one physical run that attention reads as a view, not a
        gather. It is taken when free (a tree step's temporary block comes back to the
        same place after truncate); when cached and unused but an orphan, whose parent block
        was evicted, which no lookup can reach; and, once the free list is empty, when it
        continues this sequence's prefix (parent key `after_hash`): another prompt that
        shared the prefix and diverged, whose blocks then go in order rather than the LRU
        head's. While free blocks remain that continuation stays cached: conversations that
        share a system prompt would otherwise evict each other's turns at every request.
        Any other cached block is only evicted in LRU order.
        """
        want = None if after is None else after + 1
        if want in self._free:
            del self._free[want]
            block_id = want
        elif want in self._evictable and self._worthless(self._blocks[want], after_hash):
            del self._evictable[want]
            self._unpublish(self._blocks[want])
            block_id = want
        elif self._free:
            block_id, _ = self._free.popitem(last=False)
        else:
            block_id, _ = self._evictable.popitem(last=False)
            self._unpublish(self._blocks[block_id])
        self._blocks[block_id].ref_count = 1
        return block_id

    def _worthless(self, block: _Block, after_hash: bytes | None) -> bool:
        """A cached block to take before a free one or the LRU head: an orphan, or, with no
        block free, a continuation of `after_hash`; see _take_fresh_block."""
        parent = block.parent_hash
        # A block-0 entry (root parent) is never an orphan, nor a continuation of a seq's blocks.
        if parent is None or parent in self._roots:
            return False
        return parent not in self._cache or (not self._free and parent == after_hash)

    def _release(self, block_id: int) -> None:
        """Drop one reference; at zero the block goes to the LRU list or the free list."""
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.hash is not None:
            self._evictable[block_id] = None  # appended last: most recently freed
        else:
            self._free[block_id] = None

    def _register(self, block_id: int, parent: bytes, tokens: tuple[int, ...]) -> bytes:
        """Publish one full block; return its key. An existing entry is kept."""
        h = _chain_hash(parent, tokens)
        if h not in self._cache:
            block = self._blocks[block_id]
            block.hash, block.parent_hash, block.token_ids = h, parent, tokens
            self._cache[h] = block_id
        return h

    def _unpublish(self, block: _Block) -> None:
        del self._cache[block.hash]
        block.hash = block.parent_hash = block.token_ids = None


def _fail(message: str) -> None:
    raise AssertionError(message)


def _show(key: object) -> str:
    """A key for a failure message: hex for digests (tests may plant other values)."""
    return key.hex() if isinstance(key, bytes) else repr(key)

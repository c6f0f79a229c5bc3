"""Block manager: paged-KV bookkeeping and the prefix cache, without a model."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import pytest

import verifier.block_manager as block_manager_module
from verifier.block_manager import BlockManager, BlockManagerConfig, NoFreeBlocksError


def make(num_blocks: int, block_size: int = 4, enable_prefix_cache: bool = True) -> BlockManager:
    return BlockManager(BlockManagerConfig(num_blocks, block_size, enable_prefix_cache))


def admit(bm: BlockManager, seq_id: int, tokens: list[int]) -> int:
    """Allocate, 'compute' the whole prompt and publish it, as the engine does after prefill."""
    cached = bm.allocate(seq_id, tokens)
    bm.publish(seq_id, tokens, len(tokens))
    bm.check_integrity()
    return cached


def ref_count(bm: BlockManager, block_id: int) -> int:
    return bm._blocks[block_id].ref_count


# ----- config --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_blocks=0), "num_blocks"),
        (dict(num_blocks=-3), "num_blocks"),
        (dict(num_blocks=2.0), "num_blocks"),
        (dict(num_blocks=True), "num_blocks"),
        (dict(num_blocks=8, block_size=0), "block_size"),
        (dict(num_blocks=8, block_size="16"), "block_size"),
        (dict(num_blocks=8, enable_prefix_cache=1), "enable_prefix_cache"),
    ],
)
def test_config_rejects_bad_values(kwargs, field):
    """Each bad field raises ValueError naming the field and its allowed range."""
    with pytest.raises(ValueError, match=field) as info:
        BlockManagerConfig(**kwargs)
    assert ">= 1" in str(info.value) or "bool" in str(info.value)


def test_config_is_frozen_and_has_defaults():
    """The config cannot be mutated after it is built; block_size defaults to 16 with the cache on."""
    config = BlockManagerConfig(num_blocks=8)
    assert (config.block_size, config.enable_prefix_cache) == (16, True)
    with pytest.raises(AttributeError):
        config.num_blocks = 9


# ----- allocate / free -----------------------------------------------------------------


def test_allocate_and_free_return_the_pool_whole():
    """A seq takes ceil(len/bs) blocks from the pool and free() gives every one back."""
    bm = make(num_blocks=8)
    assert bm.allocate(1, list(range(10))) == 0  # nothing published yet
    assert len(bm.block_table(1)) == 3 and bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    bm.check_integrity()
    bm.free(1)
    assert not bm.has(1)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (8, 0)
    bm.check_integrity()


def test_two_seqs_sharing_a_prefix_share_blocks_with_ref_counts():
    """Shared full prefix blocks are held once with ref count 2; each seq keeps its own tail."""
    bm = make(num_blocks=16)
    prompt = list(range(10))  # blocks [0..3] [4..7] [8, 9]
    admit(bm, 1, prompt)
    assert admit(bm, 2, prompt[:8] + [50, 51, 52]) == 8
    t1, t2 = bm.block_table(1), bm.block_table(2)
    assert t1[:2] == t2[:2] and t1[2] != t2[2]
    assert [ref_count(bm, b) for b in t2] == [2, 2, 1]
    assert bm.num_used_blocks == 4
    bm.free(1)
    assert [ref_count(bm, b) for b in t2] == [1, 1, 1]
    bm.free(2)
    bm.check_integrity()
    assert bm.num_free_blocks == 16 and bm.num_used_blocks == 0


def test_prefix_hits_count_full_blocks_of_the_shared_prefix():
    """40-token prompt (bs 16) published; a seq with the same first 35 tokens gets 32 cached."""
    bm = make(num_blocks=16, block_size=16)
    prompt = list(range(40))
    assert admit(bm, 1, prompt) == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (32, 0)
    assert admit(bm, 2, prompt[:35]) == 32
    assert bm.block_table(2)[:2] == bm.block_table(1)[:2]
    assert (bm.prefix_queries, bm.prefix_hits) == (32 + 32, 32)


def test_identical_fully_cached_prompt_recomputes_its_last_block():
    """An identical 32-token prompt gets 16 cached tokens, not 32: the last token needs logits."""
    bm = make(num_blocks=16, block_size=16)
    prompt = list(range(32))
    admit(bm, 1, prompt)
    assert admit(bm, 2, prompt) == 16
    assert (bm.prefix_queries, bm.prefix_hits) == (64, 16)
    t1, t2 = bm.block_table(1), bm.block_table(2)
    assert t2[0] == t1[0] and t2[1] != t1[1]  # the recomputed block is a fresh one
    # Seq 2's copy of block 1 duplicates a cached hash: the existing entry is kept, so a
    # later prompt still hits seq 1's block, and seq 2's copy returns to the free list.
    bm.free(2)
    bm.check_integrity()
    assert t2[1] in bm._free
    assert admit(bm, 3, prompt + [99]) == 32
    assert bm.block_table(3)[:2] == t1[:2]


def test_single_block_prompt_is_never_cached():
    """A prompt of exactly one full block would be fully cached, so it gets 0 cached tokens."""
    bm = make(num_blocks=8, block_size=4)
    admit(bm, 1, [1, 2, 3, 4])
    assert bm.allocate(2, [1, 2, 3, 4]) == 0
    assert bm.allocate(3, [1, 2, 3, 4, 5]) == 4


def test_publish_registers_only_full_computed_blocks():
    """Blocks are published only once full of computed tokens; partial computation publishes less."""
    bm = make(num_blocks=16, block_size=4)
    prompt = list(range(11))  # 2 full blocks + 3 tokens
    bm.allocate(1, prompt)
    bm.publish(1, prompt, 7)  # block 0 full and computed, block 1 only 3/4 computed
    bm.check_integrity()
    assert len(bm._cache) == 1
    assert bm.allocate(2, prompt) == 4
    bm.publish(1, prompt, 11)  # now block 1 too; the partial tail block never
    bm.check_integrity()
    assert len(bm._cache) == 2
    assert bm.allocate(3, prompt) == 8


def test_publish_is_a_no_op_with_the_cache_disabled():
    """With enable_prefix_cache=False nothing is published, hit or counted."""
    bm = make(num_blocks=16, enable_prefix_cache=False)
    prompt = list(range(12))
    assert admit(bm, 1, prompt) == 0
    assert admit(bm, 2, prompt) == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)
    assert not set(bm.block_table(1)) & set(bm.block_table(2))


def test_scratch_blocks_are_lent_uncounted_and_freed():
    """scratch() lends fresh blocks (no lookup, no publish, counters unchanged) and frees them on
    exit, even when the work inside raises; a pool too short refuses with nothing changed."""
    bm = make(num_blocks=4)
    admit(bm, 1, list(range(8)))                     # two cached blocks, then held
    counters = (bm.prefix_queries, bm.prefix_hits)
    with pytest.raises(RuntimeError, match="inside"):
        with bm.scratch(-1, 7) as table:
            assert len(table) == 2 and not set(table) & set(bm.block_table(1))
            bm.check_integrity()
            raise RuntimeError("inside")
    assert not bm.has(-1) and (bm.prefix_queries, bm.prefix_hits) == counters and len(bm._cache) == 2
    with pytest.raises(NoFreeBlocksError):
        with bm.scratch(-1, 9):
            pass
    with pytest.raises(ValueError, match="already allocated"):
        with bm.scratch(1, 1):
            pass
    bm.check_integrity()
    assert bm.num_free_blocks == 2


def test_hit_after_free_reuses_the_evictable_block():
    """A freed seq's published blocks stay cached at ref 0 and serve the next equal prefix."""
    bm = make(num_blocks=8, block_size=4)
    prompt = list(range(9))
    admit(bm, 1, prompt)
    old = list(bm.block_table(1))
    bm.free(1)
    assert bm.num_free_blocks == 8  # evictable blocks count as free
    assert bm.can_allocate(prompt)
    assert admit(bm, 2, prompt) == 8
    assert bm.block_table(2)[:2] == old[:2]
    assert [ref_count(bm, b) for b in old[:2]] == [1, 1]
    assert bm.num_free_blocks == 5


def test_lru_evicts_least_recently_freed_tail_first():
    """Fresh blocks come from the free list first, then evict the least recently freed cached block."""
    bm = make(num_blocks=6, block_size=4)
    prompt_a, prompt_b = list(range(8)), list(range(100, 108))
    admit(bm, 1, prompt_a)
    a = list(bm.block_table(1))
    bm.free(1)  # LRU: a[1], a[0] (tail first)
    admit(bm, 2, prompt_b)
    b = list(bm.block_table(2))
    bm.free(2)  # LRU: a[1], a[0], b[1], b[0]
    never_used = sorted(set(range(6)) - set(a) - set(b))
    bm.allocate(3, list(range(200, 212)))  # 3 blocks: 2 free + evict a[1]
    assert bm.block_table(3) == never_used + [a[1]]
    bm.free(3)
    bm.check_integrity()
    # A lost its tail block, B is whole.
    assert bm.allocate(4, prompt_a + [0]) == 4
    assert bm.allocate(5, prompt_b + [0]) == 8


def test_hash_collision_never_serves_wrong_kv(monkeypatch):
    """With every key forced equal, a hit is served only when parent and tokens match."""
    monkeypatch.setattr(block_manager_module, "_chain_hash", lambda parent, tokens: b"k" * 16)
    bm = make(num_blocks=16, block_size=4)
    admit(bm, 1, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert admit(bm, 2, [9, 9, 9, 9, 9]) == 0  # same key, other tokens
    # Same tokens as seq 1's block 1, but its stored parent key (b"k" * 16) differs from
    # the root's: a block's KV depends on its prefix, so this is a miss too.
    assert admit(bm, 3, [5, 6, 7, 8, 0]) == 0
    assert admit(bm, 4, [1, 2, 3, 4, 5]) == 4  # the genuine match still hits
    assert len(bm._cache) == 1  # colliding publishes kept the first entry


# ----- forged prefix collisions --------------------------------------------------------

# Two 4-token blocks, tokens below 2**31, on which CPython's tuple hash collides. Found by
# sorting hash(t) * inverse(XXPRIME_2) mod 2**64 over 2**18 random 3-token tuples (seeded
# 0): two neighbours less than 2**31 apart differ by (d - d') * XXPRIME_2 in the tuple
# hash's state, which the fourth tokens d, d' cancel. So the old key
# hash((parent, tokens)) collides for any shared parent.
TUPLE_HASH_PAIR = ((1159905542, 545980246, 1780906500, 179700154), (251373949, 2094202703, 408421151, 0))
LAST_TOKEN_PAIR = ((10, 11, 12, 13), (20, 21, 22, 13))  # equal under a key of the last token only
TUPLE_HASH_COLLIDES = hash(TUPLE_HASH_PAIR[0]) == hash(TUPLE_HASH_PAIR[1])  # CPython >= 3.8, 64-bit


def _old_key(parent, tokens):
    """The key before issue 31: Python's built-in hash, invertible step by step."""
    return hash((parent, tokens))


def _last_token_key(parent, tokens, _real=block_manager_module._chain_hash):
    """A chained key that reads only the block's last token: a weak hash made to collide."""
    return _real(parent, tokens[-1:])


def forge(block_q: tuple[int, ...], block_q2: tuple[int, ...]) -> tuple[int, bool]:
    """Victim A computes P+Q+X; the attacker's P+Q2 takes Q's block; then P+Q2+X is admitted.

    Q and Q2 differ, so X's KV in A's block was computed after the wrong prefix for the
    last request. Returns its cached tokens and whether A's X block was among its hits.
    """
    bm = make(num_blocks=8, block_size=4)
    p, x = [1, 2, 3, 4], [5, 6, 7, 8]
    admit(bm, 1, p + list(block_q) + x)
    victim_x = bm.block_table(1)[2]
    admit(bm, 9, list(range(100, 120)))  # the rest of the pool, held meanwhile
    bm.free(1)  # LRU, tail first: X's block, Q's, P's; no block free
    bm.check_integrity()
    # P hits; P+Q2 must be computed, in the block after P: Q's, a continuation of P this
    # seq diverges from, taken first when no block is free (BlockManager._take_fresh_block).
    # X's block stays cached.
    assert admit(bm, 2, p + list(block_q2)) == 4
    bm.free(9)
    cached = admit(bm, 3, p + list(block_q2) + x + [9])
    reused = victim_x in bm.block_table(3)[: cached // 4]  # served as cached, not recomputed in place
    bm.free(2)
    bm.free(3)
    bm.check_integrity()
    return cached, reused


@pytest.mark.parametrize(
    "weak_key, pair",
    [
        pytest.param(_old_key, TUPLE_HASH_PAIR, id="old-builtin-hash",
                     marks=pytest.mark.skipif(not TUPLE_HASH_COLLIDES, reason="not CPython's 64-bit tuple hash")),
        pytest.param(_last_token_key, LAST_TOKEN_PAIR, id="last-token-only"),
    ],
)
def test_a_colliding_parent_key_serves_wrong_kv_under_weak_keys(monkeypatch, weak_key, pair):
    """The attack has teeth: under the old key (or any weak one) a crafted parent collision
    hands the last request the victim's KV for X, computed after Q, not Q2."""
    assert pair[0] != pair[1] and weak_key(b"p", pair[0]) == weak_key(b"p", pair[1])
    monkeypatch.setattr(block_manager_module, "_chain_hash", weak_key)
    assert forge(*pair) == (12, True)


@pytest.mark.parametrize("pair", [TUPLE_HASH_PAIR, LAST_TOKEN_PAIR], ids=["old-builtin-hash", "last-token-only"])
def test_chained_digests_never_reuse_a_block_after_a_different_parent(pair):
    """With the real keys the same forgery gets no hit on X: the key chains the whole prefix."""
    assert forge(*pair) == (8, False)


def test_keys_are_fixed_size_digests_chained_from_the_root():
    """A key is DIGEST_SIZE bytes, depends on the parent and on every token of the block."""
    key = block_manager_module._chain_hash
    root, tokens = block_manager_module.ROOT_DIGEST, (1, 2, 3, 4)
    k = key(root, tokens)
    assert isinstance(k, bytes) and len(k) == block_manager_module.DIGEST_SIZE == len(root)
    assert k == key(root, tokens) != key(k, tokens)
    assert len({key(root, tokens[:i] + (t,) + tokens[i + 1:]) for i in range(4) for t in (0, 9)}) == 8
    with pytest.raises(OverflowError):
        key(root, (2**31,))


def test_keys_differ_between_processes():
    """The key is drawn per process: a fresh interpreter keys the same block differently."""
    code = ("from verifier.block_manager import ROOT_DIGEST, _chain_hash; "
            "print(_chain_hash(ROOT_DIGEST, (1, 2, 3, 4)).hex())")
    root = Path(__file__).resolve().parents[2]
    other = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    here = block_manager_module._chain_hash(block_manager_module.ROOT_DIGEST, (1, 2, 3, 4)).hex()
    assert len(other.stdout.strip()) == len(here) and other.stdout.strip() != here


def test_integrity_holds_with_digest_keys_through_publishes_and_frees():
    """Cache entries, block keys and each seq's frozen keys stay consistent across the lifecycle."""
    bm = make(num_blocks=8, block_size=4)
    prompt = list(range(13))
    bm.allocate(1, prompt)
    for computed in (3, 8, 13):  # publish in steps, as prefill chunks do
        bm.publish(1, prompt, computed)
        bm.check_integrity()
    assert admit(bm, 2, prompt[:9]) == 8
    keys = bm._seqs[1].block_hashes
    assert len(keys) == 3 and bm._seqs[2].block_hashes == keys[:2]
    assert all(bm._cache[k] == b for k, b in zip(keys, bm.block_table(1)))
    bm.free(1)
    bm.check_integrity()
    bm.free(2)
    bm.check_integrity()
    assert bm.reset_prefix_cache() == 3 and not bm._cache  # seq 1's three full blocks
    bm.check_integrity()


# ----- ensure_slots / truncate ---------------------------------------------------------


def test_ensure_slots_grows_the_table_all_or_nothing():
    """ensure_slots adds just enough blocks, and on shortage raises with nothing changed."""
    bm = make(num_blocks=4, block_size=4)
    bm.allocate(1, list(range(5)))
    table = bm.block_table(1)
    assert bm.blocks_needed(1, 8) == 0 and bm.blocks_needed(1, 9) == 1 and bm.blocks_needed(None, 9) == 3
    bm.ensure_slots(1, 8)
    assert len(table) == 2
    bm.ensure_slots(1, 9)
    assert len(table) == 3 and bm.block_table(1) is table  # the live list grew
    before = list(table)
    with pytest.raises(NoFreeBlocksError):
        bm.ensure_slots(1, 17)  # needs 2 more, 1 free
    bm.check_integrity()
    assert table == before and bm.num_free_blocks == 1


def test_truncate_releases_only_the_trailing_blocks():
    """truncate keeps ceil(n/bs) blocks, releases the rest, and never cuts into published blocks."""
    bm = make(num_blocks=8, block_size=4)
    prompt = list(range(6))
    admit(bm, 1, prompt)  # block 0 published
    table = bm.block_table(1)
    bm.ensure_slots(1, 16)  # room for temporary tree nodes
    head = list(table[:3])
    bm.truncate(1, 9)
    assert table == head and bm.num_used_blocks == 3
    bm.truncate(1, 12)  # nothing to release
    assert table == head
    bm.truncate(1, 4)  # exactly the published block: allowed
    assert table == head[:1]
    with pytest.raises(ValueError, match="cannot truncate"):
        bm.truncate(1, 3)
    bm.check_integrity()
    assert table == head[:1] and bm.num_free_blocks == 7


def test_truncated_shared_prefix_keeps_its_references():
    """Truncating one sharer releases only its own tail; the shared cached blocks stay held."""
    bm = make(num_blocks=8, block_size=4)
    admit(bm, 1, list(range(9)))
    admit(bm, 2, list(range(9)))
    shared = bm.block_table(2)[:2]
    assert shared == bm.block_table(1)[:2]
    bm.ensure_slots(2, 16)
    bm.truncate(2, 8)
    bm.check_integrity()
    assert bm.block_table(2) == shared and [ref_count(bm, b) for b in shared] == [2, 2]


def test_allocate_is_all_or_nothing_and_can_allocate_counts_evictable_hits_once():
    """Hits on evictable blocks consume free blocks once; a refused allocate changes nothing."""
    bm = make(num_blocks=3, block_size=4)
    prompt = list(range(8))
    admit(bm, 1, prompt)
    bm.free(1)  # 2 evictable + 1 free: num_free_blocks == 3
    too_long = prompt + list(range(50, 58))  # 2 evictable hits + 2 fresh > 3
    assert not bm.can_allocate(too_long)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2, too_long)
    bm.check_integrity()
    assert not bm.has(2) and bm.num_free_blocks == 3 and len(bm._evictable) == 2
    assert (bm.prefix_queries, bm.prefix_hits) == (8, 0)  # refused admissions are not counted
    fits = prompt + [50, 51, 52, 53]  # 2 evictable hits + 1 fresh == 3
    assert bm.can_allocate(fits)
    assert bm.allocate(2, fits) == 8
    bm.check_integrity()
    assert bm.num_free_blocks == 0


def test_bad_calls_raise():
    """Double allocation and empty prompts are ValueError; unknown seq ids are KeyError."""
    bm = make(num_blocks=4)
    bm.allocate(1, [1])
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate(1, [1])
    with pytest.raises(ValueError, match="at least one token"):
        bm.allocate(2, [])
    with pytest.raises(ValueError, match="num_computed_tokens"):
        bm.publish(1, [1], 2)
    for call in (lambda: bm.free(7), lambda: bm.block_table(7), lambda: bm.ensure_slots(7, 1)):
        with pytest.raises(KeyError):
            call()
    bm.check_integrity()


# ----- integrity check -----------------------------------------------------------------


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda bm: setattr(bm._blocks[bm.block_table(1)[0]], "ref_count", 2), "held by"),
        (lambda bm: bm._free.setdefault(bm.block_table(1)[0]), "exactly one state"),
        (lambda bm: bm.block_table(1).append(bm.block_table(1)[0]), "duplicate"),
        (lambda bm: bm._cache.__setitem__(b"forged".ljust(16), bm.block_table(1)[1]), "mismatch"),
    ],
)
def test_integrity_check_catches_corruption(corrupt, message):
    """check_integrity raises AssertionError when the bookkeeping is corrupted on purpose."""
    bm = make(num_blocks=8, block_size=4)
    admit(bm, 1, list(range(9)))
    bm.check_integrity()
    corrupt(bm)
    with pytest.raises(AssertionError, match=message):
        bm.check_integrity()


# ----- randomized stress ---------------------------------------------------------------

VOCAB = 50
NUM_REQUESTS = 200
MAX_TREE_NODES = 8


class Checked:
    """Proxy that runs check_integrity() after every call into the manager, failed ones too."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm

    def __getattr__(self, name):
        attr = getattr(self.bm, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self.bm.check_integrity()

        return call


@dataclass
class SimSeq:
    seq_id: int
    tokens: list[int]
    max_len: int
    num_computed: int = 0


class Sim:
    """Drives the manager the way the engine will, and models the KV each slot holds.

    A slot's simulated KV is the whole token prefix ending at that position (real KV
    depends on every earlier token), so a cache hit is right only if it hands back
    exactly the prefixes this seq would have computed.
    """

    def __init__(self, rng: random.Random, bm: BlockManager) -> None:
        self.rng, self.bm, self.raw = rng, Checked(bm), bm
        self.kv: dict[int, list] = {}
        self.running: dict[int, SimSeq] = {}
        self.waiting: deque[SimSeq] = deque()
        self.counts = Counter()
        self.templates = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(4)]

    # -- model side --

    def write(self, seq: SimSeq, pos: int, content) -> None:
        """The model writes KV at pos: the block must be this seq's alone and unpublished."""
        bs = self.raw.block_size
        block_id = self.raw.block_table(seq.seq_id)[pos // bs]
        block = self.raw._blocks[block_id]
        assert block.ref_count == 1, f"write into shared block {block}"
        assert block.hash is None, f"write into published block {block}"
        self.kv.setdefault(block_id, [None] * bs)[pos % bs] = content

    def compute(self, seq: SimSeq, start: int, stop: int) -> None:
        for pos in range(start, stop):
            self.write(seq, pos, tuple(seq.tokens[: pos + 1]))

    def check_cached(self, seq: SimSeq, num_cached: int) -> None:
        bs = self.raw.block_size
        table = self.raw.block_table(seq.seq_id)
        for pos in range(num_cached):
            assert self.kv[table[pos // bs]][pos % bs] == tuple(seq.tokens[: pos + 1])

    # -- engine side --

    def new_request(self, seq_id: int) -> None:
        template = self.rng.choice(self.templates)
        prompt = template[: self.rng.randrange(len(template) + 1)]
        prompt += [self.rng.randrange(VOCAB) for _ in range(self.rng.randrange(1, 20))]
        self.waiting.append(SimSeq(seq_id, prompt, max_len=len(prompt) + self.rng.randrange(1, 40)))

    def admit(self) -> None:
        """Admission or resume after preemption: allocate, check hits, prefill, sample."""
        seq = self.waiting[0]
        fits, free_before = self.bm.can_allocate(seq.tokens), self.bm.num_free_blocks
        try:
            num_cached = self.alloc_counting_evictions(lambda: self.bm.allocate(seq.seq_id, seq.tokens))
        except NoFreeBlocksError:
            assert not fits and not self.bm.has(seq.seq_id) and self.bm.num_free_blocks == free_before
            self.counts["refused"] += 1
            return
        assert fits, "can_allocate said no but allocate succeeded"
        bs = self.bm.block_size
        assert 0 <= num_cached < len(seq.tokens) and num_cached % bs == 0
        self.counts["cached_tokens"] += num_cached
        self.waiting.popleft()
        self.check_cached(seq, num_cached)
        self.compute(seq, num_cached, len(seq.tokens))
        self.bm.publish(seq.seq_id, seq.tokens, len(seq.tokens))
        seq.tokens.append(self.rng.randrange(VOCAB))
        seq.num_computed = len(seq.tokens) - 1
        self.running[seq.seq_id] = seq

    def step(self, seq: SimSeq) -> None:
        """One speculative step: room for last token + tree, verify, keep the accepted path."""
        c, n = seq.num_computed, self.rng.randrange(MAX_TREE_NODES + 1)  # n == 0: plain decode
        try:
            self.alloc_counting_evictions(lambda: self.bm.ensure_slots(seq.seq_id, c + 1 + n))
        except NoFreeBlocksError:
            self.preempt(seq)
            return
        self.compute(seq, c, c + 1)
        for pos in range(c + 1, c + 1 + n):
            self.write(seq, pos, ("tree node", seq.seq_id, pos))
        if self.rng.random() < 0.05:  # cancelled mid-step, tree KV still in place
            self.finish(seq, "cancelled_mid_step")
            return
        num_accepted = self.rng.randrange(n + 1)
        seq.tokens += [self.rng.randrange(VOCAB) for _ in range(num_accepted + 1)]  # + bonus
        self.compute(seq, c + 1, c + 1 + num_accepted)  # commit: accepted KV into its slots
        seq.num_computed = c + 1 + num_accepted
        capacity = len(self.bm.block_table(seq.seq_id)) * self.bm.block_size
        self.bm.truncate(seq.seq_id, self.rng.randint(seq.num_computed, capacity))
        self.bm.publish(seq.seq_id, seq.tokens, seq.num_computed)
        if len(seq.tokens) >= seq.max_len:
            self.finish(seq, "finished")

    def preempt(self, seq: SimSeq) -> None:
        """Free now, recompute later from prompt + generated tokens (the last one uncomputed)."""
        self.bm.free(seq.seq_id)
        del self.running[seq.seq_id]
        self.waiting.appendleft(seq)
        self.counts["preempted"] += 1

    def finish(self, seq: SimSeq, why: str) -> None:
        self.bm.free(seq.seq_id)
        del self.running[seq.seq_id]
        self.counts[why] += 1

    def alloc_counting_evictions(self, allocate):
        # Allocation never publishes, so any cache entry lost during it was evicted.
        before = len(self.raw._cache)
        try:
            return allocate()
        finally:
            self.counts["evicted"] += before - len(self.raw._cache)


@pytest.mark.parametrize(
    "seed, block_size, num_blocks, enable_prefix_cache",
    [(0, 4, 40, True), (1, 4, 40, True), (2, 16, 10, True), (3, 1, 160, True), (4, 4, 40, False)],
)
def test_randomized_stress(seed, block_size, num_blocks, enable_prefix_cache):
    """200 random requests with shared prefixes, tree steps, truncation, cancels and preemption:
    integrity holds after every call, hits serve exactly the right KV, and the pool ends whole."""
    rng = random.Random(seed)
    bm = make(num_blocks, block_size, enable_prefix_cache)
    sim = Sim(rng, bm)
    next_id = 0
    while next_id < NUM_REQUESTS or sim.waiting or sim.running:
        r = rng.random()
        if next_id < NUM_REQUESTS and r < 0.15:
            sim.new_request(next_id)
            next_id += 1
        elif sim.waiting and (r < 0.35 or not sim.running):
            sim.admit()
        elif sim.running and r < 0.95:
            sim.step(sim.running[rng.choice(list(sim.running))])
        elif sim.running and r < 0.975:
            sim.finish(sim.running[rng.choice(list(sim.running))], "cancelled")
        elif sim.running:
            sim.preempt(sim.running[rng.choice(list(sim.running))])
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_used_blocks == 0
    done = sim.counts["finished"] + sim.counts["cancelled"] + sim.counts["cancelled_mid_step"]
    assert done == NUM_REQUESTS
    # The run must have exercised the paths it claims to test.
    assert sim.counts["preempted"] > 0 and sim.counts["refused"] > 0
    if enable_prefix_cache:
        assert sim.counts["cached_tokens"] > 0 and sim.counts["evicted"] > 0
        assert bm.prefix_hits == sim.counts["cached_tokens"] and bm.prefix_queries >= bm.prefix_hits
    else:
        assert bm.prefix_queries == bm.prefix_hits == 0


def test_a_growing_sequence_takes_the_block_after_its_last_when_free():
    """Runs of physical blocks let attention read a sequence as a view (no gather)."""
    bm = make(16)
    bm.allocate(1, list(range(6)))                 # blocks 0, 1
    bm.allocate(2, [100, 101, 102])                # block 2
    bm.free(2)                                     # 2 goes to the back of the free list
    bm.ensure_slots(1, 9)
    assert bm.block_table(1) == [0, 1, 2]          # not 3, the oldest free block
    bm.ensure_slots(1, 13)
    bm.truncate(1, 12)                             # a tree step's temporary block comes back...
    bm.allocate(3, [7])                            # ...and another sequence takes the oldest free
    bm.ensure_slots(1, 13)
    assert bm.block_table(1) == [0, 1, 2, 3] and bm.block_table(3) == [4]
    bm.check_integrity()


def test_a_prefix_hit_grows_into_its_stale_continuation_and_evicts_nothing_else_out_of_order():
    bm = make(6)
    admit(bm, 1, list(range(12)))                  # blocks 0, 1, 2
    admit(bm, 2, list(range(100, 104)))            # block 3
    admit(bm, 3, list(range(200, 204)))            # block 4
    admit(bm, 4, list(range(300, 304)))            # block 5
    for seq in (4, 3, 2, 1):
        bm.free(seq)                               # LRU: 5, 4, 3, 2, 1, 0
    bm.allocate(5, list(range(8)) + [50, 51, 52])  # hits 0, 1, then diverges
    assert bm.block_table(5) == [0, 1, 2]          # block 2 continued block 1: taken before LRU head 5
    bm.allocate(6, list(range(100, 104)) + [7, 7])  # hits 3; block 4 is cached but starts another prompt
    assert bm.block_table(6) == [3, 5]             # so the LRU head goes, and block 4 stays cached
    bm.free(5)
    assert bm.allocate(7, list(range(200, 204)) + [9]) == 4   # a prefix hit on block 4
    bm.check_integrity()


def test_a_prompt_diverging_inside_a_block_replaces_the_orphaned_rest_in_order():
    bm = make(5)
    admit(bm, 1, list(range(12)))                  # blocks 0, 1, 2
    admit(bm, 2, list(range(100, 108)))            # blocks 3, 4
    bm.free(2)
    bm.free(1)                                     # LRU: 4, 3, 2, 1, 0; no block free
    bm.allocate(3, list(range(6)) + [60] * 6)      # hits 0; diverges inside block 1
    # block 1 continues block 0; block 2 hangs off block 1's old hash, now gone: an orphan
    assert bm.block_table(3) == [0, 1, 2]
    bm.free(3)
    assert bm.allocate(4, list(range(100, 108)) + [5]) == 8    # seq 2's blocks are still cached
    bm.check_integrity()


def test_prompts_sharing_a_first_block_keep_each_others_blocks_while_the_pool_has_room():
    """Two conversations with one system prompt (block 0): the second diverges after it and
    takes free blocks, so the first's turn is still cached when it comes back."""
    bm = make(16)
    first, second = list(range(12)), list(range(4)) + [50] * 8
    admit(bm, 1, first)                            # blocks 0, 1, 2
    bm.free(1)
    assert admit(bm, 2, second) == 4               # hits block 0 only
    assert 1 not in bm.block_table(2) and 2 not in bm.block_table(2)
    bm.free(2)
    assert admit(bm, 3, first + [9]) == 12         # the first prompt whole from the cache
    bm.check_integrity()


# ----- reset -----------------------------------------------------------------------------


def test_reset_prefix_cache_forgets_unused_blocks_and_keeps_held_ones():
    bm = make(8)
    shared, other = list(range(9)), [50 + t for t in range(9)]
    admit(bm, 0, shared)
    admit(bm, 1, other)
    bm.free(1)                                       # its two full blocks stay cached, unused
    assert bm.reset_prefix_cache() == 2
    bm.check_integrity()
    assert bm.num_free_blocks == 8 - 3               # seq 0 still holds its three blocks
    assert admit(bm, 2, other) == 0                  # forgotten: computed again
    assert admit(bm, 3, shared) == 8                 # held by seq 0: still shared
    assert bm.reset_prefix_cache() == 0

"""The datastore drafter: its n-gram table against brute-force counts, the chain it
proposes, the order of preference (context match, datastore, n-gram guess), the cache and
bad input. T=0 identity and block accounting run with the other drafters in
test_speculative_engine.py."""
from __future__ import annotations

import json
import random
from collections import Counter, defaultdict

import pytest

from drafters.base import DraftRequest
from drafters.datastore import DatastoreConfig, DatastoreDrafter, NgramTable, load_or_build
from spec.sampling_params import SamplingParams


def brute_force(seqs, max_n, min_count):
    """context -> (most frequent follower, smaller id on ties; its share), within sequences."""
    out = {}
    for n in range(1, max_n + 1):
        counts = defaultdict(Counter)
        for s in seqs:
            for i in range(n, len(s)):
                counts[tuple(s[i - n:i])][s[i]] += 1
        for ctx, c in counts.items():
            total = sum(c.values())
            if total >= min_count:
                best = max(c.values())
                out[ctx] = (min(t for t, v in c.items() if v == best), best / total)
    return out


def test_table_matches_brute_force_counts():
    rng = random.Random(0)
    seqs = [[rng.randrange(6) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    table = NgramTable.build(seqs, max_n=3, min_count=2)
    ref = brute_force(seqs, 3, 2)
    assert table.num_contexts == len(ref)
    for ctx, (tok, share) in ref.items():
        got = table.follower(list(ctx))
        assert got is not None and got[0] == tok and got[1] == pytest.approx(share), ctx


def test_contexts_do_not_span_sequences_and_rare_ones_are_dropped():
    table = NgramTable.build([[1, 2], [3, 4], [1, 2, 5], [9, 8]], max_n=2, min_count=2)
    assert table.follower([1]) == (2, 1.0)            # seen twice
    assert table.follower([2]) is None                # 2 -> 5 once; "2 then 3" crosses sequences
    assert table.follower([9]) is None                # seen once
    tiny = NgramTable.build([[5]], max_n=3, min_count=1)      # shorter than the contexts
    assert tiny.num_contexts == 0 and tiny.chain([5], 3, 0.0) == []


def test_longest_known_suffix_wins_and_chain_stops_on_low_share():
    seqs = [[7, 1, 2, 3]] * 3 + [[8, 1, 2, 4]] * 3 + [[1, 2, 4]]
    table = NgramTable.build(seqs, max_n=3, min_count=2)
    assert table.follower([7, 1, 2]) == (3, 1.0)      # the 3-token context decides
    assert table.follower([5, 1, 2])[0] == 4          # back-off to "1 2": 4 of 7
    assert table.chain([7], depth=3, min_prob=0.9) == [1, 2, 3]
    assert table.chain([1], depth=3, min_prob=0.9) == [2]       # "1 2" -> 4 has share 4/7 only
    assert table.chain([1], depth=3, min_prob=0.5) == [2, 4]
    assert table.chain([1], depth=1, min_prob=0.0) == [2]


def test_save_and_load_round_trip(tmp_path):
    table = NgramTable.build([[1, 2, 3, 1, 2, 3]], max_n=2, min_count=1)
    table.save(tmp_path / "t.npz")
    loaded = NgramTable.load(tmp_path / "t.npz")
    assert loaded.max_n == 2 and loaded.num_contexts == table.num_contexts
    assert loaded.chain([1], 2, 0.0) == table.chain([1], 2, 0.0) == [2, 3]


def request(tokens, depth=4, nodes=4, topk=1):
    return DraftRequest(0, tokens, SamplingParams(temperature=0), None, depth, nodes, topk)


def paths(proposal):
    tree = proposal.tree
    return [tree.tokens[j] for j in range(1, tree.num_nodes)]


def test_drafter_prefers_a_context_match_then_the_datastore_then_the_ngram_guess():
    table = NgramTable.build([[10, 11, 12, 13]] * 2, max_n=2, min_count=2)
    drafter = DatastoreDrafter(table, DatastoreConfig(max_depth=3, min_prob=0.5))
    # "5 6" occurred before: the context's own continuation, not the datastore.
    assert paths(drafter.propose([request([5, 6, 7, 8, 5, 6])])[0]) == [7, 8, 5, 6]
    drafter.release(0)
    # No context match of 2 tokens: the datastore's chain after 10.
    assert paths(drafter.propose([request([1, 2, 3, 10])])[0]) == [11, 12, 13]
    drafter.release(0)
    # Neither: the n-gram drafter's unigram guess (the context's most frequent token).
    assert paths(drafter.propose([request([4, 4, 3])])[0]) == [4]
    drafter.release(0)
    assert paths(drafter.propose([request([1, 2, 3, 10], depth=2, nodes=2)])[0]) == [11, 12]


def write_corpus(path, replies):
    with open(path, "w") as f:
        for i, r in enumerate(replies):
            f.write(json.dumps({"id": str(i), "conversations": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": r}]}) + "\n")


class FakeTokenizer:
    vocab = {"a": 0, "b": 1}

    def __init__(self):
        self.calls = 0

    def encode(self, text, add_special_tokens=False):
        self.calls += 1
        return [ord(c) for c in text]


def test_table_is_cached_per_corpus(tmp_path):
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, ["abcabc", "abcd"])
    tok, cfg = FakeTokenizer(), DatastoreConfig(max_n=2)
    first = load_or_build([str(corpus)], tok, cfg, tmp_path / "cache")
    assert tok.calls == 2 and first.follower([ord("a")]) == (ord("b"), 1.0)
    again = load_or_build([str(corpus)], tok, cfg, tmp_path / "cache")
    assert tok.calls == 2 and again.num_contexts == first.num_contexts      # from the cache
    write_corpus(corpus, ["xyxy"])                                          # the file changed
    rebuilt = load_or_build([str(corpus)], tok, cfg, tmp_path / "cache")
    assert tok.calls == 3 and rebuilt.follower([ord("x")]) == (ord("y"), 1.0)


def test_bad_input_is_refused(tmp_path, tiny_llama_dir):
    from spec import LLM
    with pytest.raises(ValueError, match="needs conversation files"):
        LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=8, drafter="datastore")
    with pytest.raises(ValueError, match="not found: .*missing.jsonl"):
        LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=8, drafter=f"datastore:{tmp_path}/missing.jsonl")
    with pytest.raises(ValueError, match="min_prob"):
        DatastoreConfig(min_prob=1.5)

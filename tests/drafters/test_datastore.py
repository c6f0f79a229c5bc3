"""The datastore drafter: its n-gram table against brute-force counts, the tree it
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
from verifier.sampling.sampling_params import SamplingParams


def brute_force(seqs, max_n, min_count, fanout):
    """context -> [(follower, share)] of its `fanout` most frequent followers (smaller id on
    ties), within sequences."""
    out = {}
    for n in range(1, max_n + 1):
        counts = defaultdict(Counter)
        for s in seqs:
            for i in range(n, len(s)):
                counts[tuple(s[i - n:i])][s[i]] += 1
        for ctx, c in counts.items():
            total = sum(c.values())
            if total >= min_count:
                ranked = sorted(c.items(), key=lambda tv: (-tv[1], tv[0]))[:fanout]
                out[ctx] = [(t, v / total) for t, v in ranked]
    return out


@pytest.mark.parametrize("fanout", [1, 3])
def test_table_matches_brute_force_counts(fanout):
    rng = random.Random(0)
    seqs = [[rng.randrange(6) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    table = NgramTable.build(seqs, max_n=3, min_count=2, fanout=fanout)
    ref = brute_force(seqs, 3, 2, fanout)
    assert table.num_contexts == len(ref)
    for ctx, expected in ref.items():
        got = table.followers(list(ctx))
        assert [t for t, _ in got] == [t for t, _ in expected], ctx
        assert [p for _, p in got] == pytest.approx([p for _, p in expected]), ctx


def test_contexts_do_not_span_sequences_and_rare_ones_are_dropped():
    table = NgramTable.build([[1, 2], [3, 4], [1, 2, 5], [9, 8]], max_n=2, min_count=2, fanout=2)
    assert table.followers([1]) == [(2, 1.0)]           # seen twice; no second follower
    assert table.followers([2]) == []                   # 2 -> 5 once; "2 then 3" crosses sequences
    assert table.followers([9]) == []                   # seen once
    tiny = NgramTable.build([[5]], max_n=3, min_count=1)      # shorter than the contexts
    assert tiny.num_contexts == 0 and tiny.followers([5]) == []


def test_longest_known_suffix_wins():
    seqs = [[7, 1, 2, 3]] * 3 + [[8, 1, 2, 4]] * 3 + [[1, 2, 4]]
    table = NgramTable.build(seqs, max_n=3, min_count=2, fanout=2)
    assert table.followers([7, 1, 2]) == [(3, 1.0)]     # the 3-token context decides
    assert table.followers([5, 1, 2]) == [(4, pytest.approx(4 / 7)), (3, pytest.approx(3 / 7))]


def test_save_and_load_round_trip(tmp_path):
    table = NgramTable.build([[1, 2, 3, 1, 2, 4]], max_n=2, min_count=1, fanout=2)
    table.save(tmp_path / "t.npz")
    loaded = NgramTable.load(tmp_path / "t.npz")
    assert loaded.max_n == 2 and loaded.num_contexts == table.num_contexts
    assert loaded.followers([2]) == table.followers([2]) == [(3, 0.5), (4, 0.5)]


def request(tokens, depth=4, nodes=4, topk=1):
    return DraftRequest(0, tokens, SamplingParams(temperature=0), None, depth, nodes, topk)


def nodes(proposal):
    """(token, parent token) of each draft node, in tree order (root excluded)."""
    tree = proposal.tree
    return [(tree.tokens[j], tree.tokens[tree.parents[j]]) for j in range(1, tree.num_nodes)]


def test_drafter_prefers_a_context_match_then_the_datastore_then_the_ngram_guess():
    table = NgramTable.build([[10, 11, 12, 13]] * 2, max_n=2, min_count=2)
    drafter = DatastoreDrafter(table, DatastoreConfig())
    # "5 6" occurred before: the context's own continuation, not the datastore.
    assert nodes(drafter.propose([request([5, 6, 7, 8, 5, 6])])[0]) == [(7, 6), (8, 7), (5, 8), (6, 5)]
    drafter.release(0)
    # No context match of 2 tokens: the datastore's chain after 10 (share 1 each), then
    # the n-gram drafter's unigram guess (2, the first of the tokens it counts) ranked at guess_prob.
    assert nodes(drafter.propose([request([1, 2, 3, 10], topk=3)])[0]) == [(11, 10), (12, 11), (13, 12), (2, 10)]
    drafter.release(0)
    # Neither: the n-gram drafter's unigram guess alone.
    assert nodes(drafter.propose([request([4, 4, 3])])[0]) == [(4, 3)]
    drafter.release(0)
    assert nodes(drafter.propose([request([1, 2, 3, 10], depth=2, nodes=2)])[0]) == [(11, 10), (12, 11)]


def test_datastore_tree_keeps_the_most_probable_paths():
    # After 10: 11 three times in four (then 12 always), 20 once in four (then 21).
    table = NgramTable.build([[10, 11, 12]] * 3 + [[10, 20, 21]], max_n=2, min_count=1, fanout=3)
    drafter = DatastoreDrafter(table, DatastoreConfig(guess_prob=0.2))
    tree = lambda **kw: nodes(drafter.propose([request([5, 5, 10], **kw)])[0])     # noqa: E731
    # 11 (0.75), 11 12 (0.75), 20 (0.25), 20 21 (0.25), then the guess 5 (0.2).
    assert tree(nodes=3, topk=3) == [(11, 10), (12, 11), (20, 10)]
    assert tree(nodes=5, topk=3) == [(11, 10), (12, 11), (20, 10), (21, 20), (5, 10)]
    assert tree(nodes=5, depth=1, topk=3) == [(11, 10), (20, 10), (5, 10)]   # depth caps it
    assert tree(nodes=5, topk=1) == [(11, 10), (12, 11)]                     # one child per node
    shallow = DatastoreDrafter(table, DatastoreConfig(max_depth=1))
    assert nodes(shallow.propose([request([5, 5, 10], nodes=5, topk=3)])[0]) == [(11, 10), (20, 10), (5, 10)]
    ranked_higher = DatastoreDrafter(table, DatastoreConfig(guess_prob=0.5))
    assert nodes(ranked_higher.propose([request([5, 5, 10], nodes=3, topk=3)])[0]) == [(11, 10), (12, 11), (5, 10)]


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
    assert tok.calls == 2 and first.followers([ord("a")])[0] == (ord("b"), 1.0)
    again = load_or_build([str(corpus)], tok, cfg, tmp_path / "cache")
    assert tok.calls == 2 and again.num_contexts == first.num_contexts      # from the cache
    write_corpus(corpus, ["xyxy"])                                          # the file changed
    rebuilt = load_or_build([str(corpus)], tok, cfg, tmp_path / "cache")
    assert tok.calls == 3 and rebuilt.followers([ord("x")])[0] == (ord("y"), 1.0)


def test_bad_input_is_refused(tmp_path, tiny_llama_dir):
    from spec import LLM
    with pytest.raises(ValueError, match="needs conversation files"):
        LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=8, drafter="datastore")
    with pytest.raises(ValueError, match="not found: .*missing.jsonl"):
        LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=8, drafter=f"datastore:{tmp_path}/missing.jsonl")
    with pytest.raises(ValueError, match="guess_prob"):
        DatastoreConfig(guess_prob=1.5)
    with pytest.raises(ValueError, match="fanout"):
        DatastoreConfig(fanout=0)

"""The prefix-affinity policy (serving/cluster/prefix_index.py) without Ray: the key, the chunk hashes,
the index and the choice between the prefix's replica and the least loaded one."""
from __future__ import annotations

import pytest

from serving.cluster.prefix_index import AffinityConfig, Candidate, PrefixIndex, choose, chunk_hashes, prefix_text

CFG = AffinityConfig(chunk_chars=8, imbalance_threshold=2)


def test_prefix_text_keeps_roles_and_order():
    """Chat bodies render role then content per message, so a system prompt moved into the user
    turn is a different prefix; completions use the (first) prompt; anything else routes by load."""
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]}
    assert prefix_text(chat) == "<|system|>\nS\n<|user|>\nU\n"
    assert prefix_text({"messages": [{"role": "user", "content": "SU"}]}) != prefix_text(chat)
    assert prefix_text({"prompt": ["first", "second"]}) == "first"
    assert prefix_text({"prompt": [1, 2, 3]}) == "" and prefix_text({}) == ""


def test_chunk_hashes_name_whole_prefixes():
    """Hash i covers everything up to chunk i: equal chunks after different prefixes differ, a
    shared prefix shares its leading hashes, and a partial last chunk is not hashed."""
    a, b = chunk_hashes("AAAAAAAA" "BBBBBBBB" "CC", 8), chunk_hashes("AAAAAAAA" "BBBBBBBB" "DDDDDDDD", 8)
    assert len(a) == 2 and a == b[:2]
    assert chunk_hashes("XXXXXXXX" "BBBBBBBB", 8)[1] != a[1]


def test_index_matches_leading_chunks_and_forgets_lru():
    """A replica matches the leading chunks it holds; beyond its cap the least recently used go."""
    index = PrefixIndex(AffinityConfig(chunk_chars=8, max_chunks_per_replica=3))
    h = chunk_hashes("0" * 8 * 5, 8)
    index.insert("r1", h[:2])
    assert index.matched("r1", h) == 2 and index.matched("r2", h) == 0
    index.insert("r1", h[2:5])
    assert index.stored("r1") == 3 and index.matched("r1", h) == 0     # its first chunks were evicted
    index.keep_only({"r2"})
    assert index.stored("r1") == 0


def test_choose_prefers_the_prefix_holder_until_it_is_overloaded():
    """The longest match wins while its load is within the threshold of the least loaded replica;
    above it, the least loaded replica takes the request."""
    holder, idle = Candidate("a", load=2, matched=5, stored=50), Candidate("b", load=0, matched=0, stored=0)
    assert choose([holder, idle], CFG).replica == "a"
    busy = Candidate("a", load=3, matched=5, stored=50)
    assert choose([busy, idle], CFG).reason == "overloaded" and choose([busy, idle], CFG).replica == "b"
    longer = Candidate("b", load=1, matched=6, stored=60)
    assert choose([holder, longer], CFG).replica == "b"


def test_choose_spreads_unrelated_requests():
    """Without a holder: the least loaded, then the one holding the fewest chunks."""
    a, b = Candidate("a", 0, 0, stored=10), Candidate("b", 0, 0, stored=3)
    assert choose([a, b], CFG) == choose([b, a], CFG) and choose([a, b], CFG).replica == "b"
    assert choose([a, Candidate("b", 1, 0, 3)], CFG).replica == "a"
    assert choose([a, b], CFG).reason == "load"
    with pytest.raises(ValueError):
        choose([], CFG)


def test_config_refuses_bad_knobs():
    """Frozen config, checked when built."""
    with pytest.raises(ValueError, match="chunk_chars"):
        AffinityConfig(chunk_chars=0)
    with pytest.raises(ValueError, match="imbalance_threshold"):
        AffinityConfig(imbalance_threshold=-1)

"""Suffix decoding's proposals: the longest repeated suffix drafts what followed it, as many
nodes as its length allows; repeated continuations branch by frequency; finished outputs
draft for other requests until they are evicted; options parse and are checked."""
import dataclasses

import pytest

from drafters.base import DraftRequest
from drafters.config import SpecConfig
from drafters.suffix import SuffixConfig, SuffixDrafter
from drafters.suffix_index import SuffixIndex
from spec import SamplingParams


def propose(d: SuffixDrafter, tokens: list[int], seq_id: int = 0, num_prompt: int = 0, nodes: int = 8,
            depth: int = 8, topk: int = 4):
    req = DraftRequest(seq_id, tokens, SamplingParams(temperature=0), None, max_depth=depth, max_nodes=nodes,
                       topk=topk, num_prompt=num_prompt)
    prop = d.propose([req])[0]
    assert prop.tree.tokens[0] == tokens[-1]
    return prop


def paths(prop) -> list[tuple[int, ...]]:
    """Every root-to-leaf path's tokens below the root."""
    tree, out = prop.tree, []
    kids = {i: [j for j in range(tree.num_nodes) if tree.parents[j] == i] for i in range(tree.num_nodes)}

    def walk(i, acc):
        if not kids[i]:
            out.append(tuple(acc))
        for j in kids[i]:
            walk(j, acc + [tree.tokens[j]])
    walk(0, [])
    return out


def test_a_repeated_passage_drafts_as_many_tokens_as_it_matched():
    d = SuffixDrafter()
    #            a 4-token match (1 2 3 4) may draft 4 nodes: 5 6 7 8
    prop = propose(d, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4])
    assert paths(prop) == [(5, 6, 7, 8)]
    assert prop.scores == (1.0, 1.0, 1.0, 1.0) and prop.score_kind == "suffix"
    # spec factor 2 doubles the allowance; the request's depth still caps it
    d2 = SuffixDrafter(SuffixConfig(max_spec_factor=2.0))
    assert paths(propose(d2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4], depth=6)) == [(5, 6, 7, 8, 9, 1)]


def test_continuations_branch_by_frequency_and_unlikely_ones_are_left_out():
    # after "1 2 3": 4 three times, 9 once
    tokens = [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 9, 0, 1, 2, 3, 4, 0, 5, 1, 2, 3]
    prop = propose(SuffixDrafter(SuffixConfig(max_spec_factor=2.0)), tokens)
    tree = prop.tree
    assert tree.tokens[1] == 4 and prop.scores[0] == pytest.approx(0.75)
    assert 9 in tree.tokens and prop.scores[tree.tokens.index(9) - 1] == pytest.approx(0.25)
    # the most likely child comes first under each node, and scores never grow with depth
    assert all(prop.scores[i] <= prop.scores[tree.parents[i + 1] - 1] for i in range(len(prop.scores))
               if tree.parents[i + 1] > 0)
    strict = propose(SuffixDrafter(SuffixConfig(max_spec_factor=2.0, min_token_prob=0.3)), tokens)
    assert 9 not in strict.tree.tokens


def test_no_repeat_no_draft():
    prop = propose(SuffixDrafter(), [5, 6, 7, 8, 9, 10])
    assert prop.tree.num_nodes == 1


def test_forced_tokens_ahead_are_matched_but_not_learned():
    d = SuffixDrafter()
    tokens = [1, 2, 5, 6, 7, 8, 9, 3]
    req = DraftRequest(0, tokens + [5, 6, 7], SamplingParams(temperature=0), None, max_depth=3, max_nodes=3,
                       unverified=3)
    assert d.propose([req])[0].tree.tokens == (7, 8, 9, 3)
    assert d.state[0].seqs[0] == tokens


def test_a_finished_output_drafts_for_another_request_until_it_is_evicted():
    d = SuffixDrafter(SuffixConfig(max_cached_requests=1))
    d.finish(1, [5, 5, 5, 40, 41, 42, 43, 44, 45, 46], num_prompt=3)
    d.release(1)
    # another request, another prompt, whose output begins like the cached reply
    assert paths(propose(d, [7, 8, 9, 40, 41, 42], seq_id=2, num_prompt=3)) == [(43, 44, 45)]
    d.finish(2, [7, 8, 9, 40, 41, 42], num_prompt=3)
    d.finish(3, [7, 8, 9, 60, 61, 62], num_prompt=3)      # one cached output at most: the newest stays
    assert paths(propose(d, [7, 8, 9, 40, 41, 42], seq_id=4, num_prompt=3)) == [()]
    d.forget_history()
    assert not d.served.seqs


def test_replies_are_drafted_from_how_other_replies_began():
    """The cross-request index keeps each output after its prompt's last two tokens (the chat
    template's assistant header): a new reply's first tokens are drafted from the cached ones."""
    d = SuffixDrafter()
    header = [90, 91]
    d.finish(1, [1, 2, 3] + header + [50, 51, 52], num_prompt=5)
    d.finish(2, [4, 5] + header + [50, 51, 53], num_prompt=4)
    prop = propose(d, [6, 7, 8] + header + [50], seq_id=3, num_prompt=5)
    assert prop.tree.tokens[:2] == (50, 51) and prop.scores[0] == 1.0


def test_running_outputs_draft_for_each_other_and_come_back_after_preemption():
    d = SuffixDrafter()
    propose(d, [1, 1, 20, 21, 22, 23, 24], seq_id=1, num_prompt=2)
    assert paths(propose(d, [2, 2, 20, 21], seq_id=2, num_prompt=2)) == [(22, 23)]
    d.release(1)                         # preempted: its output stays, not yet counted as finished
    assert 1 in d.served.seqs and d.cached_outputs == 0
    propose(d, [1, 1, 20, 21, 22, 23, 24, 25], seq_id=1, num_prompt=2)
    assert d.served.seqs[1] == [1, 1, 20, 21, 22, 23, 24, 25]


def test_no_cache_keeps_requests_to_their_own_tokens():
    d = SuffixDrafter(SuffixConfig(max_cached_requests=0))
    d.finish(1, [3, 40, 41, 42, 43], num_prompt=1)
    assert paths(propose(d, [7, 40, 41], seq_id=2, num_prompt=1)) == [()]


def test_index_drops_sequences_and_rebuilds_without_them():
    index = SuffixIndex()
    for s in range(6):
        index.extend(s, [s, 100, 101, s + 10])
    for s in range(5):
        index.drop(s)
    found = index.occurrences([100, 101], max_len=8, limit=10)
    assert [seq[pos] for (seq, pos), _ in found] == [15]
    assert index._dead == 0              # five stale entries outnumbered the live tokens: rebuilt


def test_match_length_counts_back_to_the_longest_common_suffix():
    index = SuffixIndex()
    index.extend(0, [9, 1, 2, 3, 7, 5, 2, 3, 8])
    found = index.occurrences([4, 1, 2, 3], max_len=24, limit=10)
    assert sorted(m for _, m in found) == [2, 3]


def test_options_parse_and_are_checked():
    assert SuffixConfig.parse("max_depth=32,min_token_prob=0.05") == SuffixConfig(max_depth=32, min_token_prob=0.05)
    for bad in ("depth=3", "max_depth", "max_depth=1", "min_token_prob=2"):
        with pytest.raises(ValueError):
            SuffixConfig.parse(bad)


def test_suffix_joins_the_tree_merge_with_its_options():
    from drafters.kinds import build_drafter
    merged = build_drafter("tree:suffix:max_depth=8+ngram", None, None)
    assert [p.name for p in merged.parts] == ["suffix", "ngram"] and merged.parts[0].config.max_depth == 8
    tokens = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4]
    req = DraftRequest(0, tokens, SamplingParams(temperature=0), None, max_depth=4, max_nodes=8, topk=2)
    assert merged.propose([req])[0].tree.tokens[:3] == (4, 5, 6)
    merged.finish(0, tokens, 2)
    assert merged.parts[0].cached_outputs == 1


def test_a_tree_in_its_own_shape_gives_each_part_its_own():
    """`tree:eagle3+suffix` with no shape given: the deepest and widest of its parts' shapes and
    their nodes summed; each part drafts its own shape capped by the request's (the head's depth
    2 and 4 nodes, suffix decoding's 16), where a given shape splits the nodes equally."""
    from drafters.kinds import build_drafter, default_speculation
    shape = default_speculation("tree:suffix+ngram")
    assert (shape.num_speculative_tokens, shape.topk, shape.max_nodes) == (16, 4, 20)
    assert default_speculation("tree:eagle3+suffix").max_nodes == 4 + 16
    own = build_drafter("tree:suffix+ngram", None, shape)
    req = DraftRequest(0, [1, 2, 3], SamplingParams(temperature=0), None, max_depth=16, max_nodes=20, topk=4)
    suffix_req, ngram_req = (own._part_request(req, i) for i in range(2))
    assert (suffix_req.max_depth, suffix_req.topk, suffix_req.max_nodes) == (16, 4, 16)
    assert (ngram_req.max_depth, ngram_req.topk, ngram_req.max_nodes) == (4, 1, 4)
    capped = own._part_request(dataclasses.replace(req, max_depth=2, max_nodes=10), 0)
    assert (capped.max_depth, capped.max_nodes) == (2, 8)
    given = build_drafter("tree:suffix+ngram", None, SpecConfig(num_speculative_tokens=6, topk=2, budget=8))
    assert given.shapes is None
    assert [(p.max_depth, p.topk, p.max_nodes) for p in (given._part_request(req, i) for i in range(2))] == \
        [(16, 4, 10)] * 2

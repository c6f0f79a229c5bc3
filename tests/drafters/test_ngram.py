"""The n-gram drafter's proposals: the longest matching suffix wins, weak matches draft their most
frequent follower, and with nothing matched the context's most frequent token is guessed."""
import pytest

from drafters.base import DraftRequest
from drafters.ngram import NgramConfig, NgramDrafter
from spec import SamplingParams


def propose(drafter: NgramDrafter, tokens: list[int], depth: int = 4, topk: int = 1, seq_id: int = 0) -> list[list[int]]:
    req = DraftRequest(seq_id, tokens, SamplingParams(temperature=0), None, max_depth=depth,
                       max_nodes=depth * topk, topk=topk)
    tree = drafter.propose([req])[0].tree
    assert tree.tokens[0] == tokens[-1]
    return [tree.tokens[i] for i in range(1, len(tree.tokens))]


def test_a_long_match_drafts_to_full_depth_from_its_most_recent_occurrence():
    d = NgramDrafter()
    #               5  6  7  8  9 ...           ... 5  6  7 -> 8 9 1 2
    tokens = [1, 2, 5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7]
    assert propose(d, tokens) == [8, 9, 1, 2]


def test_forced_tokens_ahead_are_matched_but_not_learned():
    """Drafting after the grammar's forced tokens (`unverified`): the suffix they end is looked
    up, but the index does not learn them (the target may spell the forced text otherwise)."""
    d = NgramDrafter()
    tokens = [1, 2, 5, 6, 7, 8, 9, 3]
    req = DraftRequest(0, tokens + [5, 6], SamplingParams(temperature=0), None, max_depth=3, max_nodes=3,
                       unverified=2)
    tree = d.propose([req])[0].tree
    assert tree.tokens == (6, 7, 8, 9)
    assert d._index[0].seen == len(tokens)


def test_a_weak_match_drafts_one_token():
    d = NgramDrafter(NgramConfig(min_n=1, max_n=5, weak_n=1))
    tokens = [4, 9, 9, 9, 3, 8, 4]                  # only the unigram [4] recurs
    assert propose(d, tokens) == [9]
    strong = NgramDrafter(NgramConfig(min_n=1, max_n=5, weak_n=0))
    assert propose(strong, tokens) == [9, 9, 9, 3]


def test_a_weak_match_drafts_its_most_frequent_follower():
    d = NgramDrafter()
    tokens = [4, 9, 2, 4, 9, 5, 4, 7, 6, 4]          # [4] was followed by 9, 9, 7
    assert propose(d, tokens) == [9]
    assert propose(NgramDrafter(NgramConfig(max_branches=2)), tokens, topk=2) == [9, 7]


def test_no_match_guesses_the_most_frequent_token():
    tokens = [3, 8, 8, 5, 8, 6]                      # 6 never occurred before
    assert propose(NgramDrafter(), tokens) == [8]
    assert propose(NgramDrafter(NgramConfig(min_n=1)), tokens) == []


def test_min_n_above_weak_n_ignores_short_matches():
    d = NgramDrafter(NgramConfig(min_n=3, max_n=5))
    assert propose(d, [4, 9, 9, 9, 3, 8, 4]) == []


def test_config_is_checked():
    with pytest.raises(ValueError, match="weak_n"):
        NgramConfig(weak_n=-1)
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramConfig(min_n=4, max_n=2)
    with pytest.raises(ValueError, match="max_n >= 1"):
        NgramConfig(min_n=0, max_n=0)

"""The prediction drafter without a model: the chain it proposes as the output follows a
prediction, leaves it (an edit) and comes back to it, and how its chain joins the server
drafter's proposal."""
from __future__ import annotations

import pytest
import torch

from drafters.base import DraftDistributions, DraftRequest, Prediction, Proposal
from drafters.prediction import PredictionDrafter, PredictionIndex, join_prediction
from tree.token_tree import TokenTree
from verifier.sampling.sampling_params import SamplingParams

PROMPT = [900, 901, 902]


def view(output: list[int], prediction: list[int] | None, depth: int = 4, seq_id: int = 0) -> DraftRequest:
    return DraftRequest(seq_id, PROMPT + output, SamplingParams(), None, depth, depth, num_prompt=len(PROMPT),
                        prediction=None if prediction is None else Prediction(tuple(prediction)))


def chain(drafter: PredictionDrafter, output: list[int], prediction: list[int] | None, depth: int = 4) -> list[int]:
    return list(drafter.propose([view(output, prediction, depth)])[0].tree.tokens[1:])


def test_the_chain_follows_the_prediction_while_the_output_takes_it():
    pred = list(range(10, 30))
    d = PredictionDrafter()
    assert chain(d, [10], pred) == [11, 12, 13, 14]
    assert chain(d, [10, 11, 12, 13, 14, 15], pred) == [16, 17, 18, 19]     # took all 4 and a bonus token
    assert chain(d, list(range(10, 30)), pred) == []                          # the prediction is used up


def test_after_an_edit_the_output_picks_the_prediction_up_where_the_unchanged_text_resumes():
    pred = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    d = PredictionDrafter()
    assert chain(d, [1], pred) == [2, 3, 4, 5]
    # a substitution: 99 instead of 4, then the text goes on as predicted from 5
    assert chain(d, [1, 2, 3, 99], pred) == []                 # 99 is nowhere in the prediction
    assert chain(d, [1, 2, 3, 99, 5], pred) == [6, 7, 8, 9]
    # a deletion: 6..8 skipped, the output goes on at 9
    assert chain(d, [1, 2, 3, 99, 5, 9], pred) == [10, 11, 12]


def test_a_repeated_token_resyncs_at_the_occurrence_nearest_after_where_the_output_left():
    pred = [7, 1, 2, 7, 3, 4, 7, 5, 6]
    index = PredictionIndex(tuple(pred), max_n=8)
    assert index.locate([7, 1, 2, 7, 3]) == (5, 1.0)        # in sync from the start
    assert index.locate([7, 1, 2, 7, 3, 8]) is None          # 8 is not in the prediction
    pos, score = index.locate([7, 1, 2, 7, 3, 8, 7])         # one token: the 7 after position 5, not the first
    assert pos == 7 and score == pytest.approx(1 / 9)


def test_the_longest_suffix_wins_over_a_nearer_shorter_one():
    pred = [1, 2, 3, 9, 8, 8, 3, 4]
    index = PredictionIndex(tuple(pred), max_n=8)
    assert index.locate([1, 2, 3, 9, 8]) == (5, 1.0)
    assert index.locate([1, 2, 3, 9, 8, 0]) is None
    # (2, 3) occurs only before where the output left (5); (3) alone also after it, at 7
    assert index.locate([1, 2, 3, 9, 8, 0, 2, 3]) == (3, 2 / 9)


def test_nothing_without_a_prediction_and_state_dropped_on_release():
    d = PredictionDrafter()
    assert chain(d, [1, 2], None) == []
    assert chain(d, [1], [1, 2, 3]) == [2, 3]
    d.release(0)
    assert not d._index


def test_join_merges_point_masses_with_the_chain_first_and_cuts_to_the_budget():
    predicted = Proposal(TokenTree.chain(0, [1, 2, 3]), scores=(1.0,) * 3, score_kind="prediction")
    ngram = Proposal(TokenTree.from_paths(0, [[1, 5], [6]]))
    merged = join_prediction(predicted, ngram, 5)
    assert merged.tree.tokens == (0, 1, 2, 3, 5, 6) and merged.draft is None
    assert join_prediction(predicted, ngram, 4).tree.tokens == (0, 1, 2, 3, 5)
    assert join_prediction(predicted, None, 2).tree.tokens == (0, 1, 2)
    empty = Proposal(TokenTree.single(0))
    assert join_prediction(empty, ngram, 5) is ngram


def test_join_lets_the_chain_replace_a_sampled_tree_whatever_it_drew():
    """A sampled proposal's nodes must be draws from q; the choice reads only the chain."""
    q = torch.full((3, 4), 0.25)
    sampled = Proposal(TokenTree.chain(0, [2, 3]), DraftDistributions(q, "iid"))
    predicted = Proposal(TokenTree.chain(0, [1]))
    assert join_prediction(predicted, sampled, 4) is predicted
    assert join_prediction(Proposal(TokenTree.single(0)), sampled, 4) is sampled


def test_the_chain_is_found_where_the_cut_and_the_grammar_left_it():
    tree = TokenTree((0, 8, 1, 2, 5), (-1, 0, 1, 2, 1))      # forced 8, then the chain 1, 2 and a 5 beside it
    assert tree.follow((1, 2, 3), 1) == [2, 3]
    assert tree.follow((4,), 1) == []
    assert tree.follow((8, 5)) == [1, 4]


def test_prediction_holds_token_ids():
    assert Prediction([1, 2]).token_ids == (1, 2)
    with pytest.raises(ValueError, match="ints >= 0"):
        Prediction((1, -2))

"""bench/replay.py: the accepted path, the step-by-step replay and the speedup bounds (no model)."""
import pytest

from bench.replay import Costs, Policy, Replayed, Reply, accepted, bounds, replay
from drafters.base import LookupDrafter, Proposal
from drafters.config import SpecConfig
from spec.step_cost import CostCurve
from tree.token_tree import TokenTree
from verifier.sampling.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


class Knows(LookupDrafter):
    """Drafts the reply itself, `wrong` tokens off after the first `right` of each draft."""

    def __init__(self, seq: list[int], right: int):
        self.seq, self.right = seq, right

    def propose_one(self, req):
        n = len(req.token_ids)
        draft = self.seq[n:n + req.max_depth]
        draft = draft[:self.right] + [t + 1000 for t in draft[self.right:]]
        return Proposal(TokenTree.chain(req.token_ids[-1], draft))


def test_accepted_follows_the_longest_path_the_reply_takes():
    tree = TokenTree(tokens=[5, 1, 3, 2, 4], parents=[-1, 0, 0, 1, 1])
    assert accepted(tree, [1, 2, 9]) == 2
    assert accepted(tree, [1, 4]) == 2
    assert accepted(tree, [3, 3]) == 1
    assert accepted(tree, [7, 1]) == 0
    assert accepted(tree, [1]) == 1          # the reply ends inside the tree


@pytest.mark.parametrize("right", [0, 1, 3, 8])
def test_replay_emits_every_reply_token_once_and_keeps_what_the_drafter_got_right(right):
    prompt, output = list(range(10, 20)), list(range(100, 150))
    drafter = Knows(prompt + output, right)
    run = replay(drafter, [Reply(prompt, output)], SpecConfig(num_speculative_tokens=4), GREEDY)
    assert sum(a + 1 for _, a in run.steps) == len(output) - 1     # as plain decoding's steps after the first
    assert all(a == min(right, n) for n, a in run.steps)
    if right == 0:
        assert run.tau == 1.0


def test_bounds_on_a_flat_curve_are_tau_and_a_whole_tree_pays_its_rows():
    run = Replayed(steps=[(4, 4), (4, 0), (2, 1)], propose_s=0.0)     # 5 + 1 + 2 tokens in 3 steps
    flat = Costs(CostCurve((1, 8), (5.0, 5.0)), prefill_ms=0.0)
    b = bounds(run, flat, prompts=1)
    assert b["decode_oracle"] == pytest.approx(run.tau) == pytest.approx(8 / 3)
    assert b["decode_whole"] == pytest.approx(run.tau)
    linear = Costs(CostCurve((1, 2), (5.0, 6.0)), prefill_ms=40.0)    # each row 1 ms more
    b = bounds(run, linear, prompts=1)
    assert b["decode_oracle"] == pytest.approx(8 * 5 / (9 + 5 + 6))
    assert b["decode_whole"] == pytest.approx(8 * 5 / (9 + 9 + 7))
    assert b["end_to_end_oracle"] == pytest.approx((40 + 40) / (40 + 20))
    assert b["prefill_share"] == pytest.approx(0.5)


@pytest.mark.parametrize("right", [0, 8])
def test_the_policy_stops_verifying_what_never_pays_and_keeps_what_always_does(right):
    prompt, output = list(range(10, 20)), list(range(100, 300))
    steep = CostCurve((1, 2), (5.0, 7.5))                       # a row costs half a step
    run = replay(Knows(prompt + output, right), [Reply(prompt, output)], SpecConfig(num_speculative_tokens=4),
                 GREEDY, Policy(steep))
    assert sum(a + 1 for _, a in run.steps) == len(output) - 1
    late = run.steps[len(run.steps) // 2:]
    if right == 0:      # probes only: most late steps verify nothing
        assert sum(n > 0 for n, _ in late) < len(late) / 4
    else:               # every node accepted: the controller verifies them
        assert run.tau > 3 and all(n == a for n, a in run.steps)

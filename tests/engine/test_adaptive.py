"""The adaptive controller (spec/adaptive.py) and its cost model (spec/step_cost.py): the
node counts it verifies follow the cost curve and the learned acceptance, a request that
stops paying stops drafting and is probed, and the engine's output stays the target's."""
from __future__ import annotations

import pytest

from drafters.config import SpecConfig
from spec.adaptive import AdaptiveConfig, AdaptiveController, Candidate, RankAcceptance, ScoreAcceptance, \
    best_prefixes
from spec.step_cost import CostCurve, StepCost, StepSample
from spec.request import Submission
from verifier.sampling.sampling_params import SamplingParams


def linear(base: float, per_row: float) -> CostCurve:
    return CostCurve(tuple(range(1, 17)), tuple(base + per_row * (r - 1) for r in range(1, 17)))


# ----- best_prefixes ---------------------------------------------------------------------------

def test_nodes_join_while_they_raise_tokens_per_ms():
    # 10 ms a step, 1 ms a node: a node pays when its chance beats the step's rate (1 token / 10 ms).
    cost = lambda nodes: 10.0 + nodes     # noqa: E731
    assert best_prefixes([[0.9, 0.5, 0.2, 0.05]], 1.0, cost) == [3]
    assert best_prefixes([[0.05, 0.9]], 1.0, cost) == [2]        # a weak first node carrying a strong second
    assert best_prefixes([[0.05, 0.01]], 1.0, cost) == [0]
    assert best_prefixes([], 1.0, cost) == []


def test_the_batch_shares_one_budget_best_nodes_first():
    cost = lambda nodes: 10.0 + nodes     # noqa: E731
    assert best_prefixes([[0.9, 0.1], [0.6, 0.4]], 2.0, cost) == [1, 2]


def test_a_cost_cliff_is_stopped_before():
    # 4 rows cost about as much as 1, the fifth doubles the step (torch's int4 blocks of 4).
    cost = lambda nodes: 10.0 + 0.1 * nodes if nodes < 4 else 20.0 + nodes    # noqa: E731
    assert best_prefixes([[0.5] * 8], 1.0, cost) == [3]


# ----- the cost model --------------------------------------------------------------------------

def test_curve_is_monotone_and_interpolates():
    curve = CostCurve.measured({1: 5.0, 2: 4.0, 4: 8.0, 8: 12.0})     # 2 rows timed low: noise
    assert curve.ms == (5.0, 5.0, 8.0, 12.0)
    assert curve(3) == pytest.approx(6.5) and curve(6) == pytest.approx(10.0)
    assert curve(16) == pytest.approx(20.0)                           # the last slope, carried on
    with pytest.raises(ValueError):
        CostCurve((2, 1), (1.0, 2.0))


def test_step_cost_follows_the_steps_run_and_ignores_prompt_chunks():
    cost = StepCost(linear(5.0, 1.0), smoothing=0.5)
    cost.threads = 2
    cost.observe(StepSample(rows=1, decoding=1, drafting=0, nodes=0, prefill=False,
                            forward_s=0.010, draft_s=0.0, total_s=0.011))
    assert cost.forward_ms(1) == pytest.approx(10.0) and cost.forward_ms(3) == pytest.approx(14.0)
    assert cost.request_ms() == pytest.approx(1.0)
    cost.observe(StepSample(rows=3, decoding=1, drafting=1, nodes=2, prefill=False,
                            forward_s=0.014, draft_s=0.002, total_s=0.018))
    assert cost.draft_ms() == pytest.approx(2.0) and cost.node_ms() == pytest.approx(0.5)
    cost.observe(StepSample(rows=500, decoding=1, drafting=0, nodes=0, prefill=True,
                            forward_s=5.0, draft_s=0.0, total_s=5.0))
    assert cost.forward_ms(1) == pytest.approx(10.0)
    cost.threads = 1                                     # a thread count of its own
    assert cost.forward_ms(1) == pytest.approx(5.0)


def test_drafting_costs_the_forwards_slowdown_after_it_too():
    """A drafter whose lookups leave the caches cold slows the forward after it: the step
    cost learns that beside its own time, and the forward's curve stays the undrafted one."""
    cost = StepCost(linear(4.0, 1.0), smoothing=0.5)
    plain = StepSample(rows=1, decoding=1, drafting=0, nodes=0, prefill=False,
                       forward_s=0.004, draft_s=0.0, total_s=0.0042)
    cut = StepSample(rows=1, decoding=1, drafting=1, nodes=0, prefill=False,      # drafted, verified none
                     forward_s=0.0046, draft_s=0.0002, total_s=0.0051)
    for _ in range(3):
        cost.observe(plain)
    assert cost.slowdown_ms() == 0.0
    for _ in range(6):
        cost.observe(cut)
    assert cost.slowdown_ms() == pytest.approx(0.6) and cost.draft_ms() == pytest.approx(0.3)
    assert cost.drafting_ms() == pytest.approx(0.9)
    assert cost.forward_ms(1) == pytest.approx(4.0, abs=0.05)
    ctl = AdaptiveController(AdaptiveConfig(), cost)
    hist = ctl.history()
    hist.worth = 0.15            # a drafted step's expected gain: above the drafter's time, below its whole cost
    assert 0.15 > cost.draft_ms() / 4.2 and not ctl.drafts(hist, 1, 1)


# ----- acceptance estimates --------------------------------------------------------------------

def test_rank_counts_decay_toward_recent_steps():
    ranks = RankAcceptance(memory=0.5)
    for _ in range(6):
        ranks.observe(2, [1, 2])
    assert ranks.rate(1, prior=0.0, weight=0.1) > 0.9      # about 2 steps' worth at memory 0.5
    for _ in range(6):
        ranks.observe(2, [])
    assert ranks.rate(1, prior=0.0, weight=0.1) < 0.05
    assert ranks.rate(5, prior=0.3, weight=1.0) == pytest.approx(0.3)      # never seen: the prior


def test_scores_are_learned_per_kind_band_and_depth():
    table = ScoreAcceptance(bands=10)
    for _ in range(50):
        table.observe("match", 0.8, 1, True)
        table.observe("match", 0.1, 1, False)
    assert table.rate("match", 0.85, 1, 0.5) > 0.95 and table.rate("match", 0.15, 1, 0.5) < 0.05
    assert table.rate("match", 0.85, 2, 0.5) == 0.5 and table.rate("datastore", 0.85, 1, 0.5) == 0.5
    assert table.key("match", 1.0, 1) == table.key("match", 0.95, 1)        # 1.0 is in the top band


# ----- the controller --------------------------------------------------------------------------

def controller(per_row: float, **kw) -> AdaptiveController:
    return AdaptiveController(AdaptiveConfig(**kw), StepCost(linear(10.0, per_row), smoothing=0.1))


def decoding(ctl: AdaptiveController):
    """A request's history as in a step that is not a probe."""
    hist = ctl.history()
    hist.steps = 1
    return hist


def test_trim_keeps_what_pays_on_this_curve():
    """The same scored chain: all of it where rows are nearly free (a memory-bound forward),
    the sure nodes only where a row costs a tenth of a step, none where it costs more than a
    step."""
    def cand(ctl):
        return Candidate(decoding(ctl), (1, 2, 3, 4), (0.9, 0.9, 0.1, 0.1), "test")
    for per_row, expected in ((0.05, 4), (1.0, 2), (12.0, 0)):
        ctl = controller(per_row, first_guess=0.5)
        for i in range(200):     # learn: the sure nodes always accepted, the unsure ones 1 time in 10 or 20
            ctl.observe(cand(ctl), [1, 2] + [3] * (i % 10 == 0) + [4] * (i % 20 == 0))
        assert ctl.trim([cand(ctl)], decoding=1, base_rows=1) == [expected], per_row


def test_a_prompt_chunk_in_the_step_does_not_make_nodes_cheap():
    """A prompt chunk runs whatever is drafted: the nodes are judged by what they add to the
    step against plain decoding without the chunk, so the cut is the chunk-free one. Counted as
    decode work, a 200-row chunk would make plain decoding look 20 times slower and keep every node."""
    def cand(ctl):
        return Candidate(decoding(ctl), (1, 2, 3, 4), (0.9, 0.9, 0.1, 0.1), "test")
    ctl = controller(1.0, first_guess=0.5)
    for i in range(200):
        ctl.observe(cand(ctl), [1, 2] + [3] * (i % 10 == 0) + [4] * (i % 20 == 0))
    assert ctl.trim([cand(ctl)], decoding=1, base_rows=1) == [2]
    assert ctl.trim([cand(ctl)], decoding=1, base_rows=201, prompt_rows=200) == [2]
    assert ctl.trim([cand(ctl)], decoding=1, base_rows=201) == [4]          # the chunk taken for decode work
    assert ctl.nodes_to_draft(decoding(ctl), 1, 201, 4, prompt_rows=200) == 2


def test_a_draft_model_drafts_what_pays_with_its_time_per_node_counted():
    """A drafter whose time grows with each node (a draft model's forward per depth) is told,
    before drafting, how many nodes to draft: those whose chance pays for their row and their
    drafting; one more while probing; all of them where the controller is off."""
    def learned(per_row: float, draft_node_ms: float, accepted: int) -> AdaptiveController:
        ctl = controller(per_row)
        ctl.cost.observe(StepSample(1, 1, 1, 0, False, 0.010, 8 * draft_node_ms / 1e3,
                                    0.010 + 8 * draft_node_ms / 1e3, proposed=8))
        for i in range(200):        # ranks 1..accepted always accepted, the next one time in ten
            ctl.observe(Candidate(decoding(ctl), tuple(range(1, 9))), range(1, min(8, accepted + (i % 10 == 0)) + 1))
        return ctl

    def drafted(ctl: AdaptiveController) -> int:
        return ctl.nodes_to_draft(decoding(ctl), 1, 1, 8)
    assert drafted(learned(0.05, 0.5, 8)) == 8
    ctl = learned(0.05, 1.0, 2)
    assert ctl.cost.propose_node_ms() == pytest.approx(1.0) and drafted(ctl) == 2
    hist = decoding(ctl)
    hist.steps = hist.next_probe
    assert ctl.nodes_to_draft(hist, 1, 1, 8) == 3
    assert drafted(learned(0.05, 12.0, 8)) == 1        # a node's drafting costs more than a step: 1 at least
    off = AdaptiveController(AdaptiveConfig(enabled=False), ctl.cost)
    assert off.nodes_to_draft(off.history(), 1, 1, 8) == 8


def test_a_request_that_stops_paying_stops_drafting_and_is_probed():
    ctl = controller(5.0, probe_every=4)
    ctl.cost.observe(StepSample(2, 1, 1, 1, False, 0.015, 0.005, 0.021))    # the drafter takes 5 ms
    hist = ctl.history()
    assert ctl.drafts(hist, 1, 1)                        # nothing known yet: it drafts
    for _ in range(30):
        ctl.observe(Candidate(hist, (1,), None, ""), [])
    assert ctl.trim([Candidate(hist, (1,), None, "")], 1, 1) == [0]
    assert hist.worth is not None and hist.worth < 0.1
    went = []
    for step in range(2, 40):
        if ctl.drafts(hist, 1, 1):
            went.append(step)
            assert ctl.trim([Candidate(hist, (1, 2), None, "")], 1, 1) == [1]    # a probe: a node more
            ctl.observe(Candidate(hist, (1,), None, ""), [])
    assert went == [4, 12, 28]               # probes come twice as far apart each time
    for _ in range(40):                      # the nodes start to pay: a cut keeps what the probe reached
        ctl.observe(Candidate(hist, (1, 2), None, ""), [1, 2])
    assert not hist.probing and ctl.trim([Candidate(hist, (1, 2), None, "")], 1, 1) == [2]
    assert hist.interval == 4                # probes every probe_every steps again


def test_a_probe_whose_node_pays_is_followed_by_another_at_once():
    """Where a row costs half a step, an unknown node's first guess (0.5) only ties with plain
    decoding: nodes join through probes. One whose extra node was accepted probes again at the
    next step, so a drafter that is always right is verified in full within as many steps as its
    tree has nodes, not one node more every `probe_every` steps."""
    ctl = controller(5.0, probe_every=16)
    chain = lambda h, n: Candidate(h, tuple(range(1, n + 1)), (0.9,) * n, "match")     # noqa: E731
    hist, kept = ctl.history(), []
    for _ in range(40):
        if not ctl.drafts(hist, 1, 1):
            kept.append(0)
            continue
        (k,) = ctl.trim([chain(hist, 4)], 1, 1)
        kept.append(k)
        if k:
            ctl.observe(chain(hist, k), list(range(1, k + 1)))        # every node accepted
    first = next(i for i, k in enumerate(kept) if k)
    assert kept[first:first + 4] == [1, 2, 3, 4] and set(kept[first + 4:]) == {4}
    # (probes that fail still come ever rarer: the test above)


def test_a_request_starts_from_every_requests_worth_and_looks_again_while_drafting_pays_elsewhere():
    """One weak proposal must not switch a request off until its probe: a new request starts
    from what every request's cuts were worth, and one that stopped drafting returns toward it
    (while drafting does not pay anywhere, it waits for its probes: the test above)."""
    ctl = controller(1.0, probe_every=64, max_probe_every=128)
    ctl.cost.observe(StepSample(2, 1, 1, 1, False, 0.011, 0.002, 0.0135))    # the drafter takes 2 ms
    sure = lambda h: Candidate(h, (1, 2), (0.9, 0.9), "match")             # noqa: E731
    weak = lambda h: Candidate(h, (1,), (0.1,), "match")                   # noqa: E731
    first = decoding(ctl)
    for _ in range(50):
        ctl.observe(sure(first), [1, 2])
        ctl.observe(weak(first), [])
    assert ctl.trim([sure(first)], 1, 1) == [2] and first.worth > 1
    late = ctl.history()
    assert late.worth == ctl.typical > 1
    steps = 0
    while ctl.drafts(late, 1, 1):               # weak proposals only: its worth falls until it stops
        assert ctl.trim([weak(late)], 1, 1) == [0]
        steps += 1
    assert 10 < steps < 40
    back = next(i for i in range(1, 64) if ctl.drafts(late, 1, 1))
    assert back < 5                             # long before its probe, 64 steps on


def test_disabled_or_unmeasured_keeps_whole_trees():
    for ctl in (AdaptiveController(AdaptiveConfig(enabled=False), StepCost(linear(1, 1), 0.1)),
                AdaptiveController(AdaptiveConfig(), None)):
        hist = ctl.history()
        hist.worth = 0.0
        assert ctl.drafts(hist, 1, 1)
        assert ctl.trim([Candidate(hist, (1, 2, 2), None, "")], 1, 1) == [3]


def test_config_is_checked():
    for bad in (dict(probe_every=0), dict(probe_every=8, max_probe_every=4), dict(memory=0), dict(prior_weight=0), dict(first_guess=2),
                dict(score_bands=0), dict(smoothing=0), dict(cost_curve=[(1, 10.0)])):
        with pytest.raises(ValueError, match="AdaptiveConfig"):
            AdaptiveConfig(**bad)


# ----- in the engine ---------------------------------------------------------------------------

def test_engine_verifies_what_the_controller_keeps_and_outputs_stay_the_targets(tiny_llama_dir):
    """With the controller cutting every proposal to a count of its own choosing (here, one
    that cycles 0, 1, 2, 3, as a changing cost would), greedy outputs equal plain decoding's,
    the verified trees are the cut ones, and the pool is whole."""
    from spec import LLM
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8], [3, 4, 3, 4, 3]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64).generate(
        prompts, greedy)]
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=4, drafter="ngram",
              speculation=SpecConfig(num_speculative_tokens=4))
    engine, cuts, verified = llm.engine, iter(range(10 ** 6)), []
    engine.adaptive.trim = lambda cands, decoding, base_rows, prompt_rows=0: [next(cuts) % 4 for _ in cands]
    accept = engine.acceptance._proposal

    def spy(req, plan):
        verified.append(plan.proposal.num_draft_nodes)
        return accept(req, plan)
    engine.acceptance._proposal = spy
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain
    assert verified and set(verified) <= {1, 2, 3} and len(set(verified)) > 1
    assert engine.blocks.num_used_blocks == 0


def test_the_engine_tells_the_controller_a_steps_prompt_rows(tiny_llama_dir):
    """A prompt arriving while another request drafts: the step that runs its chunk passes the
    chunk's rows (less the row its first token is sampled from) as prompt rows, on top of them
    the decoding rows; steps without a chunk pass none. Whole trees: which steps draft does not
    follow this machine's timings."""
    from pinned import WHOLE_TREES
    from spec import LLM
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=4, drafter="ngram",
              speculation=SpecConfig(num_speculative_tokens=4), adaptive=WHOLE_TREES)
    engine, seen = llm.engine, []
    trim = engine.adaptive.trim
    engine.adaptive.trim = lambda cands, decoding, base_rows, prompt_rows=0: \
        seen.append((decoding, base_rows, prompt_rows)) or trim(cands, decoding, base_rows, prompt_rows=prompt_rows)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", Submission([5, 6, 7, 5, 6, 7, 5, 6], greedy))
    for _ in range(3):
        engine.step()
    engine.add_request("b", Submission(list(range(10, 50)), greedy))
    while engine.has_unfinished:
        engine.step()
    assert (2, 40 + 1, 39) in seen                   # b's 40 rows, 39 of them prompt, and a's root
    assert all(p == 0 for d, b, p in seen if b <= d)
    assert engine.blocks.num_used_blocks == 0


def test_a_bare_root_is_a_plain_decode_step_except_for_a_pinned_request(tiny_llama_dir):
    """A proposal without draft nodes costs no tree mask and no tree acceptance: the step
    decodes plainly. A seeded sampled request keeps the tree path (its draws follow it)."""
    from drafters.base import Proposal
    from spec import LLM
    from tree.token_tree import TokenTree
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64).generate(
        prompts, greedy)]
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=4, drafter="ngram")
    engine, trees = llm.engine, []
    engine.drafter.propose = lambda views: [Proposal(TokenTree.single(v.token_ids[-1])) for v in views]
    accept = engine.acceptance._proposal

    def spy(req, plan):
        trees.append(req.params.seed)
        return accept(req, plan)
    engine.acceptance._proposal = spy
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain and trees == []
    llm.generate(prompts[:1], SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True))
    assert trees and set(trees) == {3}
    assert engine.blocks.num_used_blocks == 0


def test_engine_measures_its_cost_curve_at_load(tiny_llama_dir):
    from spec import LLM
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=4, drafter="ngram",
              speculation=SpecConfig(num_speculative_tokens=3))
    curve = llm.engine.adaptive.cost.curve
    assert curve.rows[:4] == (1, 2, 3, 4) and curve.rows[-1] == 16      # a tree, then a batch of them
    assert list(curve.ms) == sorted(curve.ms)
    assert LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64).engine.adaptive.cost is None


def test_a_curve_past_its_budget_is_timed_in_one_round_over_every_row_count(tiny_llama_dir, monkeypatch, tmp_path):
    """A target whose round of timed forwards would outlast the budget (a 1-8B model's) gets one
    round over every row count: the prefix, the batch sizes' first use, then each count once."""
    from spec import LLM, curve_cache, preparation
    monkeypatch.setattr(curve_cache, "cache_root", lambda: tmp_path)       # timed here, not read back
    monkeypatch.setattr(preparation, "CURVE_BUDGET_S", 0.0)                 # past it after one round
    timed, time_curve = [], preparation._Preparation.time_curve

    def counted(self, rows, tree, ctx):
        forward, calls = self.target.forward, []
        self.target.forward = lambda batch: calls.append(1) or forward(batch)
        try:
            return time_curve(self, rows, tree, ctx)
        finally:
            del self.target.forward
            prefix = -(-ctx // self.config.max_num_batched_tokens)
            timed.append(len(calls) == prefix + (len(rows) - tree) + len(rows))
    monkeypatch.setattr(preparation._Preparation, "time_curve", counted)
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=4, drafter="ngram",
              speculation=SpecConfig(num_speculative_tokens=3))
    curve = llm.engine.adaptive.cost.curve
    assert timed == [True] and curve.rows[:4] == (1, 2, 3, 4) and curve.rows[-1] == 16


def test_the_cost_curve_is_timed_once_per_machine_and_shape(tiny_llama_dir, tmp_path, monkeypatch, neighbours):
    """A quiet load times the curve and caches it; a target of the same shapes (another copy of
    the model) reads it back; timings taken beside a busy neighbour are not kept."""
    import shutil

    from spec import LLM
    from spec.preparation import _Preparation
    monkeypatch.setenv("TERCEL_CACHE", str(tmp_path / "cache"))
    timed, time_curve = [], _Preparation.time_curve
    monkeypatch.setattr(_Preparation, "time_curve", lambda self, *a: timed.append(1) or time_curve(self, *a))
    copy = shutil.copytree(tiny_llama_dir, tmp_path / "copy")
    # one thread: the count the curve is keyed by, never what a busy neighbour leaves free
    kw = dict(max_model_len=256, num_kv_blocks=64, max_num_seqs=2, drafter="ngram", num_threads=1)
    neighbours(2.0)
    LLM(str(tiny_llama_dir), **kw)
    neighbours(0.0)
    first = LLM(str(tiny_llama_dir), **kw).engine.adaptive.cost.curve
    again = LLM(str(copy), **kw).engine.adaptive.cost.curve
    assert len(timed) == 2 and again == first
    assert len(list((tmp_path / "cache" / "kernels").glob("curve-*.json"))) == 1

"""The drafting tests' assertions under stated cost curves (tests/pinned.py) of three kinds of
CPU: whatever a verify row costs, greedy outputs are plain decoding's and the KV pool is whole
after; where the curve says the drafts pay for their rows the engine verifies them, where it
says they do not it verifies probes only (one node beyond a cut of none). Drafts of known worth:
the plain replies' next tokens (every node accepted) or tokens off them (none accepted)."""
from __future__ import annotations

import pytest

from drafters.base import Proposal
from drafters.config import SpecConfig
from pinned import DEARER_THAN_A_STEP, MACHINES, stated
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from spec.preparation import _Preparation
from spec.step_cost import StatedCost
from tree.token_tree import TokenTree

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
ENGINE = dict(max_model_len=128, num_kv_blocks=32, max_num_seqs=4)
PROBE_EVERY = AdaptiveConfig().probe_every


@pytest.fixture(scope="module")
def replies(tiny_llama_dir) -> list[list[int]]:
    """Each prompt followed by its plain greedy reply."""
    outs = LLM(str(tiny_llama_dir), **ENGINE).generate(PROMPTS, GREEDY)
    return [p + o.token_ids for p, o in zip(PROMPTS, outs)]


def drafting_engine(tiny_llama_dir, curve) -> LLM:
    return LLM(str(tiny_llama_dir), drafter="ngram", speculation=SpecConfig(num_speculative_tokens=4),
               adaptive=stated(curve), **ENGINE)


def reply_drafts(replies: list[list[int]], miss: int):
    """A drafter's `propose` whose chains are the replies' next tokens, their lowest bit flipped
    by `miss` (0: every node accepted; 1: the first node never is)."""
    def next_tokens(view) -> list[int]:
        n = len(view.token_ids)
        full = next(r for r in replies if r[:n] == view.token_ids)
        return [t ^ miss for t in full[n:n + min(view.max_depth, view.max_nodes)]]
    return lambda views: [Proposal(TokenTree.chain(v.token_ids[-1], next_tokens(v))) for v in views]


def run_alone(llm: LLM, replies: list[list[int]], miss: int) -> tuple[list, list[tuple[int, int]]]:
    """Each prompt alone (a row's price is then the curve's own), with every verified proposal
    as (the request's step, its draft nodes)."""
    engine, verified = llm.engine, []
    engine.drafter.propose = reply_drafts(replies, miss)
    accept = engine.acceptance._proposal

    def spy(req, plan):
        verified.append((req.history.steps, plan.proposal.num_draft_nodes))
        return accept(req, plan)
    engine.acceptance._proposal = spy
    outs = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    del engine.acceptance._proposal         # no cycle left to keep the (frozen) engine alive
    assert [p + o.token_ids for p, o in zip(PROMPTS, outs)] == replies
    assert engine.blocks.num_used_blocks == 0
    return outs, verified


@pytest.mark.parametrize("machine", list(MACHINES))
def test_the_engine_keeps_its_cost_curve_as_stated(tiny_llama_dir, machine, monkeypatch):
    """A stated curve is not timed at load, nor rescaled by the steps run."""
    monkeypatch.setattr(_Preparation, "cost_curve", lambda self: pytest.fail("timed at load"))
    llm = drafting_engine(tiny_llama_dir, MACHINES[machine])
    cost = llm.engine.adaptive.cost
    llm.generate(PROMPTS, GREEDY)
    assert isinstance(cost, StatedCost) and cost.curve == MACHINES[machine]
    assert [cost.forward_ms(r) for r in (1, 5)] == [MACHINES[machine](1), MACHINES[machine](5)]
    assert cost.drafting_ms() == cost.node_ms() == cost.request_ms() == 0.0


@pytest.mark.parametrize("machine", list(MACHINES))
def test_drafts_that_are_always_right_pay_on_every_machine(tiny_llama_dir, replies, machine):
    """A row costs less than the token it buys on each machine: the engine verifies the drafts
    (on the dearer rows once probes have shown they are right) and each one is accepted."""
    outs, verified = run_alone(drafting_engine(tiny_llama_dir, MACHINES[machine]), replies, miss=0)
    accepted = sum(o.stats.accepted_tokens for o in outs)
    assert accepted == sum(o.stats.draft_tokens for o in outs) == sum(n for _, n in verified)
    assert any(n > 1 for _, n in verified), "no draft beyond a probe's one node"
    assert accepted > len(outs) * GREEDY.max_tokens // 4, "drafting bought few tokens"


@pytest.mark.parametrize("machine", list(MACHINES))
def test_drafts_that_are_never_right_are_probed_only(tiny_llama_dir, replies, machine):
    """No node is accepted: once its chance is learned (the first steps trust a first guess),
    a request verifies only probes, one node each."""
    outs, verified = run_alone(drafting_engine(tiny_llama_dir, MACHINES[machine]), replies, miss=1)
    assert sum(o.stats.accepted_tokens for o in outs) == 0
    assert all(n == 1 for step, n in verified if step >= PROBE_EVERY), verified


def test_rows_dearer_than_a_step_verify_probes_only(tiny_llama_dir, replies):
    """Even drafts that are always right cannot pay for a row that costs more than a step: every
    verified proposal is a probe's one node."""
    outs, verified = run_alone(drafting_engine(tiny_llama_dir, DEARER_THAN_A_STEP), replies, miss=0)
    assert verified and {n for _, n in verified} == {1}


@pytest.mark.parametrize("curve", [*MACHINES, "dearer than a step"])
def test_ngram_batches_are_token_identical_under_every_curve(tiny_llama_dir, replies, curve):
    """The n-gram drafter itself, the prompts batched: plain decoding's tokens, the pool whole."""
    llm = drafting_engine(tiny_llama_dir, MACHINES.get(curve, DEARER_THAN_A_STEP))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [p + o.token_ids for p, o in zip(PROMPTS, outs)] == replies
    assert llm.engine.blocks.num_used_blocks == 0

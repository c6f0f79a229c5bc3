"""One request can only hurt itself (spec/faults.py, spec/engine.py): a request whose grammar
reaches a state that allows nothing, or whose rows make the target's forward raise, fails alone
with finish_reason "error"; every other request of the same steps gets exactly the tokens it
gets without it, and the KV pool is whole afterwards. A fault no request owns still raises."""
from __future__ import annotations

import pytest
import torch

from spec import LLM, SamplingParams, StructuredOutputs, Submission

NEW = 24
POISON = 4242          # a prompt token that makes the patched forward raise


@pytest.fixture(scope="module")
def llms():
    return {"plain": LLM(max_num_seqs=8), "ngram": LLM(max_num_seqs=8, drafter="ngram")}


@pytest.fixture(scope="module")
def prompts(llms):
    texts = ["Name three rivers.", "Why is the sky blue?", "Write a haiku about rain."]
    return [llms["plain"].apply_chat_template([{"role": "user", "content": t}]) for t in texts]


@pytest.fixture(scope="module")
def alone(llms, prompts):
    """Each good request run by itself on the plain engine: what it must give in any company."""
    greedy = SamplingParams(temperature=0, max_tokens=NEW)
    return [llms["plain"].generate(p, greedy)[0].token_ids for p in prompts]


class DeadEnd:
    """A matcher that, after `after` accepted tokens, allows nothing (a grammar at a dead end)."""

    def __init__(self, inner, after: int):
        self._inner, self._left = inner, after

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def accept(self, token: int) -> bool:
        self._left -= 1
        return self._inner.accept(token)

    def mask(self):
        return self._inner.mask() if self._left > 0 else torch.zeros(1, self._inner.words, dtype=torch.int32)

    def tree_masks(self, tree):
        masks = self._inner.tree_masks(tree)
        return masks if self._left > 0 else torch.zeros_like(masks)

    def forced(self, limit: int) -> list[int]:
        return []


def run_with(llm, prompts, bad_prompt, bad_params, patch_bad=None):
    """Good greedy requests and one bad request, stepped together; (good outputs, bad output)."""
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=NEW)
    for i, p in enumerate(prompts):
        engine.add_request(f"good-{i}", Submission(p, greedy))
    bad = engine.add_request("bad", Submission(bad_prompt, bad_params))
    if patch_bad:
        patch_bad(bad)
    done = {}
    while len(done) < len(prompts) + 1:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    engine.check_integrity()
    assert engine.blocks.num_used_blocks == 0 and not engine.has_unfinished
    return [done[f"good-{i}"] for i in range(len(prompts))], done["bad"]


@pytest.mark.parametrize("name", ["plain", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_at_a_dead_end_fails_its_request_alone(llms, prompts, alone, name, temperature):
    """T=0 picked token 0 outside the grammar, T>0 sampled from all -inf: both once failed every
    request of the step. Now the request fails alone, naming its grammar, and the others are
    token-identical to their runs alone."""
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=NEW,
                            structured=StructuredOutputs(regex="[a-z ]+"))
    dead = lambda req: setattr(req, "grammar", DeadEnd(req.grammar, after=3))  # noqa: E731
    good, bad = run_with(llms[name], prompts, prompts[0], params, dead)
    assert [o.token_ids for o in good] == alone
    assert bad.finish_reason == "error" and bad.error.invalid and "grammar" in bad.error.message


def test_a_forward_that_raises_for_one_request_fails_it_alone(llms, prompts, alone, monkeypatch):
    """The forward over the batch raises; run alone, only the poisoned request's raises: it fails
    (an engine error, not the client's), the rest go on unchanged."""
    llm = llms["ngram"]
    target = llm.engine.target
    real = target.forward

    def forward(batch):
        if any(POISON in s.token_ids for s in batch.seqs):
            raise RuntimeError("kernel refused these rows")
        return real(batch)

    monkeypatch.setattr(target, "forward", forward)
    good, bad = run_with(llm, prompts, prompts[1] + [POISON], SamplingParams(temperature=0, max_tokens=NEW))
    assert [o.token_ids for o in good] == alone
    assert bad.finish_reason == "error" and not bad.error.invalid and "kernel refused" in bad.error.message


def test_a_fault_no_request_owns_is_raised(llms, prompts, monkeypatch):
    """When every forward fails, the scratch probe included, the step raises: the server then
    fails every request and reports itself unhealthy (tests/serving/test_server_faults.py)."""
    engine = llms["plain"].engine

    def broken(batch):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.target, "forward", broken)
    engine.add_request("a", Submission(prompts[0], SamplingParams(temperature=0, max_tokens=4)))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert not engine.probe()
    monkeypatch.undo()
    engine.abort("a")
    engine.step()
    engine.check_integrity()
    assert engine.probe() and not engine.has_unfinished

"""Predicted outputs in the engine (the offline API on SmolLM2): at T=0 the output is
token-identical with and without a prediction, with no drafter and with the n-gram drafter,
alone and batched, whether the prediction is the reply itself (then its tokens are accepted)
or an edited reply (then some are rejected); constrained requests too; ignored with speculation
off; refused when it could never be drafted; the KV pool whole after every request."""
from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import IDENTITY_ALONE as ALONE, mtbench_prompts
from spec import LLM, Prediction, SamplingParams, StructuredOutputs, Submission
from spec.adaptive import AdaptiveConfig

NEW = 48
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def plain():
    return LLM(max_num_seqs=8)


@pytest.fixture(scope="module")
def ngram():
    # Whole trees verified: whether drafts run does not depend on the machine's load.
    return LLM(max_num_seqs=8, drafter="ngram", adaptive=AdaptiveConfig(enabled=False))


@pytest.fixture(scope="module")
def prompts(plain):
    return [plain.apply_chat_template([{"role": "user", "content": p}]) for p in mtbench_prompts(4)]


@pytest.fixture(scope="module")
def reference(plain, prompts):
    return [o.token_ids for o in plain.generate(prompts, GREEDY)]


def edited(ids: list[int]) -> Prediction:
    """The reply as a client might predict it after an edit: a stretch deleted, two tokens
    inserted, one replaced."""
    out = ids[:8] + [1234, 4321] + ids[16:30] + [777] + ids[31:]
    return Prediction(tuple(out))


def prediction_counts(outs) -> tuple[int, int]:
    return sum(o.stats.prediction_accepted for o in outs), sum(o.stats.prediction_rejected for o in outs)


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_greedy_output_is_the_same_with_a_prediction(drafter, plain, ngram, prompts, reference):
    """The reply itself as the prediction (batched) and edited replies (alone): the same
    tokens as plain greedy decoding; the exact prediction is accepted, the edited one partly."""
    llm = plain if drafter == "none" else ngram
    exact = llm.generate(prompts, GREEDY, predictions=[Prediction(tuple(r)) for r in reference])
    alone = [llm.generate(p, GREEDY, predictions=edited(r))[0] for p, r in zip(prompts[:ALONE], reference)]
    assert [o.token_ids for o in exact] == reference
    assert [o.token_ids for o in alone] == reference[:ALONE]
    accepted, rejected = prediction_counts(exact)
    assert accepted >= len(prompts) * NEW // 2 and rejected <= accepted // 4
    accepted, rejected = prediction_counts(alone)
    assert accepted > 0 and rejected > 0
    assert llm.engine.blocks.num_used_blocks == 0


def test_a_text_prediction_for_every_prompt_and_none_for_some(plain, prompts, reference):
    """A prediction given as text (tokenized as a reply), one for all prompts; a list with
    None where a prompt has none."""
    text = plain.tokenizer.decode(reference[0], skip_special_tokens=True)
    both = plain.generate(prompts[:2], GREEDY, predictions=text)
    assert [o.token_ids for o in both] == reference[:2]
    assert both[0].stats.prediction_accepted > 0
    mixed = plain.generate(prompts[:2], GREEDY, predictions=[None, Prediction(tuple(reference[1]))])
    assert [o.token_ids for o in mixed] == reference[:2]
    assert mixed[0].stats.prediction_accepted == mixed[0].stats.prediction_rejected == 0
    assert mixed[1].stats.prediction_accepted > 0
    assert plain.engine.blocks.num_used_blocks == 0


def test_a_constrained_request_with_a_prediction(plain):
    """The grammar's forced tokens and the prediction's chain below them, pruned by the grammar:
    the same JSON as without the prediction, the prediction accepted."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    params = SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutputs(json=schema))
    msgs = [{"role": "user", "content": "Give a JSON object for a person named Ada, aged 36."}]
    ref = plain.chat(msgs, params)[0]
    out = plain.chat(msgs, params, predictions=ref.text)[0]
    assert out.token_ids == ref.token_ids and out.stats.prediction_accepted > 0
    assert plain.engine.blocks.num_used_blocks == 0


def test_speculation_off_ignores_the_prediction(plain, prompts, reference):
    engine = plain.engine
    engine.add_request("off", Submission(prompts[0], GREEDY, speculate=False,
                                          prediction=Prediction(tuple(reference[0]))))
    done = [o for _ in range(NEW + 2) for o in engine.step() if o.finished]
    assert done[0].token_ids == reference[0]
    assert (done[0].stats.verify_steps, done[0].stats.prediction_accepted) == (0, 0)
    assert engine.blocks.num_used_blocks == 0


def test_a_prediction_that_can_never_be_drafted_is_refused(plain, prompts):
    too_long = Prediction((5,) * (plain.engine.max_model_len + 1))
    with pytest.raises(ValueError, match="prediction is .* tokens, more than the context length"):
        plain.generate(prompts[0], GREEDY, predictions=too_long)
    with pytest.raises(ValueError, match=r"prediction token ids must be in \[0, 49152\)"):
        plain.generate(prompts[0], GREEDY, predictions=Prediction((49152,)))
    with pytest.raises(ValueError, match="a prediction is a str, a Prediction or None"):
        plain.generate(prompts[0], GREEDY, predictions=[[1, 2]])
    with pytest.raises(ValueError, match="1 predictions for 2 prompts"):
        plain.generate(prompts[:2], GREEDY, predictions=["a"])
    assert not plain.engine.has_unfinished and plain.engine.blocks.num_used_blocks == 0


class Predicting:
    """The engine as drive_random_requests drives it, each request with its prediction, and
    its finished outputs kept."""

    def __init__(self, engine, predictions: dict[str, Prediction]):
        self.engine, self.predictions, self.finished = engine, predictions, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_request(self, request_id, sub: Submission):
        self.engine.add_request(request_id, replace(sub, prediction=self.predictions[request_id]))

    def step(self):
        outs = self.engine.step()
        self.finished.update((o.request_id, o) for o in outs if o.finished and o.finish_reason != "abort")
        return outs


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_no_leaked_blocks_or_state_with_predictions_under_preemption_and_aborts(tiny_llama_dir, drafter):
    """60 requests on the tiny model predicting their own greedy replies, edited; random aborts
    and a pool small enough to preempt: integrity after every step, the pool whole and no
    prediction state left afterwards, greedy replies unchanged. With a drafter the controller
    cuts the joined chains on a stated curve, not on this machine's timings."""
    import random

    from conftest import drive_random_requests
    from drafters.config import SpecConfig
    from pinned import CHEAP_ROWS
    llm = LLM(str(tiny_llama_dir), max_model_len=160, num_kv_blocks=48, block_size=8, max_num_seqs=8,
              speculation=SpecConfig(num_speculative_tokens=3), adaptive=CHEAP_ROWS,
              **({} if drafter == "none" else {"drafter": drafter}))
    rng = random.Random(11)
    jobs = [([rng.randrange(3, 400)] * 4 + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 40))],
             SamplingParams(temperature=rng.choice([0, 0.8]), seed=i, max_tokens=rng.randint(1, 50), ignore_eos=True))
            for i in range(60)]
    greedy = [o.token_ids for o in llm.generate([p for p, _ in jobs],
                                                [SamplingParams(temperature=0, max_tokens=s.max_tokens,
                                                                ignore_eos=True) for _, s in jobs])]
    predictions = {f"r{i}": Prediction(tuple(g[:len(g) // 2] + [7] + g[len(g) // 2 + 1:])) for i, g in enumerate(greedy)}
    engine = Predicting(llm.engine, predictions)
    _, preempted = drive_random_requests(engine, rng, len(jobs), lambda i: jobs[i], add_p=0.6, abort_p=0.08)
    assert preempted > 0
    assert llm.engine.blocks.num_used_blocks == 0 and not llm.engine.requests and not llm.engine.drafting.predictor._index
    done = engine.finished
    assert sum(o.stats.prediction_accepted for o in done.values()) > 0
    for rid, out in done.items():
        i = int(rid[1:])
        if jobs[i][1].greedy:
            assert out.token_ids == greedy[i], rid

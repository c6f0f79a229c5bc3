"""Tool calls in the engine, on SmolLM2: at T=0 every drafter (with jump-forward over the
calls' scaffolding) gives exactly the tokens of plain constrained decoding, alone and
batched, and the calls parse and validate. T > 0: test_structured_exactness.py."""
from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import IDENTITY_ALONE as ALONE, slow_marked, spec_drafters, write_reply_corpus
from serving.tools.constraint import ToolChoice, tool_constraint
from serving.tools.formats import HERMES, LLAMA3_JSON
from serving.tools.parser import parse_reply
from serving.tools.prompt import template_messages
from spec import LLM, SamplingParams
from tool_cases import SCHEMAS, TOOLS, USERS

DRAFTERS = spec_drafters()
# (format, choice) per prompt: both formats, every kind of choice.
CASES = [(HERMES, ToolChoice("required")), (HERMES, ToolChoice("auto")),
         (HERMES, ToolChoice("named", "add")), (LLAMA3_JSON, ToolChoice("required", parallel=False)),
         (LLAMA3_JSON, ToolChoice("named", "get_weather")), (HERMES, ToolChoice("required", parallel=False))]


@pytest.fixture(scope="module")
def plain():
    return LLM(max_num_seqs=8, jump_forward=False)


@pytest.fixture(scope="module")
def prompts(plain):
    out = []
    for (fmt, _), user in zip(CASES, USERS):
        turns, _ = template_messages([{"role": "user", "content": user}], TOOLS, fmt, template_knows_tools=False)
        out.append(plain.apply_chat_template(turns))
    return out


def params(case) -> SamplingParams:
    fmt, choice = case
    return SamplingParams(temperature=0, max_tokens=64, structured=tool_constraint(fmt, TOOLS, choice))


@pytest.fixture(scope="module")
def reference(plain, prompts):
    """Plain constrained decoding: one token per step, no jump-forward, no drafter."""
    return [plain.generate(p, params(c))[0] for p, c in zip(prompts, CASES)]


def test_plain_calls_parse_and_follow_their_schemas(reference):
    for (fmt, choice), out in zip(CASES, reference):
        calls = parse_reply(fmt, out.text).calls
        if choice.mode == "auto" and not calls:
            continue
        assert calls, out.text
        assert len(calls) == 1 or choice.parallel
        for c in calls:
            assert choice.mode != "named" or c.name == choice.name
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, plain, reference):
    return write_reply_corpus(tmp_path_factory.mktemp("corpus") / "calls.jsonl", plain,
                              [o.token_ids for o in reference])


# Under `make test-slow`, every drafter: in `make test` the tree drafter under a structural tag is
# tests/engine/test_reasoning_exactness.py's (the tools' grammar is one too), the calls' parse is above.
@pytest.mark.parametrize("name", slow_marked(DRAFTERS, set(DRAFTERS)))
def test_every_drafter_calls_tools_token_identically(name, prompts, reference, corpus):
    drafter, spec = DRAFTERS[name]
    llm = LLM(max_num_seqs=8, drafter=drafter.format(corpus=corpus), speculation=spec)
    alone = [llm.generate(p, params(c))[0] for p, c in zip(prompts[:ALONE], CASES)]
    batch = llm.generate(prompts, [params(c) for c in CASES])
    assert [o.token_ids for o in alone] == [o.token_ids for o in reference[:ALONE]]
    assert [o.token_ids for o in batch] == [o.token_ids for o in reference]
    assert sum(o.stats.forced_tokens for o in alone) > 0, "jump-forward should take the scaffolding"
    assert llm.engine.blocks.num_used_blocks == 0

"""Tool calling through `tercel serve` and the official openai client: round trips with
`auto`, `required` and a named function, streamed and assembled by the SDK's helper, the
same calls with speculation on and off, refusals before any work, and a run whose every
call's arguments validate against its schema."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from server_util import LiveServer
from spec.adaptive import AdaptiveConfig
from spec.config import EngineConfig
from tool_cases import ASK, AUTO_ASK, SCHEMAS, TOOLS, USERS

@pytest.fixture(scope="module")
def server():
    # Whole trees verified: whether drafts run does not depend on the machine's load.
    s = LiveServer(EngineConfig(max_num_seqs=16, drafter="ngram", adaptive=AdaptiveConfig(enabled=False)),
                   model_name="smol")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def ask(client, messages=None, **kw):
    """ASK, or with `tool_choice: auto` AUTO_ASK and one call at most."""
    if messages is None:
        auto = kw.get("tool_choice") == "auto"
        messages = AUTO_ASK if auto else ASK
        kw = {"parallel_tool_calls": False, **kw} if auto else kw
    return client.chat.completions.create(model="smol", messages=messages, tools=TOOLS, max_tokens=80,
                                          temperature=0, **kw)


def valid_calls(message) -> list:
    assert message.tool_calls, message
    for c in message.tool_calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return message.tool_calls


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["auto", "required", "named"])
def test_a_round_trip_call_result_answer(client, server, choice):
    asked = AUTO_ASK if choice == "auto" else ASK
    reply = ask(client, tool_choice=choice)
    assert reply.choices[0].finish_reason == "tool_calls"
    calls = valid_calls(reply.choices[0].message)
    assert calls[0].function.name == "get_weather" and reply.choices[0].message.content is None
    messages = [*asked, reply.choices[0].message.model_dump(exclude_none=True),
                *({"role": "tool", "tool_call_id": c.id, "content": "18 degrees celsius and sunny"} for c in calls)]
    answer = ask(client, messages, tool_choice="none")
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")
    server.wait_idle()


def test_the_sdk_assembles_streamed_calls_into_the_whole_reply(client, server):
    for choice in ("required", "auto"):
        whole = ask(client, tool_choice=choice).choices[0].message
        kw = {"parallel_tool_calls": False} if choice == "auto" else {}
        with client.chat.completions.stream(model="smol", messages=AUTO_ASK if choice == "auto" else ASK, tools=TOOLS,
                                            max_tokens=80, temperature=0, tool_choice=choice, **kw) as stream:
            final = stream.get_final_completion()
        streamed = final.choices[0].message
        assert final.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in whole.tool_calls]
        assert streamed.content == whole.content
    server.wait_idle()


def test_calls_are_the_same_with_speculation_on_and_off(client, server):
    """The constraint masks drafts and jump-forwards the scaffolding; T=0 keeps the tokens."""
    drafted = 0
    for choice in ("required", "auto", {"type": "function", "function": {"name": "add"}}):
        on = ask(client, tool_choice=choice)
        off = ask(client, tool_choice=choice, extra_body={"speculation": "off"})
        pick = lambda r: [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or ()]
        assert pick(on) and pick(on) == pick(off) and on.usage.completion_tokens == off.usage.completion_tokens
        assert off.model_extra["tercel"]["proposed"] == 0
        drafted += on.model_extra["tercel"]["proposed"]
    assert drafted > 0
    server.wait_idle()


def call_run(client, n: int) -> list:
    """n sampled requests under speculation, mixed choices, from 8 threads."""
    choices = ["required", "auto", {"type": "function", "function": {"name": "add"}}]

    def one(i):
        msgs = [{"role": "user", "content": USERS[i % len(USERS)]}]
        return client.chat.completions.create(model="smol", messages=msgs, tools=TOOLS, max_tokens=96,
                                              temperature=0.8, seed=i, tool_choice=choices[i % len(choices)])
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


@pytest.mark.parametrize("n", [pytest.param(200, marks=pytest.mark.slow), 12])
def test_every_call_in_a_sampled_run_validates(client, server, n):
    replies = call_run(client, n)
    called = [r for r in replies if r.choices[0].finish_reason == "tool_calls"]
    for r in called:
        valid_calls(r.choices[0].message)
    forced = [r for i, r in enumerate(replies) if i % 3 != 1]       # required and named must call
    assert all(r.choices[0].finish_reason in ("tool_calls", "length") for r in forced)
    assert len(called) >= len(forced) * 3 // 4
    server.wait_idle()


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
])
def test_tool_mistakes_are_a_400_naming_the_field(server, extra, param):
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    server.wait_idle()


def test_developer_role_name_and_tool_turns_reach_the_template(server):
    tok = server.bridge.tokenizer
    from serving.tools.formats import HERMES
    from serving.tools.prompt import template_messages
    messages = [{"role": "developer", "content": "Be brief.", "name": "ops"},
                {"role": "user", "content": "hi"}]
    turns, _ = template_messages(messages, None, HERMES, tok.renders_tools)
    text = tok.apply_chat_template(turns, tokenize=False)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "smol", "messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.apply_chat_template(turns))


def test_openapi_documents_the_tool_fields(server):
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(schemas["ChatCompletionRequest"]["properties"])
    assert {"tool_calls", "tool_call_id", "name"} <= set(schemas["ChatMessage"]["properties"])
    assert "tool_calls" in schemas["AssistantMessage"]["properties"]
    assert "tool_calls" in json.dumps(schemas["ChatChoice"])

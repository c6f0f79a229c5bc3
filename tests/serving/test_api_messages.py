"""Anthropic's Messages API (`/v1/messages`) through the official anthropic SDK: the reply is
the chat route's for the same conversation, streamed it assembles (the SDK's own accumulator)
into the whole message, speculation changes no token at T=0, a tool round trip, stop
sequences and max_tokens as Anthropic reports them, refusals in Anthropic's error shape with
the chat route's statuses, and the KV pool whole after each test."""
from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest

from server_util import LiveServer, ngram_server
from serving.bridge import RequestFailed
from serving.limits import ServerLimits
from serving.messages.convert import chat_request
from serving.messages.render import ContentBlocks, MessageReply, message_events
from serving.messages.schemas import MessagesRequest
from serving.streaming import Reply
from spec.config import EngineConfig
from spec.faults import RequestError
from spec.request import RequestOutput
from tool_cases import ASK, TOOLS

SYSTEM = "You are a helpful assistant. Answer in one sentence."
USER = [{"role": "user", "content": "What is the capital of France?"}]
T0 = {"temperature": 0}      # the SDK no longer names temperature; the API still takes it
WEATHER = {"name": "get_weather", "description": TOOLS[0]["function"]["description"],
           "input_schema": TOOLS[0]["function"]["parameters"]}
ADD = {"name": "add", "description": TOOLS[1]["function"]["description"],
       "input_schema": TOOLS[1]["function"]["parameters"]}


@pytest.fixture(scope="module")
def server():
    s = ngram_server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return server.anthropic_client(timeout=120)


@pytest.fixture(scope="module")
def whole(client):
    """The plain question's whole message at T=0, speculation on (the server's drafter)."""
    return client.messages.create(model="smol", max_tokens=24, system=SYSTEM, messages=USER, extra_body=T0)


def test_a_message_is_the_chat_routes_reply(whole, server):
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    chat = server.openai_client().chat.completions.create(
        model="smol", max_tokens=24, temperature=0, messages=[{"role": "system", "content": SYSTEM}, *USER])
    assert whole.content[0].text == chat.choices[0].message.content
    assert whole.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert whole.stop_sequence is None
    u = whole.usage      # the prompt's tokens: those read from the prefix cache apart
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens
    server.wait_idle()


def test_speculation_changes_no_token_at_temperature_zero(whole, client, server):
    off = client.messages.create(model="smol", max_tokens=24, system=SYSTEM, messages=USER,
                                 extra_body={**T0, "speculation": "off"})
    assert off.content == whole.content and off.usage.output_tokens == whole.usage.output_tokens
    assert off.model_extra["tercel"]["proposed"] == 0 < whole.model_extra["tercel"]["proposed"]
    server.wait_idle()


def test_a_streamed_message_assembles_into_the_whole_one(whole, client, server):
    with client.messages.stream(model="smol", max_tokens=24, system=SYSTEM, messages=USER, extra_body=T0) as s:
        final = s.get_final_message()
    assert final.content[0].text == whole.content[0].text and len(final.content) == 1
    assert (final.stop_reason, final.stop_sequence, final.usage.output_tokens) == \
        (whole.stop_reason, None, whole.usage.output_tokens)
    events = list(client.messages.create(model="smol", max_tokens=24, system=SYSTEM, messages=USER, stream=True,
                                         extra_body=T0))
    assert [e.type for e in events[:2]] == ["message_start", "content_block_start"]
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert {e.type for e in events[2:-3]} == {"content_block_delta"}
    assert [e.type for e in events[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events[2:-3]) == whole.content[0].text
    server.wait_idle()


def test_a_tool_round_trip(client, server):
    ask = dict(model="smol", max_tokens=60, system=ASK[0]["content"], tools=[WEATHER, ADD], extra_body=T0)
    asked = [{"role": "user", "content": ASK[1]["content"]}]
    one = {"type": "any", "disable_parallel_tool_use": True}      # greedy SmolLM2 calls twice otherwise
    reply = client.messages.create(messages=asked, tool_choice=one, **ask)
    assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["tool_use"]
    call = reply.content[-1]
    jsonschema.validate(call.input, WEATHER["input_schema"] if call.name == "get_weather" else ADD["input_schema"])
    with client.messages.stream(messages=asked, tool_choice=one, **ask) as s:
        streamed = s.get_final_message()     # the SDK assembles input_json_delta into the input
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in streamed.content] == \
        [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in reply.content]
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C, sunny"}]}
    answer = client.messages.create(messages=[*asked, {"role": "assistant", "content": reply.content},
                                              {"role": "user", "content": [result]}],
                                    tool_choice={"type": "none"}, **{**ask, "max_tokens": 24})
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")
    server.wait_idle()


def test_a_stop_sequence_is_named(whole, client, server):
    text = whole.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    kw = dict(model="smol", max_tokens=24, system=SYSTEM, messages=USER, extra_body=T0,
              stop_sequences=["never written", stop])
    cut = client.messages.create(**kw)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, streamed.content[0].text) == \
        ("stop_sequence", stop, cut.content[0].text)
    short = client.messages.create(model="smol", max_tokens=3, system=SYSTEM, messages=USER, extra_body=T0)
    assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 3)
    server.wait_idle()


def test_count_tokens_counts_the_prompt_a_message_sends(whole, client):
    counted = client.messages.count_tokens(model="smol", system=SYSTEM, messages=USER)
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    with_tools = client.messages.count_tokens(model="smol", system=SYSTEM, messages=USER, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens


def refusal(client, error=anthropic.BadRequestError, **kw) -> str:
    body = {"model": "smol", "max_tokens": 4, "messages": USER, **kw}
    with pytest.raises(error) as e:
        client.messages.create(**body)
    assert e.value.body["type"] == "error"
    return e.value.body["error"]


@pytest.mark.parametrize("kw, names", [
    ({"max_tokens": anthropic.omit}, "'max_tokens' is required"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe:"},
                                                {"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "'messages[0].content[1]' is an image block"),
    ({"messages": [*USER, {"role": "assistant", "content": "The capital is"}]}, "'messages[1]' is an assistant"),
    ({"stop_sequences": [f"s{i}" for i in range(17)]}, "'stop_sequences' has 17 strings"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "'tools[0].type'"),
    ({"tool_choice": {"type": "any"}}, "'tool_choice'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"extra_body": {"container": "c1"}}, "'container'"),
    ({"extra_body": {"temperature": 1.5}}, "'temperature'"),
])
def test_refusals_are_anthropic_errors_naming_the_messages_field(client, server, kw, names):
    error = refusal(client, **kw)
    assert error["type"] == "invalid_request_error" and names in error["message"], error
    server.wait_idle()


def test_an_unknown_model_is_a_404_and_the_openai_routes_keep_their_shape(client, server):
    assert refusal(client, anthropic.NotFoundError, model="claude-sonnet-4-5")["type"] == "not_found_error"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "nope", "messages": USER}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and "type" not in r.json()
    r = httpx.post(f"{server.url}/v1/messages/nope", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server.url}/v1/messages", content=b" " * (ServerLimits().max_body_bytes + 1))
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_an_unexpected_error_is_a_500_in_anthropics_shape(client, server, monkeypatch):
    def broken(*_a, **_k):
        raise RuntimeError("tokenizer exploded")
    monkeypatch.setattr(server.engine.tokenizer, "apply_chat_template", broken)
    error = refusal(client, anthropic.InternalServerError)
    assert error["type"] == "api_error" and "exploded" not in error["message"]


def test_the_api_key_may_come_as_x_api_key_on_the_messages_routes_alone():
    server = LiveServer(EngineConfig(max_num_seqs=2), model_name="smol", api_key="sekrit")
    try:
        body = {"model": "smol", "max_tokens": 1, "messages": USER}
        ok = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": "sekrit"}, timeout=60)
        assert ok.status_code == 200, ok.text
        sdk = anthropic.Anthropic(base_url=server.url, api_key="sekrit", max_retries=0)
        assert sdk.messages.create(**body).usage.output_tokens == 1
        wrong = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": "guess"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        chat = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"x-api-key": "sekrit"})
        assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"
        server.wait_idle()
    finally:
        server.close()


def test_openapi_documents_the_messages_routes(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    op = doc["paths"]["/v1/messages"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("MessagesRequest")
    assert {"200", "400", "404", "500"} <= set(op["responses"]) and "422" not in op["responses"]
    assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    request = doc["components"]["schemas"]["MessagesRequest"]
    assert {"model", "max_tokens", "messages"} <= set(request["required"])
    assert "/v1/messages/count_tokens" in doc["paths"]


# ---- without a server ------------------------------------------------------------------------
def test_the_conversation_converts_to_the_chat_routes_turns():
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "tools": [WEATHER],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                       {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                                  {"type": "text", "text": "and?"}]}]})
    chat = chat_request(body)
    turns = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert turns[0] == {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert turns[2] == {"role": "assistant", "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert turns[3:] == [{"role": "tool", "content": "sunny", "tool_call_id": "t1"}, {"role": "user", "content": [
        {"type": "text", "text": "and?"}]}]
    assert chat.chat_template_kwargs == {"enable_thinking": True}
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("auto", False)
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]


def test_reasoning_deltas_are_a_thinking_block_before_the_text():
    blocks = ContentBlocks()
    events = [e for d in ({"reasoning_content": "Paris, "}, {"reasoning_content": "surely."}, {"content": "Paris."})
              for e in blocks.feed(d)] + blocks.close()
    assert [e["type"] for e in events] == ["content_block_start", "content_block_delta", "content_block_delta",
                                           "content_block_stop", "content_block_start", "content_block_delta",
                                           "content_block_stop"]
    assert events[1]["delta"] == {"type": "thinking_delta", "thinking": "Paris, "}
    assert blocks.content() == [{"type": "thinking", "thinking": "Paris, surely.", "signature": ""},
                                {"type": "text", "text": "Paris."}]


class FailingStream:
    """A request stream whose request fails after its first output."""
    num_prompt_tokens = 3

    def __init__(self, error: Exception):
        self.error, self.sent, self.cancelled = error, False, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.sent:
            raise self.error
        self.sent = True
        return RequestOutput("r", None, [1, 2, 3], "Hi", [7], False, None, delta_text="Hi", delta_token_ids=[7])

    def cancel(self):
        self.cancelled = True


@pytest.mark.parametrize("error, kind", [(RuntimeError("engine gone"), "overloaded_error"),
                                         (RequestFailed(RequestError("bad", True)), "invalid_request_error")])
def test_a_failure_under_way_is_one_error_event(error, kind):
    async def collect():
        return [e async for e in message_events(MessageReply("msg_1", Reply("chatcmpl-1", "m", True, 1, False)), stream)]
    stream = FailingStream(error)
    events = asyncio.run(collect())
    assert [e["event"] for e in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    body = json.loads(events[-1]["data"])
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    assert "engine gone" not in body["error"]["message"] and stream.cancelled


def test_a_block_whose_type_is_not_a_string_is_a_400(server):
    """Found by the fuzz suite: a block `{"type": [...]}` reached the union's tag as a list (a 500)."""
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "smol", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text

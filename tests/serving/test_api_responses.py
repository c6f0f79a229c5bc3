"""The Responses API (`/v1/responses`) through the official openai client: text and item input
equal to the chat route's reply, the SDK's own parsing of the streamed events, a function tool
round trip over `previous_response_id`, the store (GET, DELETE, `store: false`, its bounds),
structured output, `max_output_tokens`, refusals naming the Responses field, and T=0 identity
with speculation on and off."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import ResponseOutputItem, ResponseStreamEvent
from pydantic import TypeAdapter

from server_util import ngram_server
from serving.responses.render import OutputItems
from serving.responses.store import ResponseStore, StoreLimits, StoredResponse
from tool_cases import SCHEMAS, WEATHER

TOOLS = [{"type": "function", **WEATHER["function"]}]     # the Responses shape: no "function" wrapper
ASK = "What is the weather like in Paris right now? Use the get_weather tool."
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the capital of France?"
# The events of a response with one message, in OpenAI's order (deltas collapsed).
MESSAGE_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server():
    s = ngram_server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def create(client, **kw):
    return client.responses.create(**{"model": "smol", "temperature": 0, "max_output_tokens": 24, **kw})


def chat_text(client, messages, **kw) -> str:
    reply = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0, **kw)
    return reply.choices[0].message.content


def refusal(client, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        create(client, **kw)
    return e.value.body


def test_text_and_item_input_equal_the_chat_routes_reply(client, server):
    expected = chat_text(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    text = create(client, instructions=SYSTEM, input=QUESTION)
    items = create(client, input=[{"role": "developer", "content": SYSTEM},
                                  {"type": "message", "role": "user",
                                   "content": [{"type": "input_text", "text": QUESTION}]}])
    for r in (text, items):
        assert r.output_text == expected and r.object == "response" and r.id.startswith("resp_")
        message = r.output[0]
        assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
        assert message.content[0].type == "output_text" and message.content[0].annotations == []
        assert r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert text.instructions == SYSTEM and text.usage.input_tokens == items.usage.input_tokens
    server.wait_idle()


def test_max_output_tokens_makes_an_incomplete_response(client, server):
    r = create(client, input=QUESTION, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = list(create(client, input=QUESTION, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    server.wait_idle()


def test_streamed_events_in_order_and_equal_to_the_whole_response(client, server):
    kw = dict(input=QUESTION, instructions=SYSTEM, max_output_tokens=40, extra_body={"stop": ["."]})
    whole = create(client, **kw)
    assert whole.status == "completed", whole.status     # ended by its stop string
    events = list(create(client, stream=True, **kw))
    kinds = [e.type for e in events]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == [*MESSAGE_EVENTS, "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    done = events[-1].response
    assert done.status == "completed" and done.output_text == whole.output_text and done.id == events[0].response.id
    assert done.usage.output_tokens == whole.usage.output_tokens and done.usage.input_tokens == whole.usage.input_tokens
    with client.responses.stream(model="smol", temperature=0, **kw) as stream:      # the SDK's helper
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    server.wait_idle()


def test_function_tool_round_trip_over_previous_response_id(client, server):
    one_call = dict(input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=60)
    first = create(client, **one_call)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed" and calls[0].status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    with client.responses.stream(model="smol", temperature=0, **one_call) as stream:
        streamed = stream.get_final_response()
    assert [(c.name, c.arguments) for c in streamed.output if c.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]
    answer = create(client, previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                    input=[{"type": "function_call_output", "call_id": call.call_id,
                            "output": "18 degrees celsius and sunny"}])
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.previous_response_id == first.id
    # the second prompt holds the first: its input, its call, and the call's result
    assert answer.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    server.wait_idle()


def test_previous_response_id_continues_the_conversation(client, server):
    first = create(client, input="My name is Ada. Remember it.", instructions=SYSTEM)
    second = create(client, previous_response_id=first.id, input="What is my name?", instructions=SYSTEM)
    as_chat = chat_text(client, [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": "My name is Ada. Remember it."},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "What is my name?"}])
    assert second.output_text == as_chat
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    server.wait_idle()


def test_stored_responses_get_delete_and_store_false(client, server):
    kept = create(client, input=QUESTION, max_output_tokens=4, metadata={"run": "1"})
    got = client.responses.retrieve(kept.id)
    assert got.output_text == kept.output_text and got.metadata == {"run": "1"} and got.usage == kept.usage
    client.responses.delete(kept.id)
    for gone in (lambda: client.responses.retrieve(kept.id), lambda: client.responses.delete(kept.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    unstored = create(client, input=QUESTION, max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as e:
        create(client, input="Hi", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"
    server.wait_idle()


def test_text_format_json_schema_output_validates(client, server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    r = create(client, input="Give the largest city of Japan, and whether it is the capital, as JSON.",
               max_output_tokens=40,
               text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    server.wait_idle()


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(tool_choice={"type": "file_search"}), "tool_choice.type"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}),
     "text.format.schema"),
    (dict(text={"format": {"type": "xml"}}), "text.format"),
    (dict(background=True), "background"),
    (dict(include=["message.output_text.logprobs"]), "include"),
    (dict(max_output_tokens=10**6), "max_output_tokens"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]),
     "input[0].content[0].type"),
    (dict(input=[{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]), "input[0].call_id"),
    (dict(tools=TOOLS + TOOLS), "tools[1].name"),
    (dict(input=[{"type": "reasoning", "id": "rs_1", "summary": []}]), "input"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(extra_body={"max_tokens": 5}), "max_tokens"),
])
def test_refusals_name_the_responses_field(client, server, kw, param):
    body = refusal(client, **{"input": "Hi", **kw})
    assert body["param"] == param, body
    assert body["type"] == "invalid_request_error"
    server.wait_idle()


def test_speculation_on_and_off_give_the_same_response(client, server):
    kw = dict(input="Write a short poem about the sea.", max_output_tokens=32)
    on = create(client, **kw)
    off = create(client, extra_body={"speculation": "off"}, **kw)
    assert on.output_text == off.output_text
    assert on.model_extra["tercel"]["verify_steps"] > 0 and off.model_extra["tercel"]["verify_steps"] == 0
    server.wait_idle()


def test_a_request_that_fails_under_way_ends_with_response_failed(client, server, monkeypatch):
    """A forward that fails on this request's rows alone: the stream ends with `response.failed`
    (no exception text), a whole response is a 500; the next request is served, the pool whole."""
    target, real = server.engine.target, server.engine.target.forward
    poison = server.bridge.tokenizer.encode(" zebra", add_special_tokens=False)[-1]

    def forward(batch):
        if any(poison in s.token_ids for s in batch.seqs):
            raise RuntimeError("secret kernel detail")
        return real(batch)

    monkeypatch.setattr(target, "forward", forward)
    events = list(create(client, input="Tell me about the zebra.", stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error" and "secret" not in failed.error.message
    with pytest.raises(openai.InternalServerError) as e:
        create(client, input="Tell me about the zebra.")
    assert "secret" not in str(e.value.body)
    monkeypatch.undo()
    assert create(client, input=QUESTION, max_output_tokens=4).status == "incomplete"
    server.wait_idle()


def test_a_client_that_leaves_mid_stream_frees_its_blocks_and_stores_nothing(server):
    body = {"model": "smol", "input": QUESTION, "max_output_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        next(line for line in lines if "response.output_text.delta" in line)
    server.wait_idle()
    rid = json.loads(first[6:])["response"]["id"]
    assert httpx.get(f"{server.url}/v1/responses/{rid}").status_code == 404


def test_openapi_documents_the_routes(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    create_op = doc["paths"]["/v1/responses"]["post"]
    assert create_op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("ResponsesRequest")
    assert {"200", "400", "404"} <= set(create_op["responses"])
    assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    request = doc["components"]["schemas"]["ResponsesRequest"]
    assert {"model", "input"} <= set(request["required"]) and "top_k" in request["properties"]


# ---- without a server -------------------------------------------------------------------------------
def test_reasoning_text_and_calls_become_items_and_events_the_sdk_validates():
    """The chat deltas a reasoning parser adds (`reasoning_content`) open a reasoning item before
    the message; every event and item passes the SDK's own (strict) pydantic types."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    entries = [{"delta": {"reasoning_content": "Think"}}, {"delta": {"reasoning_content": "ing."}},
               {"delta": {"content": "Hi"}}, {"delta": {"tool_calls": [call]}},
               {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}},
               {"delta": {}, "finish_reason": "tool_calls"}]
    items = OutputItems()
    events = [e for entry in entries for e in items.feed(entry)] + items.finish(True)
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python({**e, "sequence_number": i})
              for i, e in enumerate(events)]
    part = ["response.output_item.added", "response.content_part.added"]
    part_done = ["response.content_part.done", "response.output_item.done"]
    assert [e.type for e in parsed] == [
        *part, "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done",
        *part_done, *part, "response.output_text.delta", "response.output_text.done", *part_done,
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    output = [TypeAdapter(ResponseOutputItem).validate_python(item) for item in items.items]
    assert [(o.type, o.status) for o in output] == [("reasoning", "completed"), ("message", "completed"),
                                                    ("function_call", "completed")]
    assert output[0].content[0].text == "Thinking." and output[0].id.startswith("rs_")
    assert output[2].arguments == "{}" and output[2].call_id == "call_1"


# ---- the store alone -------------------------------------------------------------------------------
def test_the_store_drops_the_oldest_past_its_count_and_each_past_its_age():
    now = [0.0]
    store = ResponseStore(StoreLimits(max_stored=2, ttl_s=10), clock=lambda: now[0])
    entry = StoredResponse({}, ())
    store.put("a", entry)
    now[0] = 5
    store.put("b", entry)
    store.put("c", entry)                   # a third: the oldest goes
    assert store.get("a") is None and store.get("b") is entry and len(store) == 2
    now[0] = 12                             # b is 7 s old, c too: both kept; at 15.5 neither
    assert store.get("c") is entry
    now[0] = 15.5
    assert store.get("b") is None and store.get("c") is None and len(store) == 0
    nothing = ResponseStore(StoreLimits(max_stored=0))
    nothing.put("a", entry)
    assert nothing.get("a") is None
    with pytest.raises(ValueError):
        StoreLimits(ttl_s=0)

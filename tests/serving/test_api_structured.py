"""Structured outputs through `tercel serve` and the official openai client: response_format
(json_schema, json_object) and vLLM's guided_* fields, refusals before any byte, streaming,
and a run of many concurrent constrained requests whose every output validates."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from bench.structured import load_tasks
from server_util import LiveServer
from spec.adaptive import AdaptiveConfig
from spec.config import EngineConfig

TASKS = load_tasks()


@pytest.fixture(scope="module")
def server():
    s = LiveServer(EngineConfig(max_num_seqs=16, drafter="ngram", adaptive=AdaptiveConfig()), model_name="smol")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def schema_format(task) -> dict:
    return {"type": "json_schema", "json_schema": {"name": task.id, "schema": task.schema, "strict": True}}


def extract(client, task, max_tokens: int = 200, **kw):
    return client.chat.completions.create(model="smol", messages=task.messages(), max_tokens=max_tokens,
                                          response_format=schema_format(task), **kw)


def test_twelve_json_schema_requests_all_parse(client, server):
    """What the issue measured: 12 extraction requests through the openai client."""
    for task in TASKS[:12]:
        reply = extract(client, task, temperature=0)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), task.schema)
    server.wait_idle()


def test_json_object_and_streaming(client, server):
    task = TASKS[0]
    reply = client.chat.completions.create(model="smol", messages=task.messages(), max_tokens=200, temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    whole = extract(client, task, temperature=0).choices[0].message.content
    stream = extract(client, task, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    server.wait_idle()


def test_guided_fields(client, server):
    msgs = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    reply = client.chat.completions.create(model="smol", messages=msgs, max_tokens=8, temperature=0,
                                           extra_body={"guided_choice": ["yes", "no"]})
    assert reply.choices[0].message.content in ("yes", "no")
    reply = client.completions.create(model="smol", prompt="The year is", max_tokens=8, temperature=0.8, seed=1,
                                      extra_body={"guided_regex": r" [12][0-9]{3}\."})
    assert len(reply.choices[0].text) == 6 and reply.choices[0].text.endswith(".")
    grammar = 'root ::= "Answer: " ("yes" | "no")'
    reply = client.chat.completions.create(model="smol", messages=msgs, max_tokens=8, temperature=0,
                                           extra_body={"guided_grammar": grammar})
    assert reply.choices[0].message.content in ("Answer: yes", "Answer: no")
    server.wait_idle()


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"guided_regex": "a(b"}, "guided_regex", "invalid regular expression"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "invalid grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one constraint per request"),
    ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, "guided_json",
     "one constraint per request"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", None),
    ({"response_format": {"type": "xml"}}, "response_format", None),
    ({"guided_choice": []}, "guided_choice", None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_constraint_is_a_400_before_any_byte(server, extra, param, message, stream):
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream,
            **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert message is None or message in err["message"]
    server.wait_idle()


def test_the_constraint_fields_are_in_the_openapi_schema(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    fields = schema["ChatCompletionRequest"]["properties"]
    assert {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"} <= set(fields)


def test_many_concurrent_constrained_requests_all_validate(client, server):
    """24 sampled requests over the 16 schemas, 16 at a time (the slow test runs 200)."""
    run_many(client, server, 24)


@pytest.mark.slow
def test_two_hundred_constrained_requests_all_validate(client, server):
    run_many(client, server, 200)


def run_many(client, server, n: int) -> None:
    def one(i: int):
        task = TASKS[i % len(TASKS)]
        # Every string of the bench's schemas has a maxLength: a sampled reply always ends.
        reply = extract(client, task, max_tokens=600, temperature=0.7, seed=i)
        return task, reply.choices[0]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(n)))
    for task, choice in results:
        assert choice.finish_reason == "stop", (task.id, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), task.schema)
    server.wait_idle()


def test_no_jump_forward_reaches_the_engine_config():
    """`tercel serve --no-jump-forward` turns jump-forward off in the engine; it is on by default."""
    from serving.server import engine_config, parse_serve_args
    assert engine_config(parse_serve_args([])).jump_forward
    assert not engine_config(parse_serve_args(["--no-jump-forward"])).jump_forward

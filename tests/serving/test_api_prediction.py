"""Predicted Outputs through `tercel serve` and the official openai client, on a server with
no drafter (the prediction is then the whole tree): at temperature 0 the same text with and
without a prediction, streamed and not, chat and completions, with OpenAI's
usage.completion_tokens_details; ignored with speculation off; refusals before any work."""
from __future__ import annotations

import httpx
import pytest

from server_util import LiveServer
from spec.config import EngineConfig

CONTEXT = 1024
ASK = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]


@pytest.fixture(scope="module")
def server():
    s = LiveServer(EngineConfig(max_num_seqs=8, max_model_len=CONTEXT), model_name="smol")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def chat(client, **kw):
    return client.chat.completions.create(model="smol", messages=ASK, max_tokens=64, temperature=0, **kw)


@pytest.fixture(scope="module")
def plain(client):
    return chat(client)


def test_a_prediction_changes_the_usage_and_not_the_reply(client, server, plain):
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None        # no prediction, no details
    whole = chat(client, prediction={"type": "content", "content": text})
    half = len(text) // 2
    parts = chat(client, prediction={"type": "content", "content": [{"type": "text", "text": text[:half]},
                                                                    {"type": "text", "text": text[half:]}]})
    for reply in (whole, parts):
        assert reply.choices[0].message.content == text
        assert reply.usage.completion_tokens == plain.usage.completion_tokens
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= plain.usage.completion_tokens // 2
        assert details.rejected_prediction_tokens <= details.accepted_prediction_tokens // 4
    server.wait_idle()


def test_an_edited_prediction_is_partly_rejected(client, server, plain):
    text = plain.choices[0].message.content
    assert "num" in text
    edited = text.replace("num", "value")           # a rename: the reply keeps the model's own name
    reply = chat(client, prediction={"type": "content", "content": edited})
    assert reply.choices[0].message.content == text
    details = reply.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
    server.wait_idle()


def test_the_streamed_usage_chunk_carries_the_details(client, server, plain):
    text = plain.choices[0].message.content
    stream = chat(client, stream=True, stream_options={"include_usage": True},
                  prediction={"type": "content", "content": text})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == plain.usage.completion_tokens
    assert usage.completion_tokens_details.accepted_prediction_tokens >= plain.usage.completion_tokens // 2
    server.wait_idle()


def test_completions_take_a_prediction_too(client, server):
    prompt = "def square(x):\n    "
    base = client.completions.create(model="smol", prompt=prompt, max_tokens=32, temperature=0)
    pred = client.completions.create(model="smol", prompt=prompt, max_tokens=32, temperature=0,
                                     extra_body={"prediction": {"type": "content", "content": base.choices[0].text}})
    assert pred.choices[0].text == base.choices[0].text
    assert pred.usage.completion_tokens_details.accepted_prediction_tokens > 0
    server.wait_idle()


def test_speculation_off_ignores_the_prediction(client, server, plain):
    text = plain.choices[0].message.content
    reply = chat(client, prediction={"type": "content", "content": text}, extra_body={"speculation": "off"})
    assert reply.choices[0].message.content == text
    details = reply.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
    assert reply.model_extra["tercel"]["proposed"] == 0
    server.wait_idle()


@pytest.mark.parametrize("extra, param", [
    ({"n": 2, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"prediction": {"type": "content", "content": "hello " * CONTEXT}}, "prediction"),
    ({"prediction": {"type": "text", "content": "x"}}, "prediction.type"),
    ({"prediction": {"type": "content"}}, "prediction.content"),
    ({"prediction": {"type": "content", "content": 5}}, "prediction.content"),
    ({"prediction": {"type": "content", "content": [{"type": "text"}]}}, "prediction.content[0].text"),
    ({"prediction": "x"}, "prediction"),
], ids=["n>1", "too-long", "type", "no-content", "content-int", "part-no-text", "not-object"])
def test_a_bad_prediction_is_a_400_naming_the_field(server, extra, param):
    body = {"model": "smol", "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    server.wait_idle()


def test_openapi_documents_the_prediction_and_its_usage(server):
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    assert "prediction" in schemas["ChatCompletionRequest"]["properties"]
    assert "prediction" in schemas["CompletionRequest"]["properties"]
    assert schemas["PredictionContent"]["properties"]["type"]["const"] == "content"
    assert set(schemas["CompletionTokensDetails"]["properties"]) == {"accepted_prediction_tokens",
                                                                      "rejected_prediction_tokens", "reasoning_tokens"}
    assert "completion_tokens_details" in schemas["Usage"]["properties"]

"""Logprobs through `tercel serve` and the openai client: chat `logprobs`/`top_logprobs` and
completions `logprobs`/`echo` in OpenAI's shapes, streamed equal to whole, the same values with
speculation on and off, and refusals before any work."""
from __future__ import annotations

import httpx
import pytest

from server_util import ngram_server

ASK = [{"role": "user", "content": "List the first five prime numbers, then explain why 9 is not one."}]


@pytest.fixture(scope="module")
def server():
    s = ngram_server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def chat(client, **kw):
    return client.chat.completions.create(model="smol", messages=ASK, max_tokens=40, temperature=0, logprobs=True,
                                          top_logprobs=2, **kw)


def values(content) -> list:
    return [(e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]


def test_chat_logprobs_whole_streamed_and_without_speculation_agree(client, server):
    whole = chat(client)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in content)
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == whole.choices[0].message.content
    streamed = [c for c in chat(client, stream=True) if c.choices and c.choices[0].logprobs]
    assert values([e for c in streamed for e in c.choices[0].logprobs.content]) == values(content)
    off = chat(client, extra_body={"speculation": "off"})
    assert values(off.choices[0].logprobs.content) == values(content)
    assert whole.model_extra["tercel"]["proposed"] > 0 == off.model_extra["tercel"]["proposed"]
    plain = client.chat.completions.create(model="smol", messages=ASK, max_tokens=40, temperature=0)
    assert plain.choices[0].message.content == whole.choices[0].message.content and plain.choices[0].logprobs is None
    server.wait_idle()


def test_completion_logprobs_and_echo(client, server):
    prompt = "The first five prime numbers are"
    out = client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text and all(len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    echo = client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0, logprobs=3, echo=True)
    elp = echo.choices[0].logprobs
    assert echo.choices[0].text == prompt + out.choices[0].text
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert len(elp.tokens) == echo.usage.prompt_tokens + echo.usage.completion_tokens
    assert elp.token_logprobs[-len(lp.tokens):] == lp.token_logprobs
    streamed = list(client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0, logprobs=3,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echo.choices[0].text
    assert [v for c in streamed if c.choices and c.choices[0].logprobs
            for v in c.choices[0].logprobs.token_logprobs] == elp.token_logprobs
    server.wait_idle()


@pytest.mark.parametrize("route, extra, param", [
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"logprobs": 6}, "logprobs"),
])
def test_logprob_mistakes_are_a_400_naming_the_field(server, route, extra, param):
    body = {"model": "smol", "max_tokens": 2, **extra,
            **({"messages": ASK} if route == "chat" else {"prompt": "hi"})}
    r = httpx.post(f"{server.url}/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_openapi_documents_the_logprob_fields(server):
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    assert {"logprobs", "top_logprobs"} <= set(schemas["ChatCompletionRequest"]["properties"])
    assert {"logprobs", "echo"} <= set(schemas["CompletionRequest"]["properties"])
    assert {"content"} <= set(schemas["ChatLogprobs"]["properties"])
    assert {"tokens", "token_logprobs", "top_logprobs", "text_offset"} <= set(schemas["CompletionLogprobs"]["properties"])

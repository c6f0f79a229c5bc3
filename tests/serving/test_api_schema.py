"""The request models behind /openapi.json, speculation caps against the server's own settings,
and the last-resort 500: every problem is an OpenAI error before the response starts, and the
connection stays usable."""
from __future__ import annotations

import json
import logging
import socket

import httpx
import pytest

from server_util import LiveServer
from drafters.config import SpecConfig
from serving.protocol import APIError, resolve_speculation
from serving.schemas import SpeculationOptions
from spec.adaptive import AdaptiveConfig
from spec.config import EngineConfig

SERVER_TREE = SpecConfig(num_speculative_tokens=2, topk=2, budget=3)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = LiveServer(EngineConfig(model=str(tiny_llama_dir), drafter="ngram", speculation=SERVER_TREE,
                                adaptive=AdaptiveConfig(), max_model_len=256, num_kv_blocks=64),
                   model_name="tiny")
    yield s
    s.close()


def chat_body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}


# ---- speculation resolved against the server ------------------------------------------------
def test_omitted_speculation_fields_are_the_servers_own_settings():
    server = SpecConfig(num_speculative_tokens=5, topk=3, budget=8)
    same = resolve_speculation(SpeculationOptions(drafter="ngram"), server, "ngram")
    assert same.speculate and same.tree is None                  # the server's tree, adaptive caps apply
    shallower = resolve_speculation(SpeculationOptions(gamma=2), server, "ngram").tree
    assert shallower == SpecConfig(num_speculative_tokens=2, topk=3, budget=8)
    assert resolve_speculation(SpeculationOptions(topk=1), server, "ngram").tree == SpecConfig(5, 1, 8)
    assert resolve_speculation(SpeculationOptions(drafter="none"), server, "ngram").speculate is False
    assert resolve_speculation("off", server, "ngram").speculate is False


@pytest.mark.parametrize("field, param", [
    (SpeculationOptions(gamma=6), "speculation.gamma"),
    (SpeculationOptions(topk=4), "speculation.topk"),
    (SpeculationOptions(budget=9), "speculation.budget"),
    (SpeculationOptions(gamma=4, budget=2), "speculation.budget"),     # budget below the depth
    (SpeculationOptions(drafter="eagle3"), "speculation.drafter"),
])
def test_speculation_above_the_servers_caps_is_refused_naming_the_field(field, param):
    with pytest.raises(APIError) as e:
        resolve_speculation(field, SpecConfig(num_speculative_tokens=5, topk=3, budget=8), "ngram:n=3")
    assert e.value.status == 400 and e.value.param == param


def test_first_above_names_the_first_cap_a_tree_exceeds():
    """The one cap check, shared by the handler (asked fields) and the engine (whole trees)."""
    cap = SpecConfig(num_speculative_tokens=5, topk=3, budget=8)
    assert cap.first_above(5, 3, 8) is None and cap.first_above(None, None, None) is None
    assert cap.first_above(6, 9, 9) == ("gamma", 6, 5)
    assert cap.first_above(None, 4, None) == ("topk", 4, 3)
    assert cap.first_above(2, 1, 9) == ("budget", 9, 8)


def test_streamed_request_with_out_of_range_speculation_is_a_400_before_the_stream(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat_body(stream=True, speculation={"gamma": 10**9}))
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "speculation.gamma"


def test_naming_only_the_drafter_keeps_the_servers_tree(server):
    """Against a γ=2 server, {"drafter": "ngram"} is served (it used to mean γ 4 and be refused)."""
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat_body(speculation={"drafter": "ngram"}), timeout=60)
    assert r.status_code == 200, r.text
    server.wait_idle()


# ---- the published schema ---------------------------------------------------------------------
def test_openapi_lists_the_request_schemas_and_error_statuses(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for route, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")):
        op = doc["paths"][route]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert {"200", "400", "404", "500"} <= set(op["responses"]) and "422" not in op["responses"]
    chat = schemas["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(chat["required"])
    assert chat["properties"]["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 2.0}
    assert set(schemas["SpeculationOptions"]["properties"]) == {"drafter", "gamma", "topk", "budget"}
    assert chat["properties"]["n"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 16}
    assert not set(_keys(doc)) & {"ge", "gt", "le", "lt"}     # pydantic names a fuzzer cannot read


def _keys(node):
    if isinstance(node, dict):
        for k, v in node.items():
            yield k
            yield from _keys(v)
    elif isinstance(node, list):
        for v in node:
            yield from _keys(v)


@pytest.mark.parametrize("value, status", [(2.0, 200), (2.5, 400), ("2", 400), (True, 400)])
def test_integers_are_json_schema_integers(server, value, status):
    """2.0 is an integer to JSON Schema (and to the published schema); 2.5, "2" and true are not."""
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": value, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json()["usage"]["completion_tokens"] == 2
    else:
        assert r.json()["error"]["param"] == "max_tokens"
    server.wait_idle()


# ---- text --------------------------------------------------------------------------------------
@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "ok"},
                                                 {"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]),
     "messages[1].content[0].text"),
    ("/v1/completions", {"model": "tiny", "prompt": ["fine", "a\udc00"], "max_tokens": 2}, "prompt[1]"),
])
def test_lone_surrogates_anywhere_are_a_400_naming_the_field(server, route, body, param):
    r = httpx.post(f"{server.url}{route}", content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert "surrogate" in r.json()["error"]["message"]


def test_nul_is_a_character_like_any_other(server):
    """Documented in serving/schemas.py: NUL is kept, the byte-level tokenizer encodes it."""
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "a\u0000b", "max_tokens": 2,
                                                         "stream_options": None, "stop": None}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(server.engine.tokenize("a\u0000b")) == 3
    server.wait_idle()


# ---- the last resort -----------------------------------------------------------------------------
def test_an_unexpected_error_is_a_500_with_the_openai_body_and_the_connection_survives(server, monkeypatch, caplog):
    def broken(*_a, **_k):
        raise RuntimeError("tokenizer exploded")
    monkeypatch.setattr(server.engine.tokenizer, "apply_chat_template", broken)
    good = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    with caplog.at_level(logging.ERROR, logger="tercel.serve"):
        first, second = two_requests_on_one_connection(
            server.port, [("/v1/chat/completions", json.dumps(chat_body()).encode()), ("/v1/completions", good)],
            request_id="abc123")
    assert first.status_code == 500 and first.headers["x-request-id"] == "abc123"
    assert first.json()["error"]["type"] == "server_error" and "abc123" in first.json()["error"]["message"]
    assert any("abc123" in r.getMessage() and r.exc_info for r in caplog.records)
    assert second.status_code == 200 and second.json()["choices"][0]["finish_reason"] == "length"
    server.wait_idle()


def two_requests_on_one_connection(port: int, requests: list[tuple[str, bytes]], request_id: str):
    """POST each body in turn over one TCP connection; a server that closed it fails the second."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        reader = sock.makefile("rb")
        for path, body in requests:
            head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                    f"x-request-id: {request_id}\r\ncontent-length: {len(body)}\r\n\r\n")
            sock.sendall(head.encode() + body)
            out.append(_read_response(reader))
    return out


def _read_response(reader) -> httpx.Response:
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline().strip()):
        name, _, value = line.decode().partition(":")
        headers[name.lower()] = value.strip()
    return httpx.Response(status, headers=headers, content=reader.read(int(headers["content-length"])))

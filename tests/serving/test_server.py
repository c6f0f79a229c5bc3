"""`tercel serve` over real HTTP on loopback: the official openai client, SSE format,
bad input, auth, queue limits, cancellation and drafter faults (SIGTERM: test_shutdown.py)."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from server_util import LiveServer
from serving.bridge import EngineBridge
from serving.metrics import Metrics
from spec.adaptive import AdaptiveConfig
from spec.config import EngineConfig
from spec.engine import LLMEngine

ENGINE = dict(max_model_len=256, num_kv_blocks=128, max_num_seqs=16)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = LiveServer(EngineConfig(model=str(tiny_llama_dir), drafter="ngram", adaptive=AdaptiveConfig(), **ENGINE),
                   model_name="tiny")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat(client, content="Say something.", **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


def test_chat_non_streaming_with_usage(client):
    """A chat completion has one choice, an assistant message, usage and the tercel extension."""
    r = chat(client, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert set(r.model_extra["tercel"]) >= {"proposed", "accepted", "mean_accepted_length"}


def test_chat_streaming_matches_non_streaming(client):
    """Streamed deltas (role first, content, finish, usage) add up to the non-streamed text at T=0."""
    full = chat(client, max_tokens=16, temperature=0)
    chunks = list(chat(client, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content and finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_string_and_token_ids(client, server):
    """/v1/completions takes a string or token ids, streamed or not."""
    tok = server.engine.tokenizer
    a = client.completions.create(model="tiny", prompt="The weather today", max_tokens=8, temperature=0)
    ids = tok("The weather today")["input_ids"]
    b = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    s = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="The weather today", max_tokens=8, temperature=0, stream=True))
    assert a.object == "text_completion" and a.choices[0].text == b.choices[0].text == s
    assert a.usage.prompt_tokens == len(ids)


def test_n_choices_seed_and_stop(client):
    """n=2 gives two choices; a seed reproduces sampled output; a stop string cuts the text."""
    r = chat(client, max_tokens=10, temperature=1.0, n=2, seed=5)
    assert [c.index for c in r.choices] == [0, 1]
    again = chat(client, max_tokens=10, temperature=1.0, n=2, seed=5)
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    full = chat(client, max_tokens=20, temperature=0).choices[0].message.content
    stop = full[6:9]
    cut = chat(client, max_tokens=20, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[:full.index(stop)]


def test_launch_builds_the_engine_on_the_engine_thread_and_raises_its_failure(tiny_llama_dir):
    """All tensor work on one thread (see serving/bridge.py); a model that fails to load is
    raised to the caller, not left in a dead thread."""
    built_on = []

    def make():
        built_on.append(threading.current_thread().name)
        return LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_model_len=64, num_kv_blocks=8))

    bridge = EngineBridge.launch(make, Metrics())
    assert built_on == ["tercel-engine"] and bridge.alive and bridge.engine is not None
    assert asyncio.run(bridge.reset_prefix_cache()) == 0           # a call answered by the engine thread
    with pytest.raises(ZeroDivisionError):                          # ... and a failing one, raised here
        asyncio.run(bridge.call(lambda engine: 1 / 0))
    assert bridge.alive
    bridge.shutdown(0)

    def broken():
        raise ValueError("no such model: nowhere")

    with pytest.raises(ValueError, match="nowhere"):
        EngineBridge.launch(broken, Metrics())


def test_idle_integrity_check_reports_a_corrupt_pool(tiny_llama_dir):
    """With check_integrity_when_idle, the engine thread checks the KV pool each time it goes
    idle: a corrupt pool is logged, kept in integrity_error, and /health answers 503. The
    snapshot the bridge publishes is the engine's (limits and stats, read without a call)."""
    from serving.app import Routes, ServerConfig
    bridge = EngineBridge.launch(lambda: LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_model_len=64,
                                                                num_kv_blocks=8)),
                                 Metrics(), check_integrity_when_idle=True)
    try:
        assert bridge.stats.idle and bridge.stats.kv_blocks_free == bridge.limits.kv_blocks_total == 8
        health = Routes(bridge, ServerConfig(model_names=("tiny",))).health
        assert asyncio.run(health())["status"] == "ok" and bridge.integrity_error is None

        def corrupt(engine):
            engine.blocks._blocks[0].ref_count = 3      # held by no table

        asyncio.run(bridge.call(corrupt))
        deadline = time.monotonic() + 10
        while bridge.integrity_error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "not in exactly one state" in str(bridge.integrity_error)
        reply = asyncio.run(health())
        assert reply.status_code == 503 and b"integrity check" in reply.body
    finally:
        bridge.shutdown(0)


def test_models_and_health(server):
    """/v1/models lists the served model; /health is 200."""
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_reset_prefix_cache(server):
    """POST /reset_prefix_cache (as vLLM) drops the cached prompt: asking again hits nothing."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "A prompt long enough to fill "
            "several KV blocks of the tiny model, twice over. " * 2}], "max_tokens": 2}
    blocks = server.engine.blocks

    def hits_of_one_request() -> int:
        before = blocks.prefix_hits
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        return blocks.prefix_hits - before

    hits_of_one_request()
    assert hits_of_one_request() > 0                    # cached by the first request
    server.wait_idle()
    reply = httpx.post(f"{server.url}/reset_prefix_cache")
    assert reply.status_code == 200 and reply.json()["dropped_blocks"] > 0
    assert hits_of_one_request() == 0
    server.wait_idle()
    assert server.metric("tercel_kv_blocks_used") == 0


BAD = [
    (b"{not json", 400, None),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ({"model": "tiny"}, 400, "messages"),
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "messages": "hi"}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, 400, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000}, 400, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "speculation": "sometimes"}, 400,
     "speculation"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "speculation": {"gamma": 99}}, 400,
     "speculation.gamma"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "speculation": {"drafter": "small:/x"}}, 400,
     "speculation.drafter"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "messages[0].content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": ["\udfff"]}, 400, "stop[0]"),
]


@pytest.mark.parametrize("body, status, param", BAD)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, body, status, param):
    """Malformed or out-of-range requests: the status, an OpenAI-style error body, no 422."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_lone_surrogate_in_a_completion_prompt_is_a_400_and_the_connection_stays_usable(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:       # one connection for both requests
        r = c.post("/v1/completions", content=b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_speculation_field_off_auto_object(client):
    """speculation "off" reports no verify steps; an object caps the tree; T=0 text is the same."""
    off = chat(client, "repeat: a b c a b c a b c a b", max_tokens=24, temperature=0, extra_body={"speculation": "off"})
    obj = chat(client, "repeat: a b c a b c a b c a b", max_tokens=24, temperature=0,
               extra_body={"speculation": {"drafter": "ngram", "gamma": 2}})
    none = chat(client, "repeat: a b c a b c a b c a b", max_tokens=24, temperature=0,
                extra_body={"speculation": {"drafter": "none"}})
    assert off.model_extra["tercel"]["verify_steps"] == 0 == none.model_extra["tercel"]["verify_steps"]
    assert off.choices[0].message.content == obj.choices[0].message.content == none.choices[0].message.content


def test_sixteen_concurrent_streams_then_pool_is_whole(server):
    """16 concurrent streaming clients get the same text as sequential non-streaming requests;
    afterwards /metrics shows no KV block in use."""
    prompts = [f"Tell me about topic number {i}." for i in range(16)]
    ref = [httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 20, "temperature": 0,
        "speculation": "off"}, timeout=60).json()["choices"][0]["message"]["content"] for p in prompts]

    async def one(ac, p):
        stream = await ac.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                  max_tokens=20, temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(one(ac, p) for p in prompts))

    assert asyncio.run(main()) == ref
    server.wait_idle()
    assert server.metric("tercel_kv_blocks_used") == 0
    assert server.metric("tercel_kv_blocks_free") == server.engine.blocks.num_total_blocks


def test_client_disconnect_frees_blocks(server):
    """Closing a stream mid-way cancels the request and frees its KV blocks."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 200,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert server.engine.blocks.num_used_blocks > 0
    server.wait_idle()
    assert server.metric("tercel_kv_blocks_used") == 0


def test_drafter_error_falls_back_to_plain_decoding(server, client, monkeypatch):
    """A drafter that raises is logged and counted; the request completes with the plain-decoding output."""
    ref = chat(client, "fallback please", max_tokens=12, temperature=0, extra_body={"speculation": "off"})

    def boom(reqs):
        raise RuntimeError("drafter exploded")

    before = server.metric("tercel_drafter_errors_total")
    monkeypatch.setattr(server.engine.adaptive, "drafts", lambda *a, **kw: True)   # ask the drafter every step,
    monkeypatch.setattr(server.engine.guard, "speculates", lambda decoding: True)   # at every batch size
    monkeypatch.setattr(server.engine.drafter, "propose", boom)
    r = chat(client, "fallback please", max_tokens=12, temperature=0)
    assert r.choices[0].message.content == ref.choices[0].message.content
    deadline = time.monotonic() + 10        # /metrics reads the engine after its step, maybe after the reply
    while server.metric("tercel_drafter_errors_total") <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("tercel_drafter_errors_total") > before


def test_engine_failure_is_an_openai_error_and_the_server_recovers(server, client, monkeypatch):
    """A failing engine step: the request gets a 503 in OpenAI's error shape (not a bare 500),
    without the exception's text (it stays in the log), even when the drain step after it fails
    too; the next request is served, the pool whole."""
    real_step, calls = server.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) <= 2:                 # the step and the drain after the abort both fail
            raise RuntimeError("simulated kernel fault")
        return real_step()

    monkeypatch.setattr(server.engine, "step", failing_step)
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert "simulated" not in r.text
    assert chat(client, max_tokens=4, temperature=0).choices[0].finish_reason in ("stop", "length")
    server.wait_idle()
    assert server.engine.blocks.num_used_blocks == 0


def test_api_key_and_queue_limit(tiny_llama_dir):
    """With --api-key: 401 without the key, /health open. With a full queue: 429 + Retry-After,
    while the running requests complete."""
    s = LiveServer(EngineConfig(model=str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=1),
                   model_name="tiny", api_key="sekrit", max_queue=1)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "ignore_eos": True}
        assert httpx.post(f"{s.url}/v1/chat/completions", json=body).status_code == 401
        assert httpx.post(f"{s.url}/v1/chat/completions", json=body,
                          headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.post(f"{s.url}/reset_prefix_cache").status_code == 401
        auth = {"Authorization": "Bearer sekrit"}

        async def fire():
            async with httpx.AsyncClient(timeout=60) as ac:
                return await asyncio.gather(*(ac.post(f"{s.url}/v1/chat/completions", json=body, headers=auth)
                                              for _ in range(6)))

        codes = [r.status_code for r in asyncio.run(fire())]
        assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}
        r429 = next(r for r in asyncio.run(fire()) if r.status_code == 429)
        assert r429.headers["retry-after"] == "1" and r429.json()["error"]["type"] == "rate_limit_error"
        s.wait_idle()
    finally:
        s.close()


def test_smollm2_greedy_through_the_api_equals_speculation_off(smollm2_dir):
    """SmolLM2, 4 MT-bench prompts, T=0: the default (speculating, n-gram) equals speculation "off"."""
    from conftest import mtbench_prompts
    s = LiveServer(EngineConfig(max_num_seqs=8, drafter="ngram", adaptive=AdaptiveConfig()), model_name="smol")
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=300)
        for p in mtbench_prompts(4):
            msgs = [{"role": "user", "content": p}]
            spec = c.chat.completions.create(model="smol", messages=msgs, max_tokens=48, temperature=0)
            off = c.chat.completions.create(model="smol", messages=msgs, max_tokens=48, temperature=0,
                                            extra_body={"speculation": "off"})
            assert spec.choices[0].message.content == off.choices[0].message.content
            assert off.model_extra["tercel"]["verify_steps"] == 0
        s.wait_idle()
    finally:
        s.close()

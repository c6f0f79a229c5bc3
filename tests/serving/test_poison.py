"""The poison test (issue 31): good requests on the tiny model while other clients send every
bad input the server must survive. No good request fails or changes (T=0 outputs equal the
same requests run alone), every bad one gets its 4xx or is cancelled, the only 5xx is the one
the test injects into the engine, and the KV pool passes its integrity check afterwards."""
from __future__ import annotations

import asyncio
import collections
import time

import httpx
import pytest

from serving.limits import ServerLimits
from server_util import LiveServer, metric_count, raw_request
from spec.config import EngineConfig
from verifier.sampling.grammar_limits import GrammarLimits

POISON = 4242        # a prompt token whose forward the test makes raise
GOOD = ["Name three rivers.", "Why is the sky blue?", "Write a haiku.", "Count to five.",
        "What is a prime?", "Say hello in French."]
NEW = 24


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    limits = ServerLimits(stream_buffer=4, send_timeout_s=1.0)
    live = LiveServer(EngineConfig(model=str(tiny_llama_dir), max_model_len=1024, num_kv_blocks=512,
                                   max_num_seqs=16, drafter="ngram", grammar=GrammarLimits(timeout_s=10.0)),
                      "tiny", limits=limits,
                      send_buffer_bytes=4096)
    target, real = live.engine.target, live.engine.target.forward

    def forward(batch):              # an engine fault that one request's rows bring
        if any(POISON in s.token_ids for s in batch.seqs):
            raise RuntimeError("injected kernel fault")
        return real(batch)

    target.forward = forward
    yield live
    live.close()


def good_body(text: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": NEW, "temperature": 0}


def chat_body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}


def nested_arrays(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


BAD = {   # kind -> (path, body, the status it must get)
    "empty regex, T=0": ("chat", chat_body(guided_regex="[^\\s\\S]", temperature=0), 400),
    "empty grammar, T=1": ("chat", chat_body(guided_grammar="root ::= root", temperature=1.0), 400),
    "grammar bomb": ("chat", chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "bomb", "schema": nested_arrays(200)}}), 400),
    "huge stop list": ("chat", chat_body(stop=[f"s{i}" for i in range(100_000)]), 400),
    "10 MB body": ("chat", chat_body(messages=[{"role": "user", "content": "x" * 10_000_000}]), 413),
    "engine fault": ("completions", {"model": "tiny", "prompt": [1, 2, POISON], "max_tokens": 4}, 500),
}


async def send_all(server, client, statuses) -> list[str]:
    """The good requests, the bad ones and the rude clients at once; the good texts back."""
    async def good(text):
        r = await client.post(f"{server.url}/v1/chat/completions", json=good_body(text))
        statuses["good"].append(r.status_code)
        return r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None

    async def bad(kind, path, body, _expected):
        r = await client.post(f"{server.url}/v1/{'chat/completions' if path == 'chat' else path}", json=body)
        statuses[kind].append(r.status_code)

    async def rude():
        long = {**good_body("Tell a long story."), "max_tokens": 900, "ignore_eos": True}
        leaver = raw_request(server.url, long)                     # leaves before its reply
        await asyncio.sleep(0.5)
        leaver.close()

    jobs = [good(t) for t in GOOD] + [bad(k, *v) for k, v in BAD.items()] + [rude()]
    return (await asyncio.gather(*jobs))[:len(GOOD)]


def test_no_bad_client_hurts_a_good_request(server):
    """Good T=0 requests beside every bad input give exactly their texts alone; each bad input
    gets its status; both rude clients are cancelled; the pool is whole afterwards."""
    alone = [httpx.post(f"{server.url}/v1/chat/completions", json=good_body(t), timeout=60)
             .json()["choices"][0]["message"]["content"] for t in GOOD]
    cancelled = 'tercel_request_errors_total{reason="cancelled"}'
    before = metric_count(server, cancelled)
    statuses = collections.defaultdict(list)

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await send_all(server, client, statuses)

    # Never reads its 4 streams: their outputs outgrow the socket buffers, the SSE writes block,
    # and the stream buffer's bound or the send timeout drops it while its socket is still open.
    reader = raw_request(server.url, {**good_body("Tell a long story."), "max_tokens": 900, "ignore_eos": True,
                                      "stream": True, "n": 4})
    together = asyncio.run(run())
    assert together == alone
    assert statuses["good"] == [200] * len(GOOD)
    assert {k: statuses[k] for k in BAD} == {k: [v[2]] for k, v in BAD.items()}
    deadline = time.monotonic() + 60
    while metric_count(server, cancelled) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric_count(server, cancelled) >= before + 2      # the leaver, and the reader still connected
    reader.close()
    server.wait_idle()
    asyncio.run(server.bridge.call(lambda engine: engine.check_integrity()))
    assert httpx.get(f"{server.url}/health").status_code == 200

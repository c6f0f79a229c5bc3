"""The bridge when the engine fails (serving/bridge.py): a step no request owns fails every
request with a 503 and /health says 503 until a probe forward and the pool check pass; a
dead engine thread answers every waiting and new request within a second; a stream whose
client reads nothing is dropped at its buffer's bound and its request aborted."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from serving.bridge import EngineBridge, EngineUnavailable, RequestStream, SlowReader
from serving.limits import ServerLimits
from serving.metrics import Metrics
from spec.config import EngineConfig
from spec.engine import LLMEngine
from spec.request import RequestOutput, Submission
from server_util import LiveServer
from verifier.sampling.sampling_params import SamplingParams


@pytest.fixture()
def server(tiny_llama_dir):
    live = LiveServer(EngineConfig(model=str(tiny_llama_dir), max_model_len=128, num_kv_blocks=32), "tiny")
    yield live
    live.close()


def chat(server, max_tokens=8, timeout=30.0):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "temperature": 0}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_step_no_request_owns_is_a_503_and_health_says_so_until_recovered(server, monkeypatch):
    """Every forward fails (the probe too): the request gets a 503 without the exception's text,
    /health answers 503 while the device stays broken, and 200 once a probe passes again."""
    target = server.engine.target
    real = target.forward

    def broken(batch):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(target, "forward", broken)
    reply = chat(server)
    assert reply.status_code == 503 and "secret" not in reply.text
    assert httpx.get(f"{server.url}/health").status_code == 503
    assert chat(server).status_code == 503            # refused at once while unhealthy
    monkeypatch.setattr(target, "forward", real)
    wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 200)
    assert chat(server).status_code == 200
    server.wait_idle()


def test_a_dead_engine_thread_answers_every_request_within_a_second(server, monkeypatch):
    """The thread dies between steps (an error outside any step): the waiting request and every
    later one get a 503 within a second, and /health is 503."""
    bridge = server.bridge
    real = bridge._drain_inbox

    def die():
        if not bridge._inbox.empty():     # the request's Add is waiting: die with it there
            raise SystemExit("engine thread bug")
        return real()

    monkeypatch.setattr(bridge, "_drain_inbox", die)
    start = time.monotonic()
    assert chat(server, timeout=5).status_code == 503
    assert chat(server, timeout=5).status_code == 503
    assert time.monotonic() - start < 2.0
    assert httpx.get(f"{server.url}/health").status_code == 503


def test_a_stream_whose_client_reads_nothing_is_dropped_at_its_bound():
    """The engine pushes outputs nobody reads: past `buffer` the stream ends with SlowReader and
    its request is aborted, instead of holding every output (each a copy of the whole text)."""
    aborted = []

    class Bridge:
        def abort(self, rid):
            aborted.append(rid)

    async def run():
        stream = RequestStream(Bridge(), "req-0", asyncio.get_running_loop(), 1, buffer=4)
        for i in range(10):
            stream._push(RequestOutput("req-0", None, [1], "x" * i, [1] * i, False, None))
        await asyncio.sleep(0.05)
        return [item async for item in _drain(stream)]

    items = asyncio.run(run())
    assert aborted == ["req-0"] and len(items) == 5 and isinstance(items[-1], SlowReader)


async def _drain(stream):
    while True:
        try:
            yield await stream.__anext__()
        except StopAsyncIteration:
            return
        except SlowReader as e:
            yield e
            return


def test_a_bridge_whose_thread_is_gone_refuses_submissions(tiny_llama_dir):
    """submit() checks the thread: no request is queued where nothing will ever step it."""
    bridge = EngineBridge.launch(lambda: LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_model_len=64,
                                                                num_kv_blocks=8)), Metrics())
    bridge.shutdown(0)

    async def submit():
        bridge.submit(Submission([1, 2, 3], SamplingParams(max_tokens=2)))

    with pytest.raises(EngineUnavailable):
        asyncio.run(submit())


def test_limits_are_validated():
    """A limit below 1 is refused when the server starts, not at the first request."""
    with pytest.raises(ValueError, match="max_stop"):
        ServerLimits(max_stop=0)


def test_a_stream_that_fails_alone_ends_with_its_error_and_no_done(server, monkeypatch):
    """A streamed request whose rows make the forward raise: one error event, no [DONE], no
    exception text; a stream beside it ends normally with [DONE]."""
    target, real, poison = server.engine.target, server.engine.target.forward, 4242

    def forward(batch):
        if any(poison in s.token_ids for s in batch.seqs):
            raise RuntimeError("secret kernel detail")
        return real(batch)

    monkeypatch.setattr(target, "forward", forward)

    def events(prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

    bad = events([1, 2, poison])
    assert '"internal_error"' in bad[-1] and "[DONE]" not in bad and "secret" not in "".join(bad)
    assert events([1, 2, 3])[-1] == "[DONE]"
    server.wait_idle()

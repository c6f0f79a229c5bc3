"""The server's per-request limits (serving/limits.py, docs/serving.md): each refuses its
request with a 4xx before any work, or drops a client that does not read, and each test here
fails without its limit. Grammar limits: tests/engine/test_grammar_limits.py."""
from __future__ import annotations

import socket
import time

import httpx
import pytest

from serving.limits import ServerLimits
from server_util import LiveServer, metric_count, raw_request
from spec.config import EngineConfig


def tiny_server(tiny_llama_dir, **limits) -> LiveServer:
    return LiveServer(EngineConfig(model=str(tiny_llama_dir), max_model_len=1024, num_kv_blocks=512,
                                   max_num_seqs=8), "tiny", limits=ServerLimits(**limits), send_buffer_bytes=4096)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    live = tiny_server(tiny_llama_dir, max_body_bytes=1 << 20, max_stop=4, max_stop_chars=8)
    yield live
    live.close()


def chat(server, content="hi", **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)


def test_a_body_over_the_limit_is_a_413_with_or_without_a_length(server):
    """By Content-Length before it is read, and counted as it arrives when sent chunked."""
    big = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * (2 << 20) + b'"}]}'
    r = httpx.post(f"{server.url}/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunks = (big[i:i + 65536] for i in range(0, len(big), 65536))
    r = httpx.post(f"{server.url}/v1/chat/completions", content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert chat(server).status_code == 200


def test_stop_strings_are_limited_in_number_and_length(server):
    """More stop strings than --max-stop, or one longer than --max-stop-chars: a 400 naming 'stop'."""
    for stop in (["a", "b", "c", "d", "e"], ["x" * 9]):
        r = chat(server, stop=stop)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert chat(server, stop=["a", "b", "c", "d"]).status_code == 200


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(server, monkeypatch):
    """Characters over (context x the longest token) cannot fit: refused without tokenizing."""
    def never(*args, **kw):
        raise AssertionError("tokenized a prompt that could not fit")

    monkeypatch.setattr(server.bridge.tokenizer, "apply_chat_template", never)
    r = chat(server, content="x" * 900_000)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_non_streamed_client_that_leaves_is_cancelled(server):
    """The request is aborted soon after its client closes, long before its max_tokens."""
    cancelled = 'tercel_request_errors_total{reason="cancelled"}'
    before = metric_count(server, cancelled)
    sock = raw_request(server.url, {"model": "tiny", "messages": [{"role": "user", "content": "go"}],
                                    "max_tokens": 900, "ignore_eos": True})
    time.sleep(0.5)
    sock.close()
    deadline = time.monotonic() + 20
    while metric_count(server, cancelled) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric_count(server, cancelled) == before + 1
    server.wait_idle()


@pytest.mark.parametrize("limits", [{"stream_buffer": 4, "send_timeout_s": 3600.0},
                                    {"stream_buffer": 1_000_000, "send_timeout_s": 1.0}],
                         ids=["stream buffer", "send timeout"])
def test_a_streamed_client_that_never_reads_is_dropped(tiny_llama_dir, limits):
    """Four streams nobody reads, the socket still open: each limit alone aborts them."""
    live = tiny_server(tiny_llama_dir, **limits)
    try:
        cancelled = 'tercel_request_errors_total{reason="cancelled"}'
        sock = raw_request(live.url, {"model": "tiny", "messages": [{"role": "user", "content": "go"}],
                                      "max_tokens": 900, "ignore_eos": True, "stream": True, "n": 4})
        deadline = time.monotonic() + 60
        while metric_count(live, cancelled) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric_count(live, cancelled) >= 1
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        live.wait_idle()
    finally:
        live.close()

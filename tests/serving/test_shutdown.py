"""`tercel serve` under SIGTERM: requests still running end as normal replies, and the process exits 0.

Each test starts a server process on the tiny random model, opens a non-streaming request (two
choices) and a stream, and signals once all three sequences are generating. The server logs how
many requests it found running when it began to stop, so the tests know they were in flight."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_util import free_port, metric_value

RUNNING = 3              # the non-streaming request's two choices and the stream
TIMEOUT = httpx.Timeout(300, connect=10)


class Serve:
    """A `tercel serve` subprocess; its output goes to a file (a pipe nobody reads could fill)."""

    def __init__(self, model_dir: Path, log_path: Path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "serving.cli", "serve", "--model", str(model_dir), "--port", str(self.port),
               "--max-model-len", "1024", "--kv-blocks", "256", *flags]
        with open(log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self._wait(lambda: self._healthy(), "the server did not come up")

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def running(self) -> float:
        return metric_value(httpx.get(f"{self.url}/metrics", timeout=5).text, "tercel_requests_running")

    def log(self) -> str:
        return self.log_path.read_text()

    def _wait(self, ready, what: str, limit_s: float = 120) -> None:
        deadline = time.monotonic() + limit_s
        while not ready():
            assert self.proc.poll() is None, f"{what}: the server exited\n{self.log()}"
            assert time.monotonic() < deadline, f"{what}\n{self.log()}"
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def serve(tiny_llama_dir, tmp_path):
    started = []

    def start(*flags: str) -> Serve:
        started.append(Serve(tiny_llama_dir, tmp_path / f"serve{len(started)}.log", *flags))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _body(model_dir, max_tokens: int, **extra) -> dict:
    return {"model": str(model_dir), "messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens,
            "ignore_eos": True, **extra}


def _events(lines) -> list[str]:
    return [line.removeprefix("data:").strip() for line in lines if line.startswith("data:")]


def _has_text(event: str) -> bool:
    return event != "[DONE]" and any(c["delta"].get("content") for c in json.loads(event)["choices"])


def _finish_reasons(events: list[str]) -> list[str]:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]


def _signal_with_requests_in_flight(s: Serve, model_dir, max_tokens: int, after_first=None):
    """Start both requests, send SIGTERM once all their sequences generate, and return the
    non-streaming response and the stream's events. after_first(s) runs after the signal,
    while the stream is still open."""
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, f"{s.url}/v1/chat/completions",
                            json=_body(model_dir, max_tokens, n=2), timeout=TIMEOUT)
        body = _body(model_dir, max_tokens, stream=True)
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            events = []
            while not any(_has_text(e) for e in events):
                events += _events([next(lines)])
            s._wait(lambda: s.running() >= RUNNING, "the requests did not start")
            s.proc.send_signal(signal.SIGTERM)
            if after_first:
                after_first(s)
            events += _events(lines)
        return whole.result(), events


def _assert_stopped_cleanly(s, reply, events, reason: str) -> None:
    """Exit 0 after finding the requests running; both choices of the non-streaming reply and
    the stream end with `reason`, the stream with [DONE]."""
    assert s.proc.wait(timeout=60) == 0
    assert f"stopping: {RUNNING} request(s) running" in s.log()
    assert reply.status_code == 200
    assert [c["finish_reason"] for c in reply.json()["choices"]] == [reason, reason]
    assert _finish_reasons(events) == [reason] and events[-1] == "[DONE]"


def test_sigterm_with_enough_grace_finishes_running_requests_and_exits_0(serve, tiny_llama_dir):
    """A grace long enough for the running requests: they all finish as asked ("length"), the
    stream ends with [DONE], and the process exits 0."""
    s = serve("--grace", "300")
    reply, events = _signal_with_requests_in_flight(s, tiny_llama_dir, max_tokens=200)
    _assert_stopped_cleanly(s, reply, events, "length")
    assert reply.json()["usage"]["completion_tokens"] == 2 * 200


def test_sigterm_past_the_grace_aborts_running_requests_as_normal_replies_and_exits_0(serve, tiny_llama_dir):
    """A grace far too short for ~1,000 tokens: once it is over, every running choice ends with
    finish_reason "abort" in a 200 reply, the stream ends with [DONE] (not a 500 from a
    cancelled handler, nor a cut connection), and the process exits 0."""
    s = serve("--grace", "0.2")
    reply, events = _signal_with_requests_in_flight(s, tiny_llama_dir, max_tokens=960)
    _assert_stopped_cleanly(s, reply, events, "abort")
    assert "Cancel" not in s.log()       # uvicorn's backstop did not have to cancel a handler


# SIGINT, the same path as a second SIGTERM, under `make test-slow`
@pytest.mark.parametrize("second", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_during_the_grace_aborts_at_once_and_exits_0(serve, tiny_llama_dir, second):
    """SIGTERM, then another signal, with a grace of 10 minutes: the second signal aborts the
    running requests at once instead of waiting out the grace. The replies end with "abort"
    unless the handlers took longer than HURRY_S to send them and were cut (not asserted:
    that is timing)."""
    s = serve("--grace", "600")

    def second_signal(s: Serve) -> None:
        s._wait(lambda: "stopping:" in s.log(), "the server did not begin to stop")
        s.proc.send_signal(second)

    try:
        reply, events = _signal_with_requests_in_flight(s, tiny_llama_dir, max_tokens=960, after_first=second_signal)
    except httpx.HTTPError:
        reply, events = None, None
    assert s.proc.wait(timeout=120) == 0
    assert "a second signal came: aborting" in s.log()
    if reply is not None:
        assert [c["finish_reason"] for c in reply.json()["choices"]] == ["abort", "abort"]
        assert _finish_reasons(events) == ["abort"] and events[-1] == "[DONE]"

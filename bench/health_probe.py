"""How long /health takes while one client sends a large body (issue 31's probe).

    python -m bench.health_probe --url http://127.0.0.1:8000 --mb 10

Sends one chat request whose message is `--mb` megabytes of text, once with a Content-Length
and once chunked (no length: the server must count), while polling /health; prints the
status each large request got and the /health latencies (median and worst, ms) beside a
baseline taken with nothing else running.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx

from verifier.model.loader import DEFAULT_MODEL


def poll(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            start = time.perf_counter()
            client.get(f"{url}/health")
            out.append((time.perf_counter() - start) * 1e3)
            time.sleep(0.01)


def big_body(mb: float, model: str) -> bytes:
    text = "word " * int(mb * (1 << 20) / 5)
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()


def send(url: str, body: bytes, chunked: bool) -> int:
    headers = {"content-type": "application/json"}
    content = (body[i:i + 65536] for i in range(0, len(body), 65536)) if chunked else body
    with httpx.Client(timeout=120) as client:
        return client.post(f"{url}/v1/chat/completions", content=content, headers=headers).status_code


def during(url: str, fn) -> tuple[object, list[float]]:
    stop, times = threading.Event(), []
    poller = threading.Thread(target=poll, args=(url, stop, times))
    poller.start()
    try:
        result = fn()
    finally:
        time.sleep(0.2)
        stop.set()
        poller.join()
    return result, times


def summary(times: list[float]) -> str:
    return f"median {statistics.median(times):.1f} ms, worst {max(times):.1f} ms over {len(times)} probes"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args()
    body = big_body(args.mb, args.model)
    _, base = during(args.url, lambda: time.sleep(1.0))
    print(f"baseline /health: {summary(base)}")
    for chunked in (False, True):
        status, times = during(args.url, lambda: send(args.url, body, chunked))
        kind = "chunked" if chunked else "Content-Length"
        print(f"{len(body) / 1e6:.1f} MB body ({kind}): status {status}; /health {summary(times)}")


if __name__ == "__main__":
    main()

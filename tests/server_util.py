"""A live Tercel server on a loopback port, run by uvicorn in a background thread."""
from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import uvicorn

from serving.app import ServerConfig, build_app
from serving.bridge import EngineBridge
from serving.limits import ServerLimits
from serving.metrics import Metrics
from spec.adaptive import AdaptiveConfig
from spec.config import EngineConfig
from spec.engine import LLMEngine


def metric_value(text: str, name: str) -> float:
    """The first sample in a Prometheus exposition named `name` whose labels include the ones
    written in it (`tercel_request_errors_total{reason="cancelled"}`); KeyError if none."""
    from prometheus_client.parser import text_string_to_metric_families
    base, _, selector = name.partition("{")
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', selector))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == base and wanted.items() <= sample.labels.items():
                return sample.value
    raise KeyError(name)


def ngram_server(quantization: str = "auto", **app_options) -> LiveServer:
    """The default model as "smol" with the n-gram drafter verifying whole trees: whether drafts run
    does not depend on the machine's load. `quantization="none"`: dense weights, so the text does
    not depend on the int4 kernel a load's timings chose. `app_options`: more ServerConfig fields."""
    config = EngineConfig(max_num_seqs=8, drafter="ngram", adaptive=AdaptiveConfig(enabled=False),
                          quantization=quantization)
    return LiveServer(config, model_name="smol", **app_options)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_request(url: str, body: dict) -> socket.socket:
    """A client that sends its request and then never reads (a small receive buffer)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def metric_count(server, name: str) -> float:
    """`server.metric(name)`, 0 before the series has a sample."""
    try:
        return server.metric(name)
    except KeyError:           # a labelled series appears with its first count
        return 0.0


class LiveServer:
    def __init__(self, config, model_name: str, api_key: str | None = None, max_queue: int = 256,
                 limits: ServerLimits | None = None, allowed_origins: tuple[str, ...] = (),
                 send_buffer_bytes: int | None = None, **app_options):
        """`send_buffer_bytes`: the kernel's send buffer of each connection (a slow network path:
        a client that does not read blocks the server's writes after that much); `app_options`:
        more ServerConfig fields (model_names then replaces `model_name`'s one)."""
        limits = limits or ServerLimits()
        self.bridge = EngineBridge.launch(lambda: LLMEngine(config), Metrics(), max_queue=max_queue,
                                          check_integrity_when_idle=True, stream_buffer=limits.stream_buffer)
        self.engine = self.bridge.engine     # for tests that patch the engine; reads go through bridge.stats
        app = build_app(self.bridge, ServerConfig(**{"model_names": (model_name,), **app_options}, api_key=api_key,
                                                  limits=limits, allowed_origins=allowed_origins))
        listener = socket.socket()
        if send_buffer_bytes:       # accepted connections inherit it (and lose autotuning)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        listener.bind(("127.0.0.1", 0))
        self.port = listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model_name
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)

    def openai_client(self, timeout: float = 600):
        """The official openai client on this server (no retries: a refusal is the test's answer)."""
        import openai
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=timeout)

    def anthropic_client(self, timeout: float = 600):
        """The official anthropic client on this server, as openai_client."""
        import anthropic
        return anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=timeout)

    def metric(self, name: str, headers: dict | None = None) -> float:
        """A sample's value: `name`, or `name{label="value",...}` for the series with those labels."""
        return metric_value(httpx.get(f"{self.url}/metrics", headers=headers or {}).text, name)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until no request holds KV blocks (bounded; the engine frees within a step), and the
        pool has passed the bridge's idle integrity checks so far."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.bridge.stats
            if stats.kv_blocks_used == 0 and stats.running == 0 and self.bridge.in_flight == 0:
                self.check_integrity()
                return
            time.sleep(0.05)
        raise AssertionError("requests still hold KV blocks")

    def check_integrity(self) -> None:
        if self.bridge.integrity_error is not None:
            raise AssertionError(f"the idle integrity check failed: {self.bridge.integrity_error}")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.bridge.shutdown(0)
        self.engine = None      # the bridge dropped its own: the engine's memory goes now
        self.check_integrity()

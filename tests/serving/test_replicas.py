"""Two Ray Serve replicas of the tiny model behind the ingress, on a local Ray instance this module
starts and stops: prefix affinity, spreading, the OpenAI API through the ingress, and a replica
killed under its requests. Skipped without the `cluster` extra (ray[serve])."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason='Ray Serve is an optional extra: pip install -e ".[cluster]"')
serve = pytest.importorskip("ray.serve", reason='Ray Serve is an optional extra: pip install -e ".[cluster]"')

from serving.cluster.replicas import build_application   # noqa: E402  (after the skip)
from serving.server import parse_serve_args      # noqa: E402
from server_util import free_port                # noqa: E402

SYSTEM = "You are Tercel's test assistant. Answer briefly and cite the manual section you used. " * 8
REPLICA = "x-tercel-replica"


class Cluster:
    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.http = httpx.Client(base_url=url, timeout=120)

    def chat(self, messages: list[dict], **extra) -> httpx.Response:
        return self.http.post("/v1/chat/completions", json={"model": self.model, "messages": messages,
                                                            "max_tokens": 4, **extra})

    def per_replica(self, name: str, label: str = "") -> dict[str, float]:
        """{replica id: value} of one metric (its series with `label`, e.g. 'reason="cancelled"')
        from the ingress's merged /metrics."""
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if (m := re.match(rf'{name}\{{.*replica="([^"]+)".*\}} (\S+)$', line)) and label in line:
                out[m[1]] = float(m[2])
        return out

    def replicas(self) -> set[str]:
        return set(self.http.get("/health").json()["replicas"])


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)   # never a cluster found running
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = parse_serve_args(["--model", str(tiny_llama_dir), "--replicas", "2", "--replica-cpus", "0",
                                 "--threads", "1", "--drafter", "none", "--kv-blocks", "512",
                                 "--affinity-imbalance", "8"])
        serve.run(build_application(args), name="tercel", route_prefix="/")
        yield Cluster(f"http://127.0.0.1:{port}", str(tiny_llama_dir))
    finally:
        serve.shutdown()
        ray.shutdown()


def test_conversation_and_shared_system_prompt_stay_on_one_replica(cluster):
    """A conversation's turns, and other users' requests with the same long system prompt, land on
    the replica that served the first; its prefix-cache hits grow, the other replica's do not."""
    before = cluster.per_replica("tercel_prefix_cache_hits_total")
    history, seen = [{"role": "system", "content": SYSTEM}], []
    for turn in ("What is a KV block?", "And a prefix cache?", "Why route by prefix?"):
        history.append({"role": "user", "content": turn})
        r = cluster.chat(history)
        assert r.status_code == 200, r.text
        seen.append(r.headers[REPLICA])
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    for user in ("Another user asks about speculation.", "A third asks about paging."):
        seen.append(cluster.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
                    .headers[REPLICA])
    assert len(set(seen)) == 1, seen
    after = cluster.per_replica("tercel_prefix_cache_hits_total")
    home, other = seen[0], next(r for r in after if r != seen[0])
    assert after[home] - before.get(home, 0) >= 4 * 64       # 4 requests found at least the system prompt
    assert after[other] == before.get(other, 0)
    assert cluster.per_replica("tercel_prefix_cache_queries_total")[home] > 0


# Under `make test-slow` (about 12 s, most of it waiting out Ray's queue-length cache); the prefix's
# routing above and a lost replica's below stay in `make test`.
@pytest.mark.slow
def test_unrelated_requests_spread_across_both_replicas(cluster):
    """Requests that share no prefix go to the least loaded replica, ties to the one holding fewer
    prefixes: a handful of unrelated ones reach both replicas. Each is long (about 16 chunks) so
    that two outweigh the conversation the previous test left on one replica, however long its
    replies came out (at 12 repeats each, all six once went to one replica). First the router's
    queue lengths from the previous test expire: a length Ray probed while that test's last request
    ran stays in its cache for RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S, and a replica that looks busy
    throughout gets none of the six (a full run once saw that)."""
    from ray.serve._private.constants import RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S
    time.sleep(RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S + 1)
    topics = ("volcanoes", "sonnets", "tax law", "orbital mechanics", "sourdough", "chess openings")
    seen = [cluster.chat([{"role": "user", "content": f"Tell me about {t}. " * 40}]).headers[REPLICA] for t in topics]
    assert len(set(seen)) == 2, seen
    assert cluster.replicas() == set(seen)


def test_the_openai_api_through_the_ingress(cluster):
    """Streaming SSE ends with [DONE]; /v1/models, /openapi.json, the 4xx bodies and
    /reset_prefix_cache come from the replicas' own app; the ingress's own refusals (405) have
    OpenAI's shape too; /metrics counts the router's decisions."""
    body = {"model": cluster.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}}
    with cluster.http.stream("POST", "/v1/chat/completions", json=body) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [line[5:].strip() for line in s.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]" and '"usage"' in events[-2]
    assert cluster.http.get("/v1/models").json()["data"][0]["id"] == cluster.model
    wrong = cluster.http.post("/v1/chat/completions", json={**body, "model": "nope"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    bad = cluster.http.post("/v1/chat/completions", json={"model": cluster.model, "messages": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("messages")
    assert "/v1/chat/completions" in cluster.http.get("/openapi.json").json()["paths"]   # the replicas' schema
    put = cluster.http.put("/v1/models")
    assert put.status_code == 405 and "message" in put.json()["error"]
    assert cluster.http.post("/reset_prefix_cache").json()["dropped_blocks"] >= 0
    assert "tercel_router_decisions_total{reason=" in cluster.http.get("/metrics").text


def test_a_client_that_leaves_mid_stream_aborts_its_engine_request(cluster):
    """Closing a stream after its first events cancels the replica's call; the replica's app sees the
    disconnect and aborts the engine request (counted as cancelled there), long before its 700 tokens."""
    body = {"model": cluster.model, "messages": [{"role": "user", "content": "Go on forever."}],
            "max_tokens": 700, "ignore_eos": True, "stream": True}
    replica = None
    with cluster.http.stream("POST", "/v1/chat/completions", json=body) as s:
        replica = s.headers[REPLICA]
        before = cluster.per_replica("tercel_request_errors_total", 'reason="cancelled"').get(replica, 0)
        for n, _ in enumerate(s.iter_lines()):
            if n == 6:
                break
    _wait("the engine request cancelled",
          lambda: cluster.per_replica("tercel_request_errors_total", 'reason="cancelled"').get(replica, 0) > before)
    _wait("the replica idle", lambda: cluster.per_replica("tercel_requests_running")[replica] == 0)


def _in_flight(cluster: Cluster, messages: list[dict], results: list, stream: bool) -> threading.Thread:
    """A long request in a thread; its status and body (or its SSE data lines) land in `results`."""
    body = {"model": cluster.model, "messages": messages, "max_tokens": 750, "ignore_eos": True, "stream": stream}

    def run():
        with httpx.Client(base_url=cluster.url, timeout=120) as http:
            if stream:
                with http.stream("POST", "/v1/chat/completions", json=body) as s:
                    results.append((s.status_code, [x[5:].strip() for x in s.iter_lines() if x.startswith("data:")]))
            else:
                r = http.post("/v1/chat/completions", json=body)
                results.append((r.status_code, r.json()))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _kill(replica: str) -> None:
    """Kill a Serve replica's actor, found by its id among the named actors of Serve's namespace."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and a["name"].endswith("#" + replica)]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


def _wait(what: str, ok, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_killed_replica_fails_its_requests_with_503_then_serves_again(cluster):
    """Requests running on a replica whose actor is killed get a 503 in OpenAI's shape (a stream that
    had begun ends with that error as its last event, without [DONE]); the next request succeeds on
    the other replica, and Ray Serve brings the replica count back to two."""
    messages = [{"role": "system", "content": SYSTEM + " (kill test)"}, {"role": "user", "content": "Count."}]
    first = cluster.chat(messages)
    victim = first.headers[REPLICA]
    plain, streamed = [], []
    threads = [_in_flight(cluster, messages, plain, stream=False), _in_flight(cluster, messages, plain, stream=False),
               _in_flight(cluster, messages, streamed, stream=True)]
    _wait("three running requests", lambda: plain or streamed
          or cluster.per_replica("tercel_requests_running").get(victim, 0) >= 3)
    assert not plain and not streamed, (plain, streamed)     # all three still running
    _kill(victim)
    for t in threads:
        t.join(timeout=120)
    assert [status for status, _ in plain] == [503, 503], plain
    for _, body in plain:
        assert body["error"]["code"] == "replica_unavailable" and body["error"]["type"] == "server_error"
    status, events = streamed[0]
    assert status == 200 and events[-1] != "[DONE]" and '"replica_unavailable"' in events[-1]
    after = cluster.chat(messages)
    assert after.status_code == 200 and after.headers[REPLICA] != victim
    _wait("a replacement replica", lambda: len(cluster.replicas() - {victim}) == 2)
    assert all(cluster.chat([{"role": "user", "content": f"after {i}"}]).status_code == 200 for i in range(4))


def test_the_serve_config_file_builds_the_application():
    """deploy/serve_config.yaml's args go through `tercel serve`'s own parser (serving/cluster/replicas.py:
    app_builder) into an application of N engine replicas with the prefix router; nothing starts."""
    import yaml

    from serving.cluster.replicas import app_builder
    config = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "serve_config.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "serving.cluster.replicas:app_builder"
    assert isinstance(app_builder(app["args"]), serve.Application)
    with pytest.raises(ValueError, match="--no-such-flag"):      # a typo is named, not ignored
        app_builder({"replicas": 2, "no_such_flag": 1})

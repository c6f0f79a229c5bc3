"""/metrics as a vLLM dashboard user expects it: KV usage, finished requests by reason,
preemptions, queue/prefill/decode time, length histograms, tokens per step, a `model_name`
label on every series; and every query of deploy/grafana-dashboard.json names a metric the
server exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_util import LiveServer
from spec.config import EngineConfig

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"


@pytest.fixture(scope="module")
def exposition(tiny_llama_dir) -> str:
    server = LiveServer(EngineConfig(model=str(tiny_llama_dir), drafter="ngram", num_kv_blocks=64, block_size=4),
                        model_name="tiny")
    try:
        for max_tokens in (3, 5):
            r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": max_tokens})
            assert r.status_code == 200
        server.wait_idle()
        text = httpx.get(f"{server.url}/metrics").text
    finally:
        server.close()
    return text


@pytest.fixture(scope="module")
def samples(exposition):
    return [s for f in text_string_to_metric_families(exposition) for s in f.samples]


def value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def test_the_series_a_vllm_dashboard_reads(samples):
    assert all(s.labels.get("model_name") == "tiny" for s in samples)
    assert value(samples, "tercel_request_success_total", finished_reason="length") == 2
    assert value(samples, "tercel_request_generation_tokens_sum") == 8
    assert value(samples, "tercel_request_prompt_tokens_count") == 2
    for name in ("tercel_request_queue_time_seconds_count", "tercel_request_prefill_time_seconds_count",
                 "tercel_request_decode_time_seconds_count"):
        assert value(samples, name) == 2, name
    assert value(samples, "tercel_iteration_tokens_count") >= 5       # at least a step per token
    assert value(samples, "tercel_kv_cache_usage_perc") == 0           # idle: nothing referenced
    assert value(samples, "tercel_preemptions_total") == 0
    assert value(samples, "tercel_memory_bytes", part="weights") > 0 and value(samples, "tercel_memory_bytes",
                                                                                part="kv_pool") > 0
    steps = [s for s in samples if s.name == "tercel_thread_steps_total"]     # every step, by its thread count
    assert steps and value(samples, "tercel_thread_steps_total") == value(samples, "tercel_iteration_tokens_count")
    assert all(value(samples, "tercel_thread_step_seconds_total", threads=s.labels["threads"]) > 0 for s in steps)


def test_every_dashboard_query_names_an_exported_metric(exposition):
    """A family is exported (its HELP and TYPE) before its first sample; a query may read it
    by its own name or a sample's (_total, _bucket, _sum, _count). Every family has a panel."""
    families = {f.name for f in text_string_to_metric_families(exposition) if not f.name.endswith("_created")}
    named = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\btercel_[a-z0-9_]+", target["expr"]):
                family = re.sub(r"_(bucket|sum|count|total)$", "", name)
                assert family in families, (panel["title"], name)
                named.add(family)
    assert families - named == set()


def test_the_batch_guards_choice_per_batch_size():
    """tercel_spec_batch_guard: 1 where speculation leads at that batch size, 0 where plain steps do."""
    from serving.metrics import Metrics
    from spec.stats import EngineStats
    m = Metrics("tiny")
    m.engine_state(EngineStats(batch_guard=((2, True), (4, False))))
    got = [s for f in text_string_to_metric_families(m.render().decode()) for s in f.samples
           if s.name == "tercel_spec_batch_guard"]
    assert {(s.labels["batch_size"], s.value) for s in got} == {("2", 1.0), ("4", 0.0)}

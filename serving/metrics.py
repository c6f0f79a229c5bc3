"""Prometheus metrics (tercel_*), on a registry of their own per server. Every series carries a
`model_name` label (the served name), as vLLM's do, so one dashboard can hold several models;
deploy/grafana-dashboard.json draws each of them (docs/serving.md, "Metrics")."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from spec.stats import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class Metrics:
    def __init__(self, model_name: str = ""):
        self.model_name = model_name    # set by the app when it knows the name it serves
        r = self.registry = CollectorRegistry()
        self.running = Gauge("tercel_requests_running", "requests holding KV blocks", registry=r)
        self.waiting = Gauge("tercel_requests_waiting", "requests queued for admission", registry=r)
        self.blocks_used = Gauge("tercel_kv_blocks_used", "KV blocks referenced by requests", registry=r)
        self.blocks_free = Gauge("tercel_kv_blocks_free", "KV blocks free or evictable", registry=r)
        self.kv_usage = Gauge("tercel_kv_cache_usage_perc", "fraction of the KV pool referenced by requests "
                              "(0 to 1, vLLM's name)", registry=r)
        self.preemptions = Counter("tercel_preemptions", "running requests sent back to the queue for want of "
                                   "KV blocks", registry=r)
        self.iteration_tokens = Histogram("tercel_iteration_tokens", "tokens per engine step (prompt chunks, "
                                          "decode tokens, tree nodes)", buckets=LENGTH_BUCKETS, registry=r)
        self.prefix_queries = Counter("tercel_prefix_cache_queries", "prompt tokens looked up", registry=r)
        self.prefix_hits = Counter("tercel_prefix_cache_hits", "prompt tokens served from the cache", registry=r)
        self.ttft = Histogram("tercel_ttft_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tercel_inter_token_latency_seconds", "time between streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tercel_e2e_latency_seconds", "request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("tercel_request_queue_time_seconds", "arrival to first admission",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("tercel_request_prefill_time_seconds", "admission to the first token",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("tercel_request_decode_time_seconds", "first token to the last",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_length = Histogram("tercel_request_prompt_tokens", "prompt tokens per finished request",
                                       buckets=LENGTH_BUCKETS, registry=r)
        self.generation_length = Histogram("tercel_request_generation_tokens", "output tokens per finished request",
                                           buckets=LENGTH_BUCKETS, registry=r)
        self.success = Counter("tercel_request_success", "finished requests by why they ended (stop, length, "
                               "abort)", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("tercel_prompt_tokens", "prompt tokens", registry=r)
        self.generated_tokens = Counter("tercel_generated_tokens", "generated tokens", registry=r)
        self.verify_steps = Counter("tercel_spec_verify_steps", "speculative verify steps", registry=r)
        self.draft_tokens = Counter("tercel_spec_draft_tokens", "draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("tercel_spec_accepted_tokens", "draft tokens accepted", registry=r)
        self.accepted_per_position = Counter("tercel_spec_accepted_per_position", "accepted draft tokens by depth",
                                             ["position"], registry=r)
        self.mean_accepted = Gauge("tercel_spec_mean_accepted_length",
                                   "tokens per verify step over the last finished requests", registry=r)
        self.spec_enabled = Gauge("tercel_spec_enabled", "1 while the engine speculates", registry=r)
        self.spec_draft_budget = Gauge("tercel_spec_draft_budget",
                                       "draft tokens each request may propose per step (0 while off)", registry=r)
        self.spec_batch_guard = Gauge("tercel_spec_batch_guard", "per batch size the batch guard decided for: 1 while "
                                      "speculation's steps cost less per token there, 0 while plain ones do",
                                      ["batch_size"], registry=r)
        self.threads = Gauge("tercel_threads", "CPU threads the engine's steps run on", registry=r)
        self.thread_switches = Counter("tercel_thread_switches", "thread count changes by the governor",
                                       registry=r)
        self.thread_steps = Counter("tercel_thread_steps", "engine steps by the CPU threads they ran on",
                                    ["threads"], registry=r)
        self.thread_step_seconds = Counter("tercel_thread_step_seconds", "engine step wall time by the CPU "
                                           "threads it ran on", ["threads"], registry=r)
        self.memory = Gauge("tercel_memory_bytes", "bytes the engine holds by part, measured at load (weights, "
                            "tables: embedding and head, other, kv_pool: reserved, resident: the process)",
                            ["part"], registry=r)
        self.lora_info = Gauge("tercel_lora_requests_info", "1 for the LoRA adapters running and waiting requests "
                               "run under now (vLLM's lora_requests_info)",
                               ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self.lora_changes = Counter("tercel_lora_adapter_changes", "LoRA adapters loaded and unloaded at runtime",
                                    ["change"], registry=r)
        self.errors = Counter("tercel_request_errors", "failed requests", ["reason"], registry=r)
        self.drafter_errors = Counter("tercel_drafter_errors", "drafter exceptions (the requests decoded plainly)",
                                      registry=r)
        self._recent: list[tuple[int, int]] = []   # (emitted, verify steps) of recent finished requests
        # The snapshot counted so far: counters grow by the difference to the next one.
        self._seen = EngineStats()

    def render(self) -> bytes:
        if not self.model_name:
            return generate_latest(self.registry)
        return _labelled(self.registry.collect(), {"model_name": self.model_name})

    def engine_state(self, s: EngineStats) -> None:
        """Gauges and counters from the engine's snapshot after a step (engine thread)."""
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.blocks_used.set(s.kv_blocks_used)
        self.blocks_free.set(s.kv_blocks_free)
        self.kv_usage.set(s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        self.preemptions.inc(s.preemptions - self._seen.preemptions)
        if s.steps > self._seen.steps:
            self.iteration_tokens.observe(s.last_step_tokens)
        self.prefix_queries.inc(s.prefix_cache_queries - self._seen.prefix_cache_queries)
        self.prefix_hits.inc(s.prefix_cache_hits - self._seen.prefix_cache_hits)
        self.drafter_errors.inc(s.drafter_errors - self._seen.drafter_errors)
        self.thread_switches.inc(s.thread_switches - self._seen.thread_switches)
        self.threads.set(s.threads)
        self._thread_steps(s)
        self._seen = s
        for part, n in s.memory:
            self.memory.labels(part=part).set(n)
        self.spec_enabled.set(1 if s.speculating else 0)
        self.spec_draft_budget.set(s.draft_budget)
        for size, leads in s.batch_guard:
            self.spec_batch_guard.labels(batch_size=str(size)).set(1 if leads else 0)
        if s.max_loras:
            self.lora_info.clear()
            self.lora_info.labels(max_lora=str(s.max_loras), running_lora_adapters=",".join(s.lora_running),
                                  waiting_lora_adapters=",".join(s.lora_waiting)).set(1)

    def _thread_steps(self, s: EngineStats) -> None:
        seen = {t.threads: t for t in self._seen.thread_steps}
        for t in s.thread_steps:
            before = seen.get(t.threads)
            if before is None or t.steps > before.steps:
                label = str(t.threads)
                self.thread_steps.labels(threads=label).inc(t.steps - (before.steps if before else 0))
                self.thread_step_seconds.labels(threads=label).inc(t.seconds - (before.seconds if before else 0.0))

    def finished(self, out, num_prompt_tokens: int) -> None:
        st = out.stats
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generated_tokens.inc(len(out.token_ids))
        self.prompt_length.observe(num_prompt_tokens)
        self.generation_length.observe(len(out.token_ids))
        if out.finish_reason in ("stop", "length", "abort"):
            self.success.labels(finished_reason=out.finish_reason).inc()
        if out.total_time is not None:
            self.e2e.observe(out.total_time)
        self._phases(out)
        self.verify_steps.inc(st.verify_steps)
        self.draft_tokens.inc(st.draft_tokens)
        self.accepted_tokens.inc(st.accepted_tokens)
        for depth, n in enumerate(st.accepted_per_depth, start=1):
            if n:
                self.accepted_per_position.labels(position=str(depth)).inc(n)
        if st.verify_steps:
            self._recent = (self._recent + [(st.emitted_tokens, st.verify_steps)])[-64:]
            self.mean_accepted.set(sum(e for e, _ in self._recent) / sum(v for _, v in self._recent))


    def _phases(self, out) -> None:
        """Queue, prefill and decode time of a finished request (a request aborted in the queue has none)."""
        if out.queue_time is None:
            return
        self.queue_time.observe(out.queue_time)
        if out.ttft is not None:
            self.prefill_time.observe(max(0.0, out.ttft - out.queue_time))
            if out.total_time is not None:
                self.decode_time.observe(max(0.0, out.total_time - out.ttft))


def _labelled(families, labels: dict[str, str]) -> bytes:
    """An exposition of `families` with `labels` added to every sample."""
    return _exposition(_relabel(f, labels) for f in families)


def _relabel(fam, labels: dict[str, str]) -> Metric:
    copy = Metric(fam.name, fam.documentation, fam.type, fam.unit)
    copy.samples = [s._replace(labels={**s.labels, **labels}) for s in fam.samples]
    return copy


def _exposition(families) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families)))
    return generate_latest(registry)


def merge_replica_metrics(texts: dict[str, str]) -> bytes:
    """Several replicas' /metrics (replica id -> Prometheus text) as one exposition, each series
    with a `replica` label: per replica as scraped, and summed with `sum without (replica)`."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
            merged.samples += _relabel(fam, {"replica": replica}).samples
    return _exposition(families.values())


class _Fixed:
    """A collector that yields metric families already built (prometheus_client's interface)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families

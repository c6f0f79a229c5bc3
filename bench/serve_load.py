"""Load generator behind `tercel bench serve`: streamed chat requests against a running
OpenAI-compatible server, at fixed concurrency levels, with speculation on and off.

For each concurrency c and each mode (interleaved: c1/on, c1/off, c4/on, ...), a pool of c
workers sends `requests` streaming `/v1/chat/completions` requests, so exactly c are in
flight until the last ones drain. All times are taken on the client (`time.perf_counter`),
so they include HTTP, SSE framing and detokenization:

- TTFT: request sent -> first chunk with non-empty `delta.content` (the role chunk, sent
  before any token is generated, does not count).
- ITL (inter-chunk latency): the gaps between consecutive content-bearing chunks of one
  request, pooled over all requests of the level. With speculation one chunk may carry
  several tokens, so this is the latency a user sees between screen updates, not per token.
- TPOT: per request, (last content time - first content time) / (completion_tokens - 1),
  for requests with at least 2 tokens; the per-token cost after the first chunk.
- E2E: request sent -> `data: [DONE]`.
- throughput: completion tokens of the successful requests / the level's wall time.
- mean_accepted_length: the `tercel.mean_accepted_length` of the usage chunk (tokens
  emitted per verify step), averaged over requests; None when no request verified drafts.
- repeats: each level runs this many rounds of every mode, in reverse mode order in odd
  rounds; a mode's records and wall times are pooled over its rounds (throughput = all its
  tokens / all its wall time), and `round_throughput_tok_s` lists the rounds.
- cold_cache: the server's prefix cache was dropped before every round (`POST
  /reset_prefix_cache`, Tercel and vLLM). Without it the second mode of a level would find
  the first mode's prompts cached and skip their prefill: its TTFT came out far below the
  first mode's on the same prompts (figures: docs/performance.md, "Serving TTFT").

- conversations: a prompt with several user turns (a `BenchPrompt`, e.g. `--dataset multiturn`)
  is sent turn by turn by one worker, each turn after the previous reply ended and with that reply,
  the model's own, as the assistant message; every turn is one request record. Such a workload
  shows what prefix-affinity routing across replicas gains (serving/cluster/prefix_router.py).
- prefix_hit_rate: prompt tokens the server's prefix cache served / prompt tokens looked up during
  the level (`tercel_prefix_cache_hits_total` and `_queries_total` from /metrics, summed over every
  series, so over the replicas of a Ray deployment); None when the server has no such counters.

A request with a non-200 status, an error event, or a stream that breaks or ends without
`[DONE]` and usage counts as an error; it is never raised.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.plots import pyplot, save_figure

log = logging.getLogger("tercel.bench")

SPECULATION = {"on": "auto", "off": "off"}   # mode -> the request's "speculation" field
MAX_ERROR_EXAMPLES = 3


@dataclass(frozen=True)
class LoadConfig:
    url: str                                   # server root, e.g. http://127.0.0.1:8000 (no /v1)
    concurrency: tuple[int, ...] = (1, 4, 16)  # requests in flight, one level each
    max_tokens: int = 128
    temperature: float = 0.0
    modes: tuple[str, ...] = ("on", "off")     # speculation on ("auto") / off ("off")
    requests_per_level: int | None = None      # None: max(len(prompts), 2 * concurrency)
    api_key: str | None = None
    model: str | None = None                   # None: the first id from /v1/models
    timeout: float = 600.0                     # seconds, per request
    warmup: int = 1                            # unmeasured requests per mode before the first level
    repeats: int = 1                           # rounds per level; odd rounds run the modes in reverse

    def __post_init__(self):
        object.__setattr__(self, "concurrency", tuple(self.concurrency))   # accept lists from a CLI
        object.__setattr__(self, "modes", tuple(self.modes))
        if not self.concurrency or not all(_is_int(c) and c >= 1 for c in self.concurrency):
            raise ValueError(f"concurrency must be a non-empty list of integers >= 1, got {self.concurrency!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.modes or not set(self.modes) <= set(SPECULATION):
            raise ValueError(f"modes must be a non-empty subset of {sorted(SPECULATION)}, got {self.modes!r}")
        if self.requests_per_level is not None and (not _is_int(self.requests_per_level)
                                                    or self.requests_per_level < 1):
            raise ValueError(f"requests_per_level must be an integer >= 1 or None, got {self.requests_per_level!r}")
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout!r}")
        if not _is_int(self.warmup) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if not _is_int(self.repeats) or self.repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {self.repeats!r}")

    def requests_for(self, concurrency: int, num_prompts: int) -> int:
        return self.requests_per_level or max(num_prompts, 2 * concurrency)

    @property
    def root(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def level_key(mode: str, concurrency: int) -> str:
    return f"serve/{mode}/c{concurrency}"


class ServerUnreachable(ValueError):
    """No usable server at the URL: refused, unhealthy, wrong key or not OpenAI-shaped."""


# ---- server check -------------------------------------------------------------------------
def launch_server(args: list[str], port: int, cwd: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`tercel serve --port port *args` in a process of its own, once its /health answers 200
    (at most 10 minutes); the process and its URL."""
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--port", str(port), *args]
    proc, url = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL), f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not start in 10 minutes: {' '.join(cmd)}")


def check_server(url: str, api_key: str | None = None, timeout: float = 5.0) -> list[str]:
    """Model ids served; ServerUnreachable naming the URL and the reason otherwise."""
    root = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=root, headers=headers, timeout=timeout) as client:
            health = client.get("/health")
            if health.status_code != 200:
                raise ServerUnreachable(f"{root}/health answered {health.status_code}: {health.text[:200]}")
            return _model_ids(root, client.get("/v1/models"))
    except httpx.ConnectError as e:
        raise ServerUnreachable(f"cannot connect to {root} (connection refused?): {e}") from None
    except httpx.TimeoutException:
        raise ServerUnreachable(f"{root} did not answer within {timeout}s") from None
    except httpx.HTTPError as e:
        raise ServerUnreachable(f"{root}: {type(e).__name__}: {e}") from None


def _model_ids(root: str, resp: httpx.Response) -> list[str]:
    if resp.status_code == 401:
        raise ServerUnreachable(f"{root}/v1/models refused the API key (401); pass the server's key")
    if resp.status_code != 200:
        raise ServerUnreachable(f"{root}/v1/models answered {resp.status_code}: {resp.text[:200]}")
    try:
        return [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ServerUnreachable(f"{root}/v1/models is not an OpenAI model list ({e!r}): {resp.text[:200]}") from None


# ---- one request --------------------------------------------------------------------------
class _StreamError(Exception):
    """The stream broke or said something a chat completion stream must not."""


@dataclass
class RequestRecord:
    """One streamed request as the client saw it; times are perf_counter seconds."""
    start: float
    end: float = 0.0
    content_times: list[float] = field(default_factory=list)   # arrival of each content-bearing chunk
    completion_tokens: int | None = None                       # from the usage chunk
    accepted_length: float | None = None                       # tercel.mean_accepted_length
    done: bool = False                                         # saw data: [DONE]
    text: str = ""                                             # the reply: the next turn's assistant message
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.content_times[0] - self.start if self.content_times else None

    @property
    def gaps(self) -> list[float]:
        t = self.content_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        n = self.completion_tokens or 0
        if n < 2 or not self.content_times:
            return None
        return (self.content_times[-1] - self.content_times[0]) / (n - 1)

    @property
    def e2e(self) -> float:
        return self.end - self.start


def request_body(cfg: LoadConfig, model: str, messages: list[dict], mode: str) -> dict:
    return {"model": model, "messages": messages, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "speculation": SPECULATION[mode]}


@dataclass(frozen=True)
class Conversation:
    """A multi-turn chat for one worker: `first` is turn one's body; each of `later_turns` (user
    messages) follows once the previous reply has ended, with that reply appended."""
    first: dict
    later_turns: tuple[str, ...]

    def next_user(self, turn: int, reply: str) -> str | None:
        """The user message after reply number `turn` (from 0), None when the chat has ended."""
        return self.later_turns[turn] if turn < len(self.later_turns) else None


def next_body(body: dict, answer: str, user: str) -> dict:
    """`body` carried on: the reply appended as the assistant's turn, then the next user message."""
    return {**body, "messages": [*body["messages"], {"role": "assistant", "content": answer},
                                 {"role": "user", "content": user}]}


def request_item(cfg: LoadConfig, model: str, prompt, mode: str):
    """One unit of work: a body for a list of messages, a Conversation for a multi-turn BenchPrompt,
    a session for an agent session (bench/agent_workload.py: it says what follows each reply)."""
    if isinstance(prompt, list):
        return request_body(cfg, model, prompt, mode)
    first = request_body(cfg, model, prompt.messages(), mode)
    if hasattr(prompt, "follow_up"):
        return prompt.follow_up(first)
    return Conversation(first, prompt.turns[1:]) if len(prompt.turns) > 1 else first


async def run_item(client: httpx.AsyncClient, item) -> list[RequestRecord]:
    """A body's one request, or a multi-turn item's (anything with `first` and `next_user`) turns in order."""
    if isinstance(item, dict):
        return [await stream_request(client, item)]
    records, body = [await stream_request(client, item.first)], item.first
    # the conversation cannot go on without its reply
    while records[-1].ok and (user := item.next_user(len(records) - 1, records[-1].text)) is not None:
        body = next_body(body, records[-1].text, user)
        records.append(await stream_request(client, body))
    return records


async def stream_request(client: httpx.AsyncClient, body: dict) -> RequestRecord:
    """Send one streaming chat request on `client` (its base_url is the server root)."""
    rec = RequestRecord(start=time.perf_counter())
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec.error = _http_error(resp)
            else:
                await _read_events(resp, rec)
    except httpx.HTTPError as e:
        rec.error = _short(f"{type(e).__name__}: {e}")
    except _StreamError as e:
        rec.error = _short(str(e))
    rec.end = time.perf_counter()
    return rec


async def _read_events(resp: httpx.Response, rec: RequestRecord) -> None:
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):      # blank separators, ": ping" comments
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            rec.done = True
            break
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise _StreamError(f"stream: bad JSON in event: {data[:80]}") from None
        _on_chunk(rec, chunk, time.perf_counter())
    if not rec.done:
        raise _StreamError("stream: ended before data: [DONE]")
    if rec.completion_tokens is None:
        raise _StreamError("stream: no usage chunk")


def _on_chunk(rec: RequestRecord, chunk, now: float) -> None:
    if not isinstance(chunk, dict) or not isinstance(chunk.get("choices", []), list):
        raise _StreamError(f"stream: not a chat.completion.chunk: {str(chunk)[:80]}")
    if "error" in chunk:
        err = chunk["error"]
        raise _StreamError(f"stream error: {err.get('message') if isinstance(err, dict) else err}")
    content = "".join(_content(c) for c in chunk.get("choices", []))
    if content:
        rec.content_times.append(now)
        rec.text += content
    usage, tercel = chunk.get("usage"), chunk.get("tercel")
    if isinstance(usage, dict) and _is_int(usage.get("completion_tokens")):
        rec.completion_tokens = usage["completion_tokens"]
    if isinstance(tercel, dict) and isinstance(tercel.get("mean_accepted_length"), (int, float)):
        rec.accepted_length = float(tercel["mean_accepted_length"])


def _content(choice) -> str:
    delta = choice.get("delta") if isinstance(choice, dict) else None
    content = delta.get("content") if isinstance(delta, dict) else None
    return content if isinstance(content, str) else ""


def _http_error(resp: httpx.Response) -> str:
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text
    return _short(f"{resp.status_code}: {message}")


def _short(s: str, n: int = 160) -> str:
    return s if len(s) <= n else s[:n - 3] + "..."


# ---- levels -------------------------------------------------------------------------------
def run_serve_bench(cfg: LoadConfig, prompts: list, done: Container[str] = (),
                    on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Measure every (concurrency, mode) level not in `done`, in order c1/on, c1/off, c4/on, ...
    `prompts` (each a list of {"role", "content"} messages, a BenchPrompt or an agent session:
    whatever `request_item` takes) are cycled in order. on_result gets each level's result as it
    completes; the measured results are returned."""
    if not prompts:
        raise ValueError("run_serve_bench needs at least one prompt")
    levels = [(c, m) for c in cfg.concurrency for m in cfg.modes if level_key(m, c) not in done]
    if not levels:
        return []
    model = _model(cfg)
    return asyncio.run(_run_levels(cfg, model, prompts, levels, on_result))


def _model(cfg: LoadConfig) -> str:
    """cfg.model, or the server's first; checking the server first either way fails fast."""
    ids = check_server(cfg.url, cfg.api_key)
    if cfg.model is None and not ids:
        raise ServerUnreachable(f"{cfg.root}/v1/models lists no model; pass one with --model")
    return cfg.model or ids[0]


async def _run_levels(cfg, model, prompts, levels, on_result) -> list[dict]:
    """Per concurrency, `cfg.repeats` rounds of every pending mode, the order reversed in odd
    rounds (whichever mode runs second finds the machine warmer); each mode's records and
    wall times are pooled over its rounds."""
    results = []
    await _warm_up(cfg, model, prompts[0], sorted({m for _, m in levels}))
    cold = True
    for c in dict.fromkeys(c for c, _ in levels):
        modes = [m for cc, m in levels if cc == c]
        n = cfg.requests_for(c, len(prompts))
        records = {m: [] for m in modes}
        rounds: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}   # (wall, tok/s)
        prefix = {m: [0.0, 0.0] for m in modes}        # (hits, queries) in prompt tokens
        for r in range(cfg.repeats):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                if cold and not (cold := await reset_prefix_cache(cfg)):
                    log.warning("%s has no POST /reset_prefix_cache: levels after the first may find "
                                "their prompts in the prefix cache", cfg.root)
                bodies = [request_item(cfg, model, prompts[i % len(prompts)], mode) for i in range(n)]
                before = await prefix_counters(cfg)
                recs, wall = await run_level(cfg, bodies, c)
                prefix[mode] = [t + a - b for t, a, b in zip(prefix[mode], await prefix_counters(cfg), before)]
                records[mode] += recs
                rounds[mode].append((wall, sum(x.completion_tokens for x in recs if x.ok) / wall))
        for mode in modes:
            walls, tps = zip(*rounds[mode])
            hits, queries = prefix[mode]
            results.append({**level_result(mode, c, records[mode], sum(walls)), "cold_cache": cold,
                            "prefix_hit_rate": round(hits / queries, 4) if queries else None,
                            "round_throughput_tok_s": [round(t, 3) for t in tps]})
            if on_result is not None:
                on_result(results[-1])
    return results


async def reset_prefix_cache(cfg: LoadConfig) -> bool:
    """Ask the server to drop its prefix cache; False when it cannot (no such endpoint)."""
    async with httpx.AsyncClient(base_url=cfg.root, headers=cfg.headers, timeout=30.0) as client:
        try:
            return (await client.post("/reset_prefix_cache")).status_code == 200
        except httpx.HTTPError:
            return False


async def prefix_counters(cfg: LoadConfig) -> tuple[float, float]:
    """(prefix-cache hits, queries) in prompt tokens, summed over every series of /metrics."""
    totals = {"tercel_prefix_cache_hits_total": 0.0, "tercel_prefix_cache_queries_total": 0.0}
    async with httpx.AsyncClient(base_url=cfg.root, headers=cfg.headers, timeout=30.0) as client:
        try:
            text = (await client.get("/metrics")).text
        except httpx.HTTPError:
            return 0.0, 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["tercel_prefix_cache_hits_total"], totals["tercel_prefix_cache_queries_total"]


async def _warm_up(cfg: LoadConfig, model: str, messages: list[dict], modes: list[str]) -> None:
    """Unmeasured requests, so one-off costs (kernel compiles, caches) stay out of level one."""
    if cfg.warmup:
        bodies = [request_item(cfg, model, messages, m) for m in modes for _ in range(cfg.warmup)]
        await run_level(cfg, bodies, 1)


async def run_level(cfg: LoadConfig, bodies: list[dict | Conversation],
                    concurrency: int) -> tuple[list[RequestRecord], float]:
    """Send `bodies` with `concurrency` workers (each sends its next body, or conversation, when
    the last ends).
    Returns the records in completion order and the wall time in seconds."""
    records: list[RequestRecord] = []
    pending = iter(bodies)            # shared by the workers; next() never yields to the loop
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 30.0))
    async with httpx.AsyncClient(base_url=cfg.root, headers=cfg.headers, limits=limits, timeout=timeout) as client:
        async def worker():
            for body in pending:
                records.extend(await run_item(client, body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
        return records, time.perf_counter() - start


def level_result(mode: str, concurrency: int, records: list[RequestRecord], wall: float) -> dict:
    ok = [r for r in records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    accepted = [r.accepted_length for r in ok if r.accepted_length is not None]
    return {
        "key": level_key(mode, concurrency), "mode": mode, "concurrency": concurrency,
        "requests": len(records), "errors": len(records) - len(ok),
        "error_examples": list(dict.fromkeys(r.error for r in records if not r.ok))[:MAX_ERROR_EXAMPLES],
        "duration_s": round(wall, 4), "output_tokens": tokens,
        "throughput_tok_s": round(tokens / wall, 3) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "ttft_ms": summarize_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": summarize_ms([g for r in ok for g in r.gaps]),
        "tpot_ms": summarize_ms([r.tpot for r in ok if r.tpot is not None]),
        "e2e_ms": summarize_ms([r.e2e for r in ok]),
        "mean_accepted_length": round(float(np.mean(accepted)), 3) if accepted else None,
    }


def percentiles(values, qs=(50, 90, 99)) -> dict:
    """{"p50": ..., ...} by linear interpolation; None for each when values is empty."""
    if len(values) == 0:
        return {f"p{q:g}": None for q in qs}
    return {f"p{q:g}": float(v) for q, v in zip(qs, np.percentile(np.asarray(values, dtype=float), qs))}


def summarize_ms(seconds: list[float]) -> dict:
    """p50/p90/p99/mean of durations given in seconds, reported in milliseconds."""
    ms = [s * 1e3 for s in seconds]
    out = {**percentiles(ms), "mean": float(np.mean(ms)) if ms else None}
    return {k: None if v is None else round(v, 3) for k, v in out.items()}


# ---- reporting ----------------------------------------------------------------------------
def markdown_table(results: list[dict]) -> str:
    """One row per level; the last column is throughput(on) / throughput(off) at the same
    concurrency, on the "on" row, when both modes were measured."""
    tput = {(r["mode"], r["concurrency"]): r["throughput_tok_s"] for r in results}
    head = ["mode", "concurrency", "requests", "errors", "throughput tok/s", "TTFT p50/p90/p99 ms",
            "ITL p50/p90/p99 ms", "prefix-hit rate", "speculation on/off throughput"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(results, key=lambda r: (r["concurrency"], r["mode"] != "on")):
        on, off = tput.get(("on", r["concurrency"])), tput.get(("off", r["concurrency"]))
        ratio = f"{on / off:.2f}x" if r["mode"] == "on" and on is not None and off else ""
        cells = [r["mode"], r["concurrency"], r["requests"], r["errors"], _fmt(r["throughput_tok_s"]),
                 _pcts(r["ttft_ms"]), _pcts(r["itl_ms"]), _rate(r.get("prefix_hit_rate")), ratio]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _rate(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _pcts(d: dict) -> str:
    return " / ".join(_fmt(d.get(k)) for k in ("p50", "p90", "p99"))


def plot_latency(results: list[dict], out_dir: Path) -> list[Path]:
    """serve_latency.png (TTFT and ITL percentiles against concurrency, a line style per
    mode) and serve_throughput.png (tok/s against concurrency per mode). Returns the paths."""
    plt = pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "inter-chunk latency")):
        for mode, style in _mode_styles(results):
            for pct, color in (("p50", "C0"), ("p90", "C1"), ("p99", "C3")):
                xs, ys = _series(results, mode, lambda r: r[metric][pct])
                ax.plot(xs, ys, style, color=color, marker="o", label=f"{mode} {pct}")
        _axes(ax, f"{title} (ms)", results)
    latency = save_figure(fig, out_dir / "serve_latency.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, style in _mode_styles(results):
        xs, ys = _series(results, mode, lambda r: r["throughput_tok_s"])
        ax.plot(xs, ys, style, marker="o", label=f"speculation {mode}")
    _axes(ax, "throughput (output tok/s)", results)
    return [latency, save_figure(fig, out_dir / "serve_throughput.png")]


def _mode_styles(results: list[dict]) -> list[tuple[str, str]]:
    modes = sorted({r["mode"] for r in results}, key=lambda m: m != "on")
    return [(m, "-" if m == "on" else "--") for m in modes]


def _series(results: list[dict], mode: str, get) -> tuple[list[int], list[float]]:
    rows = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["concurrency"])
    return [r["concurrency"] for r in rows], [np.nan if get(r) is None else get(r) for r in rows]


def _axes(ax, ylabel: str, results: list[dict]) -> None:
    levels = sorted({r["concurrency"] for r in results})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)

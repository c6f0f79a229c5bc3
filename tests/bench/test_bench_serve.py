"""`tercel bench serve`'s load generator (bench/serve_load.py) against a live tiny server on
loopback, plus its pure parts: percentiles, config checks, stream parsing, table and plots."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from bench.serve_load import (LoadConfig, ServerUnreachable, check_server, markdown_table, percentiles,
                              plot_latency, request_body, run_serve_bench, stream_request)
from server_util import LiveServer, free_port
from spec.config import EngineConfig

ENGINE = dict(drafter="ngram", max_model_len=256, num_kv_blocks=128, max_num_seqs=16)
PROMPTS = [[{"role": "user", "content": "Count from one to ten."}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
           [{"role": "user", "content": "Repeat: the cat sat on the mat, the cat sat on the mat."}]]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = LiveServer(EngineConfig(model=str(tiny_llama_dir), **ENGINE), model_name="tiny")
    yield s
    s.close()


@pytest.fixture(scope="module")
def results(server):
    """Both modes at concurrency 1 and 2, 4 requests each, measured once for several tests."""
    cfg = LoadConfig(url=server.url, concurrency=(1, 2), max_tokens=8, requests_per_level=4)
    return run_serve_bench(cfg, PROMPTS)


def test_levels_measured_in_order_without_errors(server, results):
    """Four levels, c-major and mode-minor; every request succeeds within max_tokens; percentiles
    are ordered; the KV pool is whole once the bench ends."""
    assert [r["key"] for r in results] == ["serve/on/c1", "serve/off/c1", "serve/on/c2", "serve/off/c2"]
    for r in results:
        assert r["requests"] == 4 and r["errors"] == 0 and r["error_examples"] == []
        assert r["cold_cache"]             # the server's prefix cache was dropped before each level
        assert 0 < r["output_tokens"] <= r["requests"] * 8
        assert r["throughput_tok_s"] > 0 and r["duration_s"] > 0 and r["requests_per_s"] > 0
        for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            p = r[metric]
            if p["p50"] is not None:
                assert p["p50"] <= p["p90"] <= p["p99"]
        assert r["ttft_ms"]["p50"] is not None and r["e2e_ms"]["p50"] >= r["ttft_ms"]["p50"]
    assert all(r["mean_accepted_length"] is None for r in results if r["mode"] == "off")
    server.wait_idle()
    assert server.engine.blocks.num_used_blocks == 0


def test_done_levels_are_skipped_and_each_level_reported(server):
    """Keys in `done` are not measured; on_result sees each measured level once, as it ends."""
    seen = []
    cfg = LoadConfig(url=server.url, concurrency=(1, 2), max_tokens=4, requests_per_level=2, warmup=0)
    out = run_serve_bench(cfg, PROMPTS, done={"serve/on/c1", "serve/off/c2"}, on_result=seen.append)
    assert [r["key"] for r in out] == ["serve/off/c1", "serve/on/c2"] and seen == out
    everything = {"serve/on/c1", "serve/off/c1", "serve/on/c2", "serve/off/c2"}
    assert run_serve_bench(cfg, PROMPTS, done=everything, on_result=seen.append) == [] and len(seen) == 2


def test_check_server(server):
    """The served ids come back; a port nobody listens on raises ServerUnreachable naming the URL."""
    assert check_server(server.url) == ["tiny"] and check_server(server.url + "/v1/") == ["tiny"]
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnreachable, match=url):
        check_server(url, timeout=2.0)
    with pytest.raises(ServerUnreachable, match=url):
        run_serve_bench(LoadConfig(url=url, concurrency=(1,), modes=("off",)), PROMPTS)


def test_api_key(tiny_llama_dir):
    """Against a keyed server, a missing or wrong key is a 401 ServerUnreachable; the right one works."""
    keyed = LiveServer(EngineConfig(model=str(tiny_llama_dir), **ENGINE), model_name="tiny", api_key="sekrit")
    try:
        for key in (None, "wrong"):
            with pytest.raises(ServerUnreachable, match="401"):
                check_server(keyed.url, api_key=key)
        cfg = LoadConfig(url=keyed.url, api_key="sekrit", concurrency=(2,), modes=("on",), max_tokens=4,
                         requests_per_level=2, warmup=0)
        (r,) = run_serve_bench(cfg, PROMPTS)
        assert r["errors"] == 0 and r["output_tokens"] > 0
    finally:
        keyed.close()


def test_errors_are_counted_not_raised(server):
    """An unknown model gives one 404 per request, counted, with one de-duplicated example."""
    cfg = LoadConfig(url=server.url, concurrency=(2,), modes=("off",), max_tokens=4, requests_per_level=3,
                     model="no-such-model")
    (r,) = run_serve_bench(cfg, PROMPTS)
    assert r["errors"] == r["requests"] == 3 and r["output_tokens"] == 0
    assert len(r["error_examples"]) == 1 and r["error_examples"][0].startswith("404:")
    assert "no-such-model" in r["error_examples"][0]
    assert r["ttft_ms"] == {"p50": None, "p90": None, "p99": None, "mean": None}
    server.wait_idle()


def _fake_stream(lines: list[str], status: int = 200):
    """An AsyncClient whose chat endpoint answers `lines` as an SSE body."""
    def handler(request):
        return httpx.Response(status, content="\n\n".join(lines).encode(),
                              headers={"content-type": "text/event-stream"})
    return httpx.AsyncClient(base_url="http://fake", transport=httpx.MockTransport(handler))


def _record(lines, status=200):
    async def go():
        async with _fake_stream(lines, status) as client:
            return await stream_request(client, {"model": "m"})
    return asyncio.run(go())


def test_stream_parsing_without_a_server():
    """Content chunks are timed (the role chunk is not), usage and the tercel extension are read;
    a missing [DONE], an error event or bad JSON make the request an error."""
    role = 'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}'
    text = 'data: {"choices": [{"index": 0, "delta": {"content": "ab"}}]}'
    finish = 'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}'
    usage = ('data: {"choices": [], "usage": {"completion_tokens": 3}, '
             '"tercel": {"mean_accepted_length": 2.5}}')
    rec = _record([role, ": ping", text, text, finish, usage, "data: [DONE]"])
    assert rec.ok and len(rec.content_times) == 2 and rec.completion_tokens == 3
    assert rec.accepted_length == 2.5 and len(rec.gaps) == 1 and rec.tpot is not None and rec.tpot >= 0
    assert "[DONE]" in _record([role, text, finish, usage]).error
    assert "boom" in _record([role, 'data: {"error": {"message": "boom"}}']).error
    assert "bad JSON" in _record([role, "data: {nope", "data: [DONE]"]).error
    assert _record(['{"error": {"message": "queue full"}}'], status=429).error == "429: queue full"


def test_table_and_plots(results, tmp_path):
    """The table has a row per level and the on/off ratio; both PNGs load as images."""
    import matplotlib.image

    table = markdown_table(results)
    assert table.count("\n") == 2 + len(results) and "| on |" in table and "| off |" in table
    assert table.count("x |") == 2          # one on/off ratio per concurrency
    paths = plot_latency(results, tmp_path / "plots")
    assert [p.name for p in paths] == ["serve_latency.png", "serve_throughput.png"]
    for p in paths:
        assert matplotlib.image.imread(p).size > 0


def test_percentiles_and_config_checks():
    """Linear interpolation, None for no data; bad configs are refused naming the field."""
    assert percentiles([1, 2, 3, 4])["p50"] == 2.5 and percentiles([1, 2, 3, 4], qs=(0, 100)) == {"p0": 1, "p100": 4}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    for bad, field in ((dict(concurrency=(0,)), "concurrency"), (dict(concurrency=()), "concurrency"),
                       (dict(modes=("maybe",)), "modes"), (dict(modes=()), "modes"),
                       (dict(max_tokens=0), "max_tokens"), (dict(requests_per_level=0), "requests_per_level"),
                       (dict(repeats=0), "repeats")):
        with pytest.raises(ValueError, match=field):
            LoadConfig(url="http://x", **bad)
    cfg = LoadConfig(url="http://x:1/v1/", concurrency=[2, 8])
    assert cfg.concurrency == (2, 8) and cfg.root == "http://x:1" and cfg.requests_for(8, 3) == 16
    assert request_body(cfg, "m", PROMPTS[0], "off")["speculation"] == "off"
    assert request_body(cfg, "m", PROMPTS[0], "on")["speculation"] == "auto"


def test_repeats_alternate_the_mode_order_and_pool_the_rounds(server, monkeypatch):
    """Odd rounds run the modes in reverse, so neither mode always goes second (warmer)."""
    import bench.serve_load as serve_load
    order, real = [], serve_load.run_level

    async def spy(cfg, bodies, concurrency):
        order.append(bodies[0]["speculation"])
        return await real(cfg, bodies, concurrency)

    monkeypatch.setattr(serve_load, "run_level", spy)
    cfg = LoadConfig(url=server.url, concurrency=(1,), max_tokens=4, requests_per_level=2, warmup=0, repeats=3)
    out = run_serve_bench(cfg, PROMPTS)
    assert order == ["auto", "off", "off", "auto", "auto", "off"]
    assert [r["key"] for r in out] == ["serve/on/c1", "serve/off/c1"]
    for r in out:
        assert r["requests"] == 6 and r["errors"] == 0 and r["cold_cache"]
        assert len(r["round_throughput_tok_s"]) == 3 and all(t > 0 for t in r["round_throughput_tok_s"])


def test_conversations_send_each_turn_after_the_reply_and_report_prefix_hits(server):
    """A two-turn BenchPrompt is two requests, the second carrying the first reply; turns under one
    long system prompt find it cached, so the level's prefix-hit rate is above zero."""
    from bench.data import BenchPrompt
    from bench.workloads import SYSTEM_PROMPTS
    convs = [BenchPrompt("t", str(i), SYSTEM_PROMPTS[0][:400], (f"Question {i}?", "And why?")) for i in range(2)]
    cfg = LoadConfig(url=server.url, concurrency=(1,), max_tokens=4, modes=("off",), requests_per_level=2, warmup=0)
    (r,) = run_serve_bench(cfg, convs)
    assert r["requests"] == 4 and r["errors"] == 0
    assert 0 < r["prefix_hit_rate"] <= 1


def test_serve_pair_levels_take_unseen_prompts_and_ignore_eos(server):
    """bench/serve_pair.py: each level gets prompts no other level (nor the warm-up) sends, and
    every request runs to max_tokens; the table divides each server by the baseline."""
    from bench.serve_pair import run_server, slices, table
    prompts = [[{"role": "user", "content": f"Say {i}."}] for i in range(12)]
    warm, by_level = slices(prompts, [1, 2], 3)
    assert warm == prompts[0] and [len(v) for v in by_level.values()] == [3, 4]
    sent = [p[0]["content"] for ps in by_level.values() for p in ps]
    assert len(set(sent)) == len(sent) and warm[0]["content"] not in sent
    with pytest.raises(ValueError, match="too few"):
        slices(prompts, [1, 8], 3)
    out = asyncio.run(run_server(server.url, warm, by_level, max_tokens=6))
    assert [(r["concurrency"], r["requests"], r["errors"], r["output_tokens"]) for r in out.values()] \
        == [(1, 3, 0, 18), (2, 4, 0, 24)]
    rounds = [{"default": out, "none": {c: {**r, "throughput_tok_s": 2 * r["throughput_tok_s"]} for c, r in out.items()}}]
    assert "| 1 |" in table(rounds, [1, 2], ["default"]) and "0.50x (0.50-0.50)" in table(rounds, [1, 2], ["default"])


def test_serve_pair_agent_sessions_run_their_turns_in_order(server):
    """`--workload agent`: a tools session replies to every turn (the random model calls no tool:
    each reply gets the tool's error) until its reply cap, an edit session sends each edit after
    the last reply; replies end at EOS or max_tokens, none is forced past EOS."""
    from bench.agent_workload import MAX_TOOL_REPLIES, AgentSpec
    from bench.serve_pair import run_server, work_items
    tools = AgentSpec("tools", ({"role": "system", "content": "Call tools."}, {"role": "user", "content": "2+2?"}))
    edit = AgentSpec("edit", ({"role": "user", "content": "Write f."},
                              {"role": "assistant", "content": "def f(): pass"},
                              {"role": "user", "content": "Rename f."}), ("Add a docstring.",))
    cfg = LoadConfig(url=server.url, max_tokens=4)
    assert all("ignore_eos" not in getattr(i, "first", i) for i in work_items(cfg, "tiny", [tools, edit]))
    assert work_items(cfg, "tiny", [[{"role": "user", "content": "Hi."}]])[0]["ignore_eos"] is True
    out = asyncio.run(run_server(server.url, edit, {1: [tools, edit]}, max_tokens=4))
    assert (out[1]["requests"], out[1]["errors"]) == (MAX_TOOL_REPLIES + 2, 0)


def test_bench_serve_sends_agent_sessions(tiny_llama_dir, tmp_path, capsys):
    """`tercel bench serve --dataset agent`: the agent sessions against any server, each level's
    sessions turn by turn (a tools session runs to its reply cap: the random model calls no tool).
    The sessions' prompts (250-550 tokens) want a longer context than the shared server's."""
    import json

    from conftest import shared_data
    from serving.cli import main as tercel
    shared_data("heldout/gsm8k_test.jsonl"), shared_data("train/gpteacher_codegen.jsonl")
    from bench.agent_workload import MAX_TOOL_REPLIES
    out = tmp_path / "agent.json"
    server = LiveServer(EngineConfig(model=str(tiny_llama_dir), **{**ENGINE, "max_model_len": 1024}), model_name="tiny")
    try:
        assert tercel(["bench", "serve", "--url", server.url, "--dataset", "agent", "--limit", "2",
                       "--concurrency", "1", "--max-tokens", "4", "--json", str(out)]) == 0
    finally:
        server.close()
    levels = json.loads(out.read_text())["results"]
    assert [(r["key"], r["requests"], r["errors"]) for r in levels] == \
        [("serve/on/c1", MAX_TOOL_REPLIES + 2, 0), ("serve/off/c1", MAX_TOOL_REPLIES + 2, 0)]
    assert "agent-tools/tools-0" in out.read_text() and "| 1 |" in capsys.readouterr().out

"""`tercel bench accept | grid | speed`: datasets, ranges, acceptance statistics, a tiny grid
end to end (JSON, profile, PNGs), interruption and --resume, bad input (exit code 2)."""
from __future__ import annotations

import json
import re
import sys

import pytest

import bench.suite
from bench.data import SPECBENCH_TASKS, load_datasets
from bench.grid import Cell, build_cells, parse_range
from bench.stats import acceptance
from bench.summary import best_per_task, summarise
from conftest import BENCH_PROMPTS, arithmetic_conversations, shared_data
from serving.cli import main as tercel
from spec import LLM, SamplingParams
from spec.profile import load_profile

# The prompts of tests/data (tasks qa and rag): the tiny runs need no data set.
TINY_GRID = ["--dataset", str(BENCH_PROMPTS), "--tasks", "qa,rag", "--limit", "1", "--max-tokens", "16",
             "--ignore-eos", "--repeats", "1"]


# ---- datasets -------------------------------------------------------------------------------
def test_specbench_has_six_tasks_in_file_order():
    shared_data("specbench/question.jsonl")          # the public set itself: skips without it
    data = load_datasets(["specbench"], limit=10)
    assert tuple(data.tasks()) == SPECBENCH_TASKS
    assert all(len(ps) == 10 for ps in data.by_task().values()) and not data.skipped
    assert load_datasets(["specbench"], limit=3).prompts == load_datasets(["specbench"], limit=3).prompts


def test_mtbench_second_turn_follows_the_models_answer():
    shared_data("mtbench/question.jsonl")
    p = load_datasets(["mtbench"], tasks=["coding"], limit=1, both_turns=True).prompts[0]
    assert p.task == "coding" and len(p.turns) == 2
    msgs = p.messages(["my first answer"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[1]["content"] == "my first answer" and msgs[2]["content"] == p.turns[1]
    assert len(load_datasets(["mtbench"], limit=1).prompts[0].turns) == 1


def test_jsonl_prompts_conversations_and_malformed_lines(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join([
        json.dumps({"prompt": "Tell me a joke.", "task": "fun"}),
        "{not json",
        json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}]}),
        json.dumps({"conversations": [{"from": "gpt", "value": "no user first"}]}),
        json.dumps({"prompt": ""}),
    ]) + "\n")
    data = load_datasets([str(f)])
    assert [(p.task, p.turns) for p in data.prompts] == [("fun", ("Tell me a joke.",)), ("mine", ("Hi",))]
    assert data.prompts[1].system == "Be brief."
    assert [s.split(":")[1] for s in data.skipped] == ["2", "4", "5"]      # file:line of each bad line


def test_dataset_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown task.*nope"):
        load_datasets([str(BENCH_PROMPTS)], tasks=["nope"])
    with pytest.raises(ValueError, match="not found"):
        load_datasets([str(tmp_path / "missing.jsonl")])
    (tmp_path / "bad.jsonl").write_text("{}\n[1]\n")
    with pytest.raises(ValueError, match="no usable prompts.*2 malformed"):
        load_datasets([str(tmp_path / "bad.jsonl")])


# ---- ranges, cells, statistics ------------------------------------------------------------------
def test_ranges_and_cells():
    assert parse_range("1:4", "gamma") == [1, 2, 3, 4] and parse_range("2:8:3", "gamma") == [2, 5, 8]
    assert parse_range("4,2,4", "gamma") == [2, 4] and parse_range(None, "gamma") is None
    for bad in ("0:3", "x", "5:2", "1:2:0"):
        with pytest.raises(ValueError, match="--gamma"):
            parse_range(bad, "gamma")
    cells = build_cells(["ngram"], [2, 4], [1, 2], [3, 4], [0.0])
    shapes = [(c.drafter, c.gamma, c.topk, c.budget) for c in cells]
    # plain first; a chain ignores budgets; budget 3 < γ 4 is left out
    assert shapes == [(None, None, None, None), ("ngram", 2, 1, None), ("ngram", 2, 2, 3), ("ngram", 2, 2, 4),
                      ("ngram", 4, 1, None), ("ngram", 4, 2, 4)]
    with pytest.raises(ValueError, match="below every --gamma"):
        build_cells(["ngram"], [4, 5], [2], [2, 3], [0.0])


def test_acceptance_statistics_match_a_hand_computed_example():
    # 10 verify steps; 6 accepted depth 1, 3 of those depth 2, 1 depth 3: emitted 10 + 6 + 3 + 1.
    acc = acceptance(10, 20, [6, 3, 1])
    assert acc.tau == 2.0
    assert acc.cumulative == pytest.approx((0.6, 0.3, 0.1))
    assert acc.conditional == pytest.approx((0.6, 0.5, 1 / 3))
    assert acceptance(4, 4, [0, 0]).conditional == (0.0, None)      # depth 2 never reachable
    assert acceptance(0, 0, []).tau is None


def _result(task, cell, repeat, tok_s, **kw):
    return {"key": f"{task}|{cell.key}|r{repeat}", "task": task, "repeat": repeat, "cell_key": cell.key,
            "cell": cell.__dict__, "tok_s": tok_s, "tokens": 10, "ttft_ms": 1.0, "verify_steps": kw.get("steps", 0),
            "emitted": kw.get("emitted", 0), "accepted_per_depth": kw.get("depth", []),
            "draft_ms_per_step": None, "verify_ms_per_step": None}


def test_speedups_pair_runs_of_the_same_repeat_and_pick_the_best():
    plain, ng = Cell(None), Cell("ngram", 2, 1)
    results = [_result("a", plain, 0, 10.0), _result("a", ng, 0, 15.0, steps=2, emitted=5, depth=[2, 1]),
               _result("a", plain, 1, 20.0), _result("a", ng, 1, 22.0, steps=2, emitted=4, depth=[1, 1]),
               _result("b", plain, 0, 10.0), _result("b", ng, 0, 8.0)]
    rows = {(r["task"], r["cell"]["drafter"]): r for r in summarise(results)}
    a = rows[("a", "ngram")]
    assert a["speedup"] == pytest.approx((1.5 + 1.1) / 2) and a["speedup_range"] == pytest.approx([1.1, 1.5])
    assert a["tau"] == pytest.approx(9 / 4) and a["alpha_cumulative"] == pytest.approx([0.75, 0.5])
    best = best_per_task(list(rows.values()))
    assert best["a"]["drafter"] == "ngram" and best["b"]["drafter"] is None


# ---- end to end on the tiny model -------------------------------------------------------------
def test_tiny_grid_end_to_end(tmp_path, tiny_llama_dir, tiny_eagle_head, capsys):
    out, prof, plots = tmp_path / "grid.json", tmp_path / "profile.json", tmp_path / "charts"
    # A random EAGLE-3 head drafts every step (a random model's output rarely repeats n-grams).
    rc = tercel(["bench", "grid", "--model", str(tiny_llama_dir), *TINY_GRID, "--drafter", f"ngram,eagle3:{tiny_eagle_head}",
                 "--gamma", "2", "--topk", "1,2",
                 "--budget", "3", "--temperature", "0.8", "--json", str(out), "--profile-out", str(prof),
                 "--plot", str(plots)])
    assert rc == 0
    report = json.loads(out.read_text())
    # plain + 2 drafters × (γ2 k1, γ2 k2 n3) -> 5 cells × 2 tasks, at one temperature (T > 0)
    assert len(report["results"]) == 10 and len(report["summary"]["rows"]) == 10
    assert all(r["tokens"] > 0 and r["tok_s"] > 0 for r in report["results"])
    eagle_rows = [r for r in report["summary"]["rows"] if (r["cell"]["drafter"] or "").startswith("eagle3")]
    assert all(r["speedup"] is not None for r in report["summary"]["rows"])
    assert all(r["tau"] is not None and r["tau"] >= 1 and len(r["alpha_cumulative"]) >= 1 for r in eagle_rows)
    table = capsys.readouterr().out
    assert "Fastest configuration per task" in table and "| qa |" in table and "| rag |" in table
    choice = load_profile(prof)
    assert set(json.loads(prof.read_text())["tasks"]) == {"qa", "rag"}
    llm = LLM(model=str(tiny_llama_dir), profile=str(prof), profile_task="qa", max_model_len=256, num_kv_blocks=64)
    assert (llm.engine.drafter is None) == (load_profile(prof, "qa").drafter is None)
    assert llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    assert choice.drafter is None or choice.speculation.num_speculative_tokens == 2
    from matplotlib.image import imread
    for name in ("tau_speedup_vs_gamma.png", "acceptance_per_depth.png"):
        img = imread(plots / name)
        assert img.ndim == 3 and img.shape[0] > 100


def test_accept_reports_per_depth_acceptance(tiny_llama_dir, capsys):
    rc = tercel(["bench", "accept", "--model", str(tiny_llama_dir), *TINY_GRID, "--gamma", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "α cumulative" in out and "| ngram | γ3 k1 |" in out and "a_d" in out


def test_bench_runs_every_request_under_a_lora_adapter(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    """`tercel bench speed --lora NAME=PATH`: the engine serves the adapter and every request names
    it (the journal records it); an HF baseline beside it is refused."""
    from spec.llm import LLM as Engine
    from lora_cases import ATTN_MLP, make_adapter
    adapter = make_adapter(tiny_llama_dir, tmp_path / "adapter", ATTN_MLP)
    asked, generate = [], Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, *a, lora=None, **kw: (asked.append(lora),
                                                                             generate(self, *a, lora=lora, **kw))[1])
    out = tmp_path / "speed.json"
    rc = tercel(["bench", "speed", "--model", str(tiny_llama_dir), *TINY_GRID, "--drafter", "ngram",
                 "--lora", f"a={adapter}", "--json", str(out)])
    assert rc == 0 and asked and set(asked) == {"a"}
    assert json.loads(out.read_text())["settings"]["lora"] == ["a", str(adapter)]
    capsys.readouterr()
    assert tercel(["bench", "speed", "--model", str(tiny_llama_dir), *TINY_GRID, "--hf", "--lora", f"a={adapter}"]) != 0
    assert "--hf and --llamacpp have no such baseline" in capsys.readouterr().err


def test_speed_compares_with_hf_generate_and_prompt_lookup(tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "speed.json"
    rc = tercel(["bench", "speed", "--model", str(tiny_llama_dir), *TINY_GRID, "--json", str(out)])
    assert rc == 0
    names = {r["cell"]["engine"] for r in json.loads(out.read_text())["results"]}
    assert names == {"tercel", "hf-generate", "hf-prompt-lookup"}
    text = capsys.readouterr().out
    assert "hf-generate" in text and "hf-prompt-lookup" in text and "TTFT" in text


def test_replay_prices_each_drafter_three_ways(tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "replay.json"
    rc = tercel(["bench", "replay", "--model", str(tiny_llama_dir), *TINY_GRID, "--drafter", "ngram,suffix",
                 "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["tasks"]) == {"qa", "rag"}
    for task in report["tasks"].values():
        assert set(task["drafters"]) == {"ngram", "suffix"} and task["forward_ms"]["1"] > 0
        for row in task["drafters"].values():
            assert row["tau"] >= 1 and row["policy_tau"] >= 1 and 0 <= row["prefill_share"] < 1
            assert all(row[f"decode_{k}"] > 0 for k in ("oracle", "whole", "policy"))
    assert "oracle / whole / policy" in capsys.readouterr().out


def test_interrupted_run_keeps_results_and_resumes(tmp_path, tiny_llama_dir, monkeypatch):
    out = tmp_path / "grid.json"
    args = ["bench", "grid", "--model", str(tiny_llama_dir), *TINY_GRID, "--gamma", "2,3", "--json", str(out)]
    real, calls = bench.suite.run_unit, []

    def interrupted(*a, **kw):
        if len(calls) == 4:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(bench.suite, "run_unit", interrupted)
    assert tercel(args) == 130
    assert len(json.loads(out.read_text())["results"]) == 4          # what finished is kept
    monkeypatch.setattr(bench.suite, "run_unit", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert tercel(args + ["--resume"]) == 0
    results = json.loads(out.read_text())["results"]
    assert len(calls) == 6 and len(results) == 6 and len({r["key"] for r in results}) == 6
    # A resume with other settings is refused rather than mixed in.
    assert tercel(args[:-4] + ["--max-tokens", "7", "--json", str(out), "--resume"]) == 2


@pytest.mark.parametrize("bad, message", [
    (["grid", "--drafter", "nope"], "unknown drafter"),
    (["grid", "--tasks", "nope"], "unknown task"),
    (["grid", "--gamma", "0:2"], "--gamma values must be >= 1"),
    (["grid", "--gamma", "4", "--topk", "2", "--budget", "2"], "below every --gamma"),
    (["grid", "--topk", "2"], "need --gamma"),
    (["grid", "--resume"], "--resume needs --json"),
    (["grid", "--limit", "0"], "--limit must be >= 1"),
    (["grid", "--temperature", "hot"], "--temperature"),
    (["serve", "--url", "http://127.0.0.1:9"], "cannot connect"),
    (["replay", "--drafter", "suffix,small:/nowhere"], "lookup drafters only"),
    (["replay", "--drafter", "tree:eagle3+ngram"], "lookup drafters only"),
])
def test_bad_input_exits_2_with_a_message(bad, message, tiny_llama_dir, capsys):
    args = ["--model", str(tiny_llama_dir), "--max-tokens", "4", "--dataset", str(BENCH_PROMPTS)]
    assert tercel(["bench", *bad, *args]) == 2
    assert message in capsys.readouterr().err


def test_empty_dataset_exits_2(tmp_path, tiny_llama_dir, capsys):
    (tmp_path / "empty.jsonl").write_text("\n")
    assert tercel(["bench", "grid", "--model", str(tiny_llama_dir), "--dataset", str(tmp_path / "empty.jsonl")]) == 2
    assert "no usable prompts" in capsys.readouterr().err


def test_llamacpp_baseline_without_the_extra_exits_2_with_the_install_hint(monkeypatch, tiny_llama_dir, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)          # as if llama-cpp-python were not installed
    rc = tercel(["bench", "speed", "--llamacpp", "--model", str(tiny_llama_dir), *TINY_GRID])
    err = capsys.readouterr().err
    assert rc == 2 and 'pip install -e ".[llamacpp]"' in err


# Under `make test-slow` (about 20 s: a grid per quantization); `bench speed` itself runs in
# `make test` (test_speed_compares_with_hf_generate_and_prompt_lookup).
@pytest.mark.slow
def test_speed_measures_each_quantization_against_the_first(tmp_path, tiny_llama_dir):
    out = tmp_path / "speed.json"
    rc = tercel(["bench", "speed", "--model", str(tiny_llama_dir), *TINY_GRID, "--quantization", "int4,none",
                 "--drafter", "ngram", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["summary"]["rows"]
    plain = {r["cell"]["quantization"]: r for r in rows if r["cell"]["drafter"] is None
             and r["cell"]["engine"] == "tercel"}
    assert set(plain) == {"int4", "none"}
    assert all(r["speedup"] == 1.0 for r in plain.values() if r["cell"]["quantization"] == "int4")
    assert tercel(["bench", "speed", "--model", str(tiny_llama_dir), *TINY_GRID, "--quantization", "int3"]) == 2


def test_kernels_prints_the_timings_and_the_choice(tiny_llama_dir, capsys, quick_timings):
    rc = tercel(["bench", "kernels", "--model", str(tiny_llama_dir), "--quantization", "int4"])
    out = capsys.readouterr().out
    from verifier.cpu import cpu_ops
    owns = "int4 | q4x16" if cpu_ops.q4_isa() else "int4"        # q4x16 where AVX2 or VNNI builds it
    assert rc == 0 and f"| rows | {owns} |" in out and "row-invariant" in out
    assert re.search(r"Every row \(decode, verify and prompt rows\) takes (int4|q4x16)\.", out)


def test_agent_sessions_call_the_calculator_for_each_shown_step(tmp_path):
    import json

    from bench.agent import agent_sessions, steps
    assert steps("It takes 2/2=1 bolt.\nSo 80,000+50,000=$130,000 and 3 * 4 = 12.") == \
        [("2/2", "1"), ("80000+50000", "130000"), ("3 * 4", "12")]
    solved = tmp_path / "solved.jsonl"          # worked problems of two calculations each
    solved.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_conversations(4)))
    sessions = agent_sessions(3, path=solved)
    assert len(sessions) == 3
    for s in sessions:
        assert [m["role"] for m in s[:2]] == ["system", "user"] and s[-1]["role"] == "user"
        calls = [json.loads(m["content"]) for m in s[2::2]]
        assert calls and all(c["name"] == "calculator" and c["arguments"]["expression"] for c in calls)


def test_the_calculator_tool_runs_arithmetic_only_and_answers_every_reply():
    import json

    from bench.agent import calculate, tool_reply
    assert [calculate(e) for e in ("16 - 3 - 4", "120000*1.5", "3 x (2+1)", "10/4", "1,000+1", "-2*3")] == \
        ["9", "180000", "9", "2.5", "1001", "-6"]
    for bad in ("__import__('os')", "2**8", "1/0", "3 +", "'a'*3"):
        with pytest.raises(ValueError):
            calculate(bad)
    call = lambda name, **a: json.dumps({"name": name, "arguments": a})   # noqa: E731
    assert json.loads(tool_reply("Sure: " + call("calculator", expression="6*7"))) == \
        {"tool": "calculator", "result": "42"}
    assert "error" in json.loads(tool_reply(call("calculator", expression="1/0")))
    assert "error" in json.loads(tool_reply("I think it is 42."))           # no call: the agent says so
    assert "error" in json.loads(tool_reply(call("search", query="x")))
    assert tool_reply(call("final_answer", answer=42)) is None             # the session ends


def test_agent_workload_alternates_tool_loops_and_code_edits(tmp_path):
    """bench/agent_workload.py: tools sessions from worked problems, edit sessions from exchanges
    whose reply defines a Python function (others skipped), alternating; a tools session answers
    each reply with the tool's result until final_answer or its reply cap, an edit session sends
    its edits in turn."""
    import json

    from bench.agent_workload import MAX_TOOL_REPLIES, ToolSession, agent_specs
    from bench.serve_load import Conversation, LoadConfig, request_item
    gsm8k, codegen = tmp_path / "gsm8k.jsonl", tmp_path / "codegen.jsonl"
    gsm8k.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_conversations(4)))
    code = [("Write add.", "def add(a, b):\n    return a + b\n"), ("Explain recursion.", "It calls itself."),
            ("Write sq.", "```python\ndef sq(x):\n    return x * x\n```")]
    codegen.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": u},
                                                             {"role": "assistant", "content": a}]}) + "\n"
                               for u, a in code))
    specs = agent_specs(4, gsm8k=gsm8k, codegen=codegen)
    assert [s.kind for s in specs] == ["tools", "edit", "tools", "edit"]
    edit = specs[1]
    assert [m["role"] for m in edit.messages()] == ["user", "assistant", "user"]
    assert "`add` to `add_v2`" in edit.opening[-1]["content"] and "`add_v2`" in edit.edits[0]
    assert "`sq` to `sq_v2`" in specs[3].opening[-1]["content"]
    assert [s.task for s in specs[:2]] == ["agent-tools", "agent-edit"] and len({s.id for s in specs}) == 4
    with pytest.raises(ValueError, match="fewer than 6"):
        agent_specs(6, gsm8k=gsm8k, codegen=codegen)
    cfg = LoadConfig(url="http://127.0.0.1:1", max_tokens=8)
    tools, edits = request_item(cfg, "m", specs[0], "on"), request_item(cfg, "m", edit, "off")
    assert isinstance(tools, ToolSession) and isinstance(edits, Conversation)
    assert tools.first["messages"] == specs[0].messages() and "ignore_eos" not in tools.first
    assert edits.first["speculation"] != tools.first["speculation"]          # the level's mode
    call = json.dumps({"name": "calculator", "arguments": {"expression": "2+2"}})
    assert json.loads(tools.next_user(0, call))["result"] == "4"
    assert tools.next_user(MAX_TOOL_REPLIES - 1, call) is None
    assert edits.next_user(0, "...") == edit.edits[0] and edits.next_user(1, "...") is None


def test_agent_steps_runs_sessions_offline_and_times_prompt_and_decode_steps(tiny_llama_dir, tmp_path):
    """bench/agent_steps.py: the sessions' turns go through one engine as clients would send
    them (a tools session answers each reply: the random model's replies get the tool's error,
    until its reply cap), every step is logged as a prompt-chunk step or a decode step."""
    from bench.agent_steps import StepLog, report, run
    from bench.step_times import timed
    from bench.agent_workload import MAX_TOOL_REPLIES, AgentSpec
    tools = AgentSpec("tools", ({"role": "system", "content": "Call tools."}, {"role": "user", "content": "2+2?"}))
    edit = AgentSpec("edit", ({"role": "user", "content": "Write f."},
                              {"role": "assistant", "content": "def f(): pass"},
                              {"role": "user", "content": "Rename f."}), ("Add a docstring.",))
    llm = LLM(model=str(tiny_llama_dir), drafter="ngram", max_model_len=512, num_kv_blocks=128)
    log = StepLog(timed(llm.engine))
    sent = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda rid, sub: sent.append(rid) or add(rid, sub)
    tokens, wall = run(llm, [tools, edit], 2, 4)
    assert len(sent) == MAX_TOOL_REPLIES + 2 and 0 < tokens <= 4 * len(sent) and wall > 0
    assert any(s.prompt for s in log.steps) and any(not s.prompt for s in log.steps)
    assert log.part(True)[0] + log.part(False)[0] == len(log.steps)
    assert "decode steps" in report("ngram", tokens, wall, log, None)
    assert llm.engine.blocks.num_used_blocks == 0


def test_until_eos_runs_count_replies_at_the_cap_and_time_the_ended_ones_apart(tiny_llama_dir):
    from bench.speculative import _summarise, run_set
    llm = LLM(model=str(tiny_llama_dir), drafter="ngram", max_num_seqs=1)
    ids = llm.engine.tokenize("the cat sat on the mat")
    plain = run_set(llm, [ids, ids[:3]], 6, ignore_eos=False, speculate=False)
    assert plain["replies"] == 2 and plain["capped"] == 2 and plain["ended_tps"] is None  # a random model never stops
    ended = dict(plain, capped=1, ended_tps=5.0)
    out = _summarise({"plain": [ended] * 3, "fast": [dict(ended, ended_tps=t) for t in (6.0, 10.0, 7.0)],
                      "capped": [plain] * 3})
    assert out["fast"]["ended_speedup"] == pytest.approx(1.4)      # the median of the repeats' ratios
    assert out["capped"]["ended_speedup"] is None and out["plain"]["capped"] == 1


def test_bench_serve_without_the_bench_extra_exits_2_with_the_install_hint(monkeypatch, capsys):
    """httpx is tercel[bench]'s, not the server's: without it `tercel bench serve` names the extra."""
    for name in ("bench.serve_load", "bench.cli_serve"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "httpx", None)             # as if httpx were not installed
    rc = tercel(["bench", "serve", "--url", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert rc == 2 and "needs httpx" in err and "pip install 'tercel[bench]'" in err

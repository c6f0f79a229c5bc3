"""`train-drafter`: data reading and masks, draft vocabulary, tiny end-to-end runs of both
kinds (the result loads and drafts), resume, self-distillation, bad input."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open

from conftest import MTBENCH_HEAD, arithmetic_conversations
from drafters.conversations import DataError, load_conversations, parse_line
from drafters.eagle3 import load_head
from pinned import WHOLE_TREES
from spec import LLM, SamplingParams
from training.cli import main as train_main
from training.config import TrainConfig
from training.data import tokenize_conversation
from training.loop import plan_batches
from training.vocab import select_draft_vocab
from verifier.model.tokenizer import Tokenizer
from verifier.target import TargetModel


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


CONV = {"id": "a", "source": "s", "conversations": [
    {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6."}]}
SHAREGPT = {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]}


def test_both_schemas_and_bad_lines_reported_with_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [CONV, SHAREGPT, "{not json", {"conversations": []},
                                              {"conversations": [{"role": "robot", "content": "x"}]}, ""])
    convs, report = load_conversations([str(path)])
    assert [c.messages[-1]["content"] for c in convs] == ["It is 6.", "Hello!"]
    assert convs[1].messages[0] == {"role": "user", "content": "Hi there"}
    assert len(report.skipped) == 3
    assert report.skipped[0].startswith(f"{path}:3: not valid JSON")
    assert f"{path}:4:" in report.skipped[1] and "assistant" in report.skipped[1]
    assert "unknown role 'robot'" in report.skipped[2]


def test_missing_or_empty_data_is_an_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_conversations([str(tmp_path / "nope.jsonl")])
    with pytest.raises(DataError, match="no usable conversations"):
        load_conversations([str(write_jsonl(tmp_path / "bad.jsonl", ["[]", "{}"]))])
    with pytest.raises(ValueError, match="no non-empty assistant"):
        parse_line(json.dumps({"conversations": [{"role": "user", "content": "hi"}]}))


def test_loss_mask_covers_exactly_the_assistant_replies(smollm2_dir, tmp_path):
    tok = Tokenizer(smollm2_dir)
    convs, _ = load_conversations([str(write_jsonl(tmp_path / "d.jsonl", [CONV]))])
    ex = tokenize_conversation(tok, convs[0], max_len=1024)
    assert list(ex.input_ids) == tok.apply_chat_template(list(convs[0].messages), add_generation_prompt=False,
                                                         tokenize=True, return_dict=False)
    spans, cur = [], []
    for t, m in zip(ex.input_ids, ex.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    assert [s.strip() for s in spans] == ["It is 4.<|im_end|>", "It is 6.<|im_end|>"]


def test_draft_vocabulary_is_the_most_frequent_reply_tokens():
    from training.data import TokenizedExample
    exs = [TokenizedExample("a", (5, 7, 7, 9, 9, 9, 3), (0, 1, 1, 1, 1, 1, 0))]
    ids, covered = select_draft_vocab(exs, 2, vocab_size=16)
    assert ids.tolist() == [7, 9] and covered == 1.0
    ids, covered = select_draft_vocab(exs, 3, vocab_size=16, always=(2, 2))
    assert ids.tolist() == [2, 7, 9]
    with pytest.raises(ValueError, match="draft-vocab"):
        select_draft_vocab(exs, 0, vocab_size=16)


def test_batches_respect_the_token_budget_and_cover_everything():
    lengths = [5, 50, 7, 33, 12, 64, 9, 40]
    batches = plan_batches(lengths, 100, seed=0, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert all(max(lengths[i] for i in b) * len(b) <= 100 for b in batches)
    assert plan_batches(lengths, 100, 0, 1) != batches or len(batches) == 1


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tiny.jsonl"
    return write_jsonl(path, arithmetic_conversations(12) + ["{broken"])


def _args(tiny_llama_dir, data, out, *extra):
    """fp32 unless `extra` says otherwise: `--dtype auto` picks by timing a probe step in each dtype
    (tests/training/test_precision.py), seconds of emulated bf16 where the CPU has no bf16 instructions."""
    return ["--target", str(tiny_llama_dir), "--data", str(data), "--output", str(out), "--dtype", "fp32",
            "--batch-tokens", "1024", "--checkpoint-every", "2", "--max-len", "200", *extra]


def _dp_run(tmp_path, name: str, accum: int, batch_tokens: int, world: int = 1) -> list[dict]:
    """tests/training/dp_worker.py in `world` processes, each with a launcher's environment (RANK,
    WORLD_SIZE, MASTER_ADDR/PORT) when there are several; every process's results."""
    import os
    import subprocess
    import sys

    from server_util import free_port
    port, procs, outs = free_port(), [], []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        outs.append(tmp_path / f"{name}-{rank}.pt")
        worker = os.path.join(os.path.dirname(__file__), "dp_worker.py")
        procs.append(subprocess.Popen([sys.executable, worker, str(outs[-1]), str(accum), str(batch_tokens)], env=env))
    assert [p.wait(timeout=300) for p in procs] == [0] * world
    return [torch.load(o) for o in outs]


@pytest.fixture(scope="module")
def whole_batch_step(tmp_path_factory) -> dict:
    """One optimiser step over 8 examples taken as one batch (tests/training/dp_worker.py)."""
    (whole,) = _dp_run(tmp_path_factory.mktemp("whole"), "whole", accum=1, batch_tokens=32)
    assert whole["steps"] == 1 and len(whole["grads"]) == 1 and whole["tokens"] == 32
    return whole


def _same_step(runs: list[dict], whole: dict) -> None:
    for run in runs:
        assert run["steps"] == 1 and len(run["grads"]) == 1 and run["tokens"] == 32
        assert torch.allclose(run["grads"][0], whole["grads"][0], atol=1e-6)
        assert torch.allclose(run["w"], whole["w"], atol=1e-6)


def test_accumulated_steps_take_the_whole_batchs_gradient(tmp_path, whole_batch_step):
    """On accelerate: the 8 examples as two accumulated micro-batches step on the same gradient
    as the whole batch, the mean over all 8. Unscaled accumulation (twice the gradient) would differ."""
    _same_step(_dp_run(tmp_path, "accum", accum=2, batch_tokens=16), whole_batch_step)


# Under `make test-slow` (two more processes, about 10 s); the accumulation above stays in `make test`.
@pytest.mark.slow
def test_data_parallel_steps_take_the_whole_batchs_gradient(tmp_path, whole_batch_step):
    """The 8 examples as two processes' shards (averaged over the processes) step on the whole
    batch's gradient and end at the same weights in every process. Unaveraged shards (each its
    own) would differ."""
    shards = _dp_run(tmp_path, "dp", accum=1, batch_tokens=16, world=2)
    _same_step(shards, whole_batch_step)
    assert [r["world"] for r in shards] == [2, 2] and torch.equal(shards[0]["w"], shards[1]["w"])


def test_eagle3_end_to_end_then_resume(tiny_llama_dir, tiny_data, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tercel.training")
    out = tmp_path / "head"
    # Full vocabulary: a random tiny target's argmax is rarely a frequent reply token.
    common = _args(tiny_llama_dir, tiny_data, out, "--draft-vocab", "49152", "--ttt-steps", "3",
                   "--feature-cache", str(tmp_path / "feats"))
    assert train_main(common + ["--max-tokens", "600"]) == 0
    first = json.loads((out / "training_summary.json").read_text())
    assert first["steps"] >= 1 and 0 < first["tokens_seen"] <= 600 + 1024
    assert first["data"]["skipped_lines"] == 1
    assert (tmp_path / "feats" / "meta.json").is_file()
    # Resume: continues from the saved step (features come from the cache) into a second epoch.
    assert train_main(common + ["--resume", "--epochs", "2"]) == 0
    second = json.loads((out / "training_summary.json").read_text())
    assert second["steps"] > first["steps"]
    resumed = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
    assert resumed and f"step {first['steps']}," in resumed[0]
    assert second["tokens_seen"] > first["tokens_seen"]     # counted on from the checkpoint
    # The head loads and drafts in the engine.
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, drafter=f"eagle3:{out}",
              adaptive=WHOLE_TREES)
    o = llm.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert len(o.token_ids) == 12 and o.stats.draft_tokens > 0


def test_small_end_to_end(tiny_llama_dir, tiny_data, tmp_path):
    out = tmp_path / "small"
    assert train_main(_args(tiny_llama_dir, tiny_data, out, "--kind", "small", "--small-layers", "1",
                            "--max-tokens", "600")) == 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["kind"] == "small" and summary["steps"] >= 1
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, drafter=f"small:{out}",
              adaptive=WHOLE_TREES)
    o = llm.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert len(o.token_ids) == 10 and o.stats.draft_tokens > 0


def test_the_gpu_recipe_is_one_invocation(tiny_llama_dir, tiny_data, tmp_path, capsys):
    """Regenerate the replies with the target, train an EAGLE-3 head in bf16 with 3 test-time
    steps, evaluate on MT-bench questions: one command, with tokens/s on the progress bars."""
    out = tmp_path / "recipe"
    assert train_main(_args(tiny_llama_dir, tiny_data, out, "--regenerate", "--regen-max-tokens", "8",
                            "--draft-vocab", "4096", "--ttt-steps", "3", "--dtype", "bf16", "--max-tokens", "300",
                            "--eval-data", str(MTBENCH_HEAD), "--eval-prompts", "2",
                            "--eval-tokens", "8")) == 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["data"]["regenerated"] and (out / "regenerated.jsonl").is_file()
    assert summary["dtype"] == "bfloat16"
    assert summary["heldout"]["prompts"] == 2 and summary["heldout"]["verify_steps"] > 0
    err = capsys.readouterr().err
    assert "regenerate" in err and "tok/s" in err


def test_eval_prompts_from_conversations_and_question_files(tmp_path):
    from training.data import load_prompts
    path = write_jsonl(tmp_path / "mixed.jsonl", [CONV, {"question_id": 1, "turns": ["first?", "second?"]},
                                                  "{broken", {"turns": []}])
    prompts = load_prompts(str(path), 10)
    assert prompts == [[CONV["conversations"][0]], [{"role": "user", "content": "first?"}]]
    assert load_prompts(str(path), 1) == prompts[:1]


def test_regenerate_writes_the_targets_own_replies(tiny_llama_dir, tiny_data, tmp_path):
    from training.regenerate import regenerate
    convs, _ = load_conversations([str(tiny_data)])
    llm = LLM(str(tiny_llama_dir), max_model_len=512, num_kv_blocks=128)
    path = tmp_path / "regen.jsonl"
    regenerate(convs[:3], str(tiny_llama_dir), str(path), max_new_tokens=8, llm=llm)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(c.id for c in convs[:3])   # in finishing order
    for r in rows:
        conv = next(c for c in convs if c.id == r["id"])
        assert r["conversations"][0] == conv.messages[0]
        reply = r["conversations"][-1]
        assert reply["role"] == "assistant" and reply["content"] != conv.messages[1]["content"]
        prompt = llm.apply_chat_template([conv.messages[0]])
        ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].text
        assert reply["content"] == ref
    # Already-done ids are skipped on a second run.
    assert regenerate(convs[:3], str(tiny_llama_dir), str(path), max_new_tokens=8, llm=llm) == []


def test_regenerate_only_writes_the_replies_and_resumes(tiny_llama_dir, tiny_data, tmp_path, capsys):
    """A CPU's share of a job trained elsewhere: the replies, no head; a second run adds nothing."""
    out = tmp_path / "replies"
    args = ["--target", str(tiny_llama_dir), "--data", str(tiny_data), "--output", str(out), "--regenerate-only",
            "--regen-max-tokens", "4"]
    assert train_main(args) == 0
    convs, _ = load_conversations([str(tiny_data)])
    rows = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(c.id for c in convs)
    assert not (out / "training_summary.json").exists() and not (out / "config.json").exists()
    capsys.readouterr()
    assert train_main(args) == 0
    assert (out / "regenerated.jsonl").read_text().count("\n") == len(rows)
    assert json.loads(capsys.readouterr().out)["regenerated"] == len(convs)


def test_bad_command_lines(tmp_path, capsys):
    assert train_main(["--data", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o")]) == 2
    assert "not found" in capsys.readouterr().err
    with pytest.raises(ValueError, match="ttt_steps|ttt-steps"):
        TrainConfig(kind="eagle3", data=("x",), output="o", ttt_steps=0)
    with pytest.raises(ValueError, match="--kind"):
        TrainConfig(kind="medusa", data=("x",), output="o")


def test_features_are_the_served_targets_taps_and_predictions(tiny_llama_dir):
    """The head drafts from the target as it serves (here int4), so it trains on that target's
    tapped hidden states, and each position's label is the token that target predicts there
    (its quantized head's scan and rescoring), not the dense model's."""
    from training.data import TokenizedExample
    from training.features import capture
    ids = list(range(300, 340))
    ex = [TokenizedExample("a", tuple(ids), tuple([1] * len(ids)))]
    served = capture(TargetModel(str(tiny_llama_dir), quantization="int4"), ex, (0, 1))[0]
    dense = capture(TargetModel(str(tiny_llama_dir)), ex, (0, 1))[0]
    assert not torch.equal(served.aux, dense.aux)
    llm = LLM(str(tiny_llama_dir), quantization="int4", max_model_len=256, num_kv_blocks=64)
    for t in (4, 17, 39):
        out = llm.generate([ids[:t + 1]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
        assert out.token_ids[0] == int(served.argmax[t])


def test_eagle3_lm_head_from_target_stays_the_targets_rows(tiny_llama_dir, tiny_data, tmp_path):
    """--lm-head-from-target: the LM head is frozen at the target's rows, left out of the file,
    and put back from the target at load (resume and serving alike)."""
    out = tmp_path / "tied"
    common = _args(tiny_llama_dir, tiny_data, out, "--draft-vocab", "512", "--ttt-steps", "2",
                   "--lm-head-from-target")
    assert train_main(common + ["--max-tokens", "600"]) == 0
    assert train_main(common + ["--resume", "--epochs", "2"]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "midlayer.mlp.up_proj.weight" in f.keys()
    assert json.loads((out / "config.json").read_text())["lm_head_from_target"] is True
    target = TargetModel(str(tiny_llama_dir))
    head = load_head(out, target.config, target_head=target.output_table)
    assert torch.equal(head.lm_head.weight, target.net.lm_head.weight[head.draft_to_target])
    assert "LM head | the target's rows" in (out / "README.md").read_text()
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, drafter=f"eagle3:{out}",
              adaptive=WHOLE_TREES)
    o = llm.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(o.token_ids) == 8 and o.stats.draft_tokens > 0

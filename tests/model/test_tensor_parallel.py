"""Tensor parallelism on the CPU: TP=2 over gloo (rank 0 in this process, rank 1 spawned) on a
tiny random Llama (4 query heads, 2 KV heads, vocabulary 256), against the same model on one
rank; the refusals; and worker processes that never outlive their engine.

Tolerance: the logits of TP=2 are within LOGIT_ATOL of TP=1's. Both are fp32, but a row-parallel
layer (o_proj, down_proj) sums its dot products as two halves added by the all-reduce instead of
in one pass, so the rounding differs: a few fp32 ulps (1.2e-7 relative) per layer, carried
through the residual stream. 1e-4 leaves about 70x margin over the 1.4e-6 measured on this model
(logits up to ~3), and is far below the gap between a greedy token and the runner-up, which
is why the greedy outputs must be identical.
"""
from __future__ import annotations

import argparse
import faulthandler
import multiprocessing
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from conftest import ROOT, make_random_eagle_head, make_tiny_model, slow_marked
from drafters.config import SpecConfig
from pinned import WHOLE_TREES
from spec import LLM, SamplingParams
from spec.config import EngineConfig
from verifier.batch import ForwardBatch, SeqInput
from verifier.model.shard import TensorShard
from verifier.target import load_config

LOGIT_ATOL = 1e-4
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
ENGINE = dict(max_model_len=256, num_kv_blocks=96, max_num_seqs=8, num_threads=1, device="cpu")
HANG_S = 120          # a test still running after this has hung: dump the stacks and exit


@pytest.fixture(autouse=True)
def no_hang():
    """A hung collective fails the run instead of stalling it; the workers then read EOF on their
    pipe and exit."""
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tp_tiny"), None, seed=3)


@pytest.fixture(scope="module")
def prompts():
    """8 prompts of 5 to 40 tokens; repeated phrases give the n-gram drafter something to match."""
    return [[3 + i] + [10 + (7 * i + j) % 50 for j in range(4 + 5 * i)] * (1 + i % 2) for i in range(8)]


@pytest.fixture(scope="module")
def one_rank(tiny_dir):
    return LLM(str(tiny_dir), **ENGINE)


@pytest.fixture(scope="module")
def reference(one_rank, prompts):
    return [o.token_ids for o in one_rank.generate(prompts, GREEDY)]


def two_ranks(tiny_dir, **kwargs) -> LLM:
    return LLM(str(tiny_dir), tensor_parallel_size=2, **ENGINE, **kwargs)


def test_greedy_tp2_equals_tp1(tiny_dir, prompts, reference):
    """Plain greedy decoding, 8 prompts as one batch and 2 alone: TP=2 gives TP=1's tokens, picks
    dense weights under quantization auto, and frees every KV block."""
    with two_ranks(tiny_dir) as llm:
        assert llm.engine.target.quantization == "none"
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
        assert [llm.generate(p, GREEDY)[0].token_ids for p in prompts[:2]] == reference[:2]
        assert llm.engine.blocks.num_used_blocks == 0


@pytest.fixture(scope="module")
def eagle_head(tiny_dir, tmp_path_factory):
    return make_random_eagle_head(tiny_dir, tmp_path_factory.mktemp("tp_eagle"), draft_vocab=64)


# the drafters on rank 0 (the small draft model, the EAGLE-3 head, unsharded) under `make test-slow`;
# the n-gram drafter's trees are verified across the ranks in `make test`
@pytest.mark.parametrize("drafter", slow_marked(["ngram", "small", "eagle3"], {"small", "eagle3"}))
def test_speculative_tp2_equals_tp1_plain(tiny_dir, prompts, reference, eagle_head, drafter):
    """Speculation on under TP=2: the n-gram drafter; a small draft model (the tiny model itself,
    unsharded on rank 0); a random EAGLE-3 head on rank 0, reading the tapped hidden states and
    the whole embedding table. The same tokens as plain TP=1 decoding, with drafted tokens
    verified (accepted, for the two that can match), so tree verification and the KV commit ran
    on both ranks."""
    spec = {"small": f"small:{tiny_dir}", "eagle3": f"eagle3:{eagle_head}"}.get(drafter, drafter)
    with two_ranks(tiny_dir, drafter=spec, speculation=SpecConfig(num_speculative_tokens=3),
                   adaptive=WHOLE_TREES) as llm:     # drafts verified (asserted), whatever a row costs
        outs = llm.generate(prompts, GREEDY)
        assert llm.engine.drafting.errors == 0
    assert [o.token_ids for o in outs] == reference
    assert sum(o.stats.draft_tokens for o in outs) > 0
    assert sum(o.stats.accepted_tokens for o in outs) > 0 or drafter == "eagle3"


def test_three_ranks_add_partial_sums_in_rank_order(tmp_path, prompts):
    """TP=3 (6 query heads, 3 KV heads, intermediate 192, vocabulary 264: each divides by 3) takes
    the all-gather-and-add path of the all-reduce: greedy n-gram speculative decoding under TP=3,
    8 prompts batched and 2 alone (other row counts), gives plain TP=1's tokens."""
    model = str(make_tiny_model(tmp_path / "tiny3", None, seed=5, hidden_size=96, intermediate_size=192,
                                num_attention_heads=6, num_key_value_heads=3, vocab_size=264))
    with LLM(model, **ENGINE) as one:
        expected = [o.token_ids for o in one.generate(prompts, GREEDY)]
    with LLM(model, tensor_parallel_size=3, drafter="ngram", adaptive=WHOLE_TREES, **ENGINE) as three:
        assert len(three.engine.target.worker_processes) == 2
        spec = three.generate(prompts, GREEDY)
        alone = [three.generate(p, GREEDY)[0] for p in prompts[:2]]      # one at a time: other row counts
    assert [o.token_ids for o in spec] == expected
    assert [o.token_ids for o in alone] == expected[:2]
    assert sum(o.stats.accepted_tokens for o in spec) > 0


# A 5-node tree after the prompt: root 0; 1 and 2 its children; 3 under 1; 4 under 3.
TREE_PARENTS = [0, 0, 0, 1, 3]
TREE_DEPTHS = [0, 1, 1, 2, 3]


def _tree_mask() -> torch.Tensor:
    """Bool [5, 5]: node i sees itself and its ancestors."""
    mask = torch.eye(5, dtype=torch.bool)
    for i in range(1, 5):
        j = i
        while j:
            j = TREE_PARENTS[j]
            mask[i, j] = True
    return mask


def _prefill_then_tree(llm: LLM, prompt: list[int], tree: list[int]) -> list:
    """Two forwards in scratch blocks: the prompt (logits of every row), then the tree after it."""
    engine, n = llm.engine, len(prompt)
    with engine.blocks.scratch(-7, n + len(tree)) as table:
        seqs = [SeqInput(prompt, 0, table, logits_indices=list(range(n))),
                SeqInput(tree, n, table, positions=[n + d for d in TREE_DEPTHS], mask=_tree_mask(),
                         logits_indices=list(range(len(tree))))]
        return [engine.target.forward(ForwardBatch([s], capture_layers=(0, 1, 2))) for s in seqs]


def test_logits_and_taps_within_tolerance(tiny_dir, one_rank):
    """A 120-token prefill, then a 5-node tree verified after it: every row's logits within
    LOGIT_ATOL of TP=1 with the same argmax, and the tapped hidden states (the whole hidden size
    after the all-reduce: what EAGLE-3 reads on rank 0) within it too. The embedding output
    (tap 0) is exact: a masked lookup summed with zeros."""
    prompt, tree = list(range(3, 123)), [122, 50, 51, 52, 53]
    ref = _prefill_then_tree(one_rank, prompt, tree)
    with two_ranks(tiny_dir) as llm:
        got = _prefill_then_tree(llm, prompt, tree)
    worst = 0.0
    for r, g in zip(ref, got):
        rows = r.logits.shape[0]
        assert g.logits.shape == r.logits.shape == (rows, 256)
        worst = max(worst, (g.logits - r.logits).abs().max().item())
        assert torch.equal(g.logits.argmax(-1), r.logits.argmax(-1))
        assert torch.equal(g.hidden[0], r.hidden[0])
        for layer in (1, 2):
            assert g.hidden[layer].shape == (rows, 64)
            torch.testing.assert_close(g.hidden[layer], r.hidden[layer], atol=LOGIT_ATOL, rtol=0)
    print(f"max |logits TP=2 - TP=1| = {worst:.3g} (tolerance {LOGIT_ATOL})")
    assert worst <= LOGIT_ATOL


def test_workers_stop_on_close(tiny_dir):
    """close() stops rank 1 and leaves the process group, so a second TP engine can start in the
    same process; closing twice is harmless."""
    import torch.distributed as dist
    llm = two_ranks(tiny_dir)
    workers = llm.engine.target.worker_processes
    assert len(workers) == 1 and workers[0].is_alive()
    llm.close()
    llm.close()
    assert not workers[0].is_alive() and workers[0].exitcode == 0
    assert not dist.is_initialized()


_ORPHAN = """
import sys, time
from spec import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=64, num_kv_blocks=8, num_threads=1, device="cpu")
print(llm.engine.target.worker_processes[0].pid, flush=True)
time.sleep(600)
"""


def test_worker_exits_when_rank0_is_killed(tiny_dir):
    """Rank 0's process killed outright (no atexit, no close): rank 1 reads EOF on its pipe and
    exits within seconds instead of waiting forever."""
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN, str(tiny_dir)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        pid = int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), f"rank 1 (pid {pid}) outlived rank 0"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"      # a zombie has exited
    except FileNotFoundError:
        return False


# ---- refusals (no process is started) ---------------------------------------------------------
def test_refuses_sizes_that_do_not_divide_the_model(tiny_dir):
    """Heads, KV heads, intermediate size and vocabulary must divide by the number of ranks:
    each failure is a ValueError naming the HF key, before any worker starts."""
    cfg = load_config(tiny_dir)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(str(tiny_dir), tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        TensorShard(0, 4).check(replace(cfg, num_heads=8))
    with pytest.raises(ValueError, match="vocab_size"):
        TensorShard(0, 2).check(replace(cfg, vocab_size=255))
    with pytest.raises(ValueError, match="phi3 checkpoints.*fused"):
        TensorShard(0, 2).check(replace(cfg, model_type="phi3"))
    TensorShard(0, 1).check(replace(cfg, model_type="phi3"))      # one rank loads them as stored
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model=str(tiny_dir), tensor_parallel_size=0)
    assert not any(p.name.startswith("tercel-tp") for p in multiprocessing.active_children())


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_refuses_quantization_under_tp(tiny_dir, mode):
    """The quantized CPU path is not sharded: int4/int8 with TP > 1 is a ValueError naming the
    option and the way out; auto and none are accepted."""
    with pytest.raises(ValueError, match=f"quantization '{mode}' is not sharded.*quantization='none'"):
        EngineConfig(model=str(tiny_dir), quantization=mode, tensor_parallel_size=2)
    for ok in ("auto", "none"):
        assert EngineConfig(model=str(tiny_dir), quantization=ok, tensor_parallel_size=2).tensor_parallel_size == 2


def test_weight_slices_follow_heads_and_vocabulary(tiny_dir):
    """Rank 1 of 2 on the tiny model (4 heads, 2 KV heads of 16, intermediate 128, vocab 256):
    q rows 32..64, k/v rows 16..32 (its one KV head), o columns 32..64, gate/up rows 64..128,
    down columns 64..128, vocabulary 128..256; norms replicated; its modules' shapes are halved."""
    cfg, shard = load_config(tiny_dir), TensorShard(1, 2)
    layer = "model.layers.0"
    cases = {f"{layer}.self_attn.q_proj.weight": ((64, 64), (0, 32, 64)),
             f"{layer}.self_attn.k_proj.weight": ((32, 64), (0, 16, 32)),
             f"{layer}.self_attn.o_proj.weight": ((64, 64), (1, 32, 64)),
             f"{layer}.mlp.up_proj.weight": ((128, 64), (0, 64, 128)),
             f"{layer}.mlp.down_proj.weight": ((64, 128), (1, 64, 128)),
             "model.embed_tokens.weight": ((256, 64), (0, 128, 256)),
             "lm_head.weight": ((256, 64), (0, 128, 256))}
    for name, (shape, (dim, start, stop)) in cases.items():
        part = shard.slice_of(name, shape)
        assert (part.dim, part.start, part.stop) == (dim, start, stop), name
    assert shard.slice_of(f"{layer}.input_layernorm.weight", (64,)) is None
    local = shard.local_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 64, 128)
    assert shard.vocab_start(cfg.vocab_size) == 128


def test_server_on_tp2_answers_tp1s_text_and_stops_its_worker(tiny_llama_dir):
    """`tercel serve`'s engine thread builds the TP=2 engine (rank 0 off the main thread): a
    greedy completion over HTTP has the text of TP=1's, and shutting the bridge down stops rank 1."""
    import httpx
    from server_util import LiveServer

    prompt, params = "The weather today", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_llama_dir), **ENGINE) as one:
        expected = one.generate(prompt, params)[0].text
    server = LiveServer(EngineConfig(model=str(tiny_llama_dir), tensor_parallel_size=2, drafter="ngram", **ENGINE),
                        model_name="tiny")
    workers = server.engine.target.worker_processes
    try:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
    finally:
        server.close()
    workers[0].join(10)
    assert not workers[0].is_alive()


@pytest.mark.slow
def test_bench_accept_under_tp2(tiny_llama_dir, capsys):
    """`tercel bench accept --tensor-parallel-size 2` runs its cells on a two-rank engine (the
    tiny model with the SmolLM2 tokenizer, so the chat template applies). In the slow suite: it
    adds the benchmark's own set-up (datasets, templates) to a TP engine's start."""
    from conftest import BENCH_PROMPTS
    from serving.cli import main
    rc = main(["bench", "accept", "--model", str(tiny_llama_dir), "--dataset", str(BENCH_PROMPTS), "--tasks", "qa",
               "--limit", "1", "--max-tokens", "8", "--ignore-eos", "--gamma", "2", "--threads", "1",
               "--tensor-parallel-size", "2"])
    assert rc == 0 and "| ngram | γ2 k1 |" in capsys.readouterr().out


def test_bench_commands_that_cannot_shard_refuse_tp(tiny_llama_dir, capsys):
    """bench kernels (the quantized CPU path) with --tensor-parallel-size 2 exits 2 and says where
    the flag applies."""
    from serving.cli import main
    assert main(["bench", "kernels", "--model", str(tiny_llama_dir), "--tensor-parallel-size", "2"]) == 2
    assert "applies to bench accept, grid and speed" in capsys.readouterr().err


def test_cli_flag_reaches_the_engine_config():
    """`tercel serve --tensor-parallel-size 2` builds an EngineConfig with 2 ranks."""
    from serving.server import add_serve_args, engine_config
    parser = argparse.ArgumentParser()
    add_serve_args(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--tensor-parallel-size", "2", "--quantization", "none"])
    assert engine_config(args).tensor_parallel_size == 2

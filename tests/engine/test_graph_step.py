"""The step a CUDA graph captures, proven on the CPU (issue 63): padded to a row bucket and run
from fixed buffers (`verifier/graphs/static_step.py`), it gives every real row the bits the
unpadded forward gives, writes no request's KV but its own, and reads nothing on the host.

The Triton backend runs under TRITON_INTERPRET=1, as in tests/engine/test_triton_engine.py, on a
tiny random model in fp32 (the interpreter multiplies bf16 as raw bits; bf16 is proven on the
padding rule with the torch backend here, and graph == eager in bf16 on a GPU, tests/gpu).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed, so its backend cannot be tested")

from conftest import make_tiny_model  # noqa: E402
from gemma_cases import make_gemma  # noqa: E402
from drafters.kinds import default_speculation  # noqa: E402
from spec import LLM, SamplingParams  # noqa: E402
from spec.adaptive import AdaptiveConfig  # noqa: E402
from tree.token_tree import TokenTree  # noqa: E402
from verifier.attention import triton_kernels as tk  # noqa: E402
from verifier.batch import ForwardBatch, SeqInput  # noqa: E402
from verifier.graphs.config import GraphConfig  # noqa: E402
from verifier.graphs.static_step import StaticStep, pad_batch  # noqa: E402
from verifier.graphs.sync_guard import HostSyncError, no_host_sync  # noqa: E402
from verifier.model.linear import ONEDNN_MIN_ROWS, Linear  # noqa: E402
from verifier.target import TargetModel  # noqa: E402

assert tk.INTERPRETED, "triton_kernels was imported before TRITON_INTERPRET=1 was set"

V, BS, BLOCKS = 64, 8, 48
CONFIG = GraphConfig(max_rows=64, max_seq_rows=24, cpu_proof=True)
SCRATCH = list(range(BLOCKS, BLOCKS + CONFIG.scratch_blocks(BS)))
TAPS = (0, 1)                 # an EAGLE-3 head's taps: the residual entering layers 0 and 1
# Each drafter kind's default tree (depth, width, nodes), and a lone decode row.
SHAPES = {"decode": (0, 1, 0), "chain": (4, 1, 4)} | {
    kind: (s.num_speculative_tokens, s.topk, s.max_nodes)
    for kind in ("ngram", "suffix", "datastore", "small", "eagle3")
    for s in [default_speculation(kind)]}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("graph_target"), None, vocab_size=V, hidden_size=32,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, seed=21)


def a_tree(depth: int, width: int, nodes: int, gen: torch.Generator) -> TokenTree:
    """A random tree: a root and up to `nodes` more, each at most `depth` below it, no node with
    more than `width` children (a drafter's tree of that shape)."""
    parents, depths, kids = [-1], [0], [0]
    while len(parents) < min(nodes + 1, CONFIG.max_seq_rows):
        open_ = [i for i in range(len(parents)) if depths[i] < depth and kids[i] < width]
        p = open_[int(torch.randint(len(open_), (1,), generator=gen))]
        parents.append(p), depths.append(depths[p] + 1), kids.append(0)
        kids[p] += 1
    return TokenTree(tuple(range(len(parents))), tuple(parents))


def a_step(shapes: list[str], gen: torch.Generator) -> tuple[ForwardBatch, list[int]]:
    """One sequence per shape, each after a prefix of its own (tables of distinct blocks)
    verifying its tree; the prefixes to prefill first."""
    seqs, prefixes = [], []
    for i, name in enumerate(shapes):
        tree, ctx = a_tree(*SHAPES[name], gen), 5 + 7 * i
        q, table = len(tree.parents), list(range(6 * i, 6 * i + 6))
        tokens = torch.randint(3, V, (q,), generator=gen).tolist()
        seqs.append(SeqInput(tokens, ctx, table, positions=tree.positions(ctx), mask=tree.ancestor_mask(),
                             logits_indices=list(range(q))))
        prefixes.append(ctx)
    return ForwardBatch(seqs, TAPS), prefixes


def pin_matmul_paths(net) -> None:
    """Where MKL gives way to oneDNN is timed at load (`verifier/model/linear_tuning.py`): pinned,
    so that an eager step and its padded bucket never straddle the switch on one machine and not
    on another."""
    for m in net.modules():
        if isinstance(m, Linear):
            m.onednn_from = ONEDNN_MIN_ROWS


def loaded_target(target_dir, dtype=torch.float32, backend="triton") -> TargetModel:
    t = TargetModel(str(target_dir), device="cpu", dtype=dtype, backend=backend)
    pin_matmul_paths(t.net)
    t.allocate_kv(BLOCKS + len(SCRATCH), BS)
    return t


def prefill(target: TargetModel, batch: ForwardBatch, prefixes: list[int], gen: torch.Generator) -> None:
    for s, ctx in zip(batch.seqs, prefixes):
        target.forward(ForwardBatch([SeqInput(torch.randint(3, V, (ctx,), generator=gen).tolist(), 0, s.block_table)]))


def both_ways(target: TargetModel, batch: ForwardBatch, step: StaticStep):
    """(eager output, its KV pool; fixed-buffer output, its KV pool), each from the same pool."""
    k0, v0 = target.kv.k.clone(), target.kv.v.clone()
    eager = target.forward(batch)
    eager_kv = (target.kv.k.clone(), target.kv.v.clone())
    target.kv.k.copy_(k0), target.kv.v.copy_(v0)
    rows = step.rows_for(batch)
    assert rows is not None and rows >= sum(s.num_new for s in batch.seqs)
    loaded = step.load(batch, rows)                  # host work: the padding and the copies
    with no_host_sync():                             # what a graph captures: none
        logits, taps = step.run(rows, batch.capture_layers)
    fixed = loaded.output(logits, taps, copy=False)
    return eager, eager_kv, fixed, (target.kv.k.clone(), target.kv.v.clone())


def assert_same_rows(eager, eager_kv, fixed, fixed_kv) -> None:
    """Bit for bit: the logits, the taps, and every KV block but the scratch ones."""
    assert eager.logits_offsets == fixed.logits_offsets
    assert torch.equal(eager.logits, fixed.logits)
    assert eager.hidden.keys() == fixed.hidden.keys()
    assert all(torch.equal(eager.hidden[i], fixed.hidden[i]) for i in eager.hidden)
    for a, b in zip(eager_kv, fixed_kv):
        assert torch.equal(a[:, :BLOCKS], b[:, :BLOCKS]), "a padding row wrote into a request's KV"


STEPS = [["decode"], ["decode"] * 3, ["chain", "decode"], *[[k, "decode", k] for k in SHAPES if k not in ("decode", "chain")]]
QUICK = (["decode"] * 3, ["suffix", "decode", "suffix"])     # in `make test`: padding, and the widest tree


@pytest.mark.parametrize("shapes", [pytest.param(s, id="+".join(s), marks=() if s in QUICK else pytest.mark.slow)
                                    for s in STEPS])
def test_a_padded_step_gives_the_unpadded_bits(target_dir, shapes):
    gen = torch.Generator().manual_seed(len(shapes) * 31 + len(shapes[0]))
    target = loaded_target(target_dir)
    batch, prefixes = a_step(shapes, gen)
    prefill(target, batch, prefixes, gen)
    step = StaticStep(target.net, target.runner.backend, target.kv, CONFIG, BLOCKS, SCRATCH)
    assert_same_rows(*both_ways(target, batch, step))


@pytest.mark.parametrize("model_type", ["gemma2", pytest.param("gemma3_text", marks=pytest.mark.slow)])
def test_a_padded_gemma_step_gives_the_unpadded_bits(tmp_path, model_type):
    """Sliding windows (contexts past them), soft-capped scores and logits: padding changes no bit."""
    gen = torch.Generator().manual_seed(13)
    target = loaded_target(make_gemma(tmp_path / model_type, model_type))
    batch, prefixes = a_step(["datastore", "decode", "chain"], gen)
    prefill(target, batch, prefixes, gen)
    step = StaticStep(target.net, target.runner.backend, target.kv, CONFIG, BLOCKS, SCRATCH)
    assert_same_rows(*both_ways(target, batch, step))


def test_padding_on_a_requests_blocks_is_caught(target_dir):
    """The broken control: padding rows given a request's blocks overwrite its KV, and the
    comparison above sees it."""
    gen = torch.Generator().manual_seed(3)
    target = loaded_target(target_dir)
    batch, prefixes = a_step(["chain", "decode"], gen)
    prefill(target, batch, prefixes, gen)
    step = StaticStep(target.net, target.runner.backend, target.kv, CONFIG, BLOCKS, batch.seqs[0].block_table + SCRATCH)
    with pytest.raises(AssertionError):
        assert_same_rows(*both_ways(target, batch, step))


def test_the_padding_rule_keeps_bf16_rows(target_dir):
    """bf16 on the torch backend: a batch with the padding sequence appended gives the real
    rows the bits they get alone (the rule the buckets rest on; the kernels' own bf16 is a
    GPU's to check)."""
    gen = torch.Generator().manual_seed(9)
    target = loaded_target(target_dir, torch.bfloat16, "torch")
    batch, prefixes = a_step(["eagle3", "decode"], gen)
    prefill(target, batch, prefixes, gen)
    k0, v0 = target.kv.k.clone(), target.kv.v.clone()
    alone = target.forward(batch)
    alone_kv = (target.kv.k.clone(), target.kv.v.clone())
    target.kv.k.copy_(k0), target.kv.v.copy_(v0)
    rows = sum(s.num_new for s in batch.seqs)
    padded = target.forward(pad_batch(batch, CONFIG.bucket(rows) + 3, SCRATCH))
    padded.hidden = {i: h[:rows] for i, h in padded.hidden.items()}
    padded.logits_offsets = padded.logits_offsets[:-1]          # the padding sequence's: no rows
    assert_same_rows(alone, alone_kv, padded, (target.kv.k, target.kv.v))


PLANTED = {
    "item": lambda x: x.sum().item(),
    "tolist": lambda x: x[0, :2].tolist(),
    "if": lambda x: bool(x.sum() > 0),
    "cpu": lambda x: x.to("cpu") if x.is_cuda else x.cpu(),
    "nonzero": lambda x: x.nonzero(),
    "mask": lambda x: x[x > 0],
}


@pytest.mark.parametrize("plant", list(PLANTED))
def test_the_guard_catches_a_host_read_planted_in_the_step(target_dir, plant, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    target = loaded_target(target_dir)
    batch, prefixes = a_step(["chain"], gen)
    prefill(target, batch, prefixes, gen)
    step = StaticStep(target.net, target.runner.backend, target.kv, CONFIG, BLOCKS, SCRATCH)
    rows = step.rows_for(batch)
    step.load(batch, rows)
    with no_host_sync():
        step.run(rows, TAPS)                     # the step as built reads nothing on the host
    norm = target.net.model.layers[1].post_attention_layernorm
    plain = norm.forward
    monkeypatch.setattr(norm, "forward", lambda x: (PLANTED[plant](x), plain(x))[1])
    step.run(rows, TAPS)                         # outside the guard the planted read runs
    with pytest.raises(HostSyncError), no_host_sync():
        step.run(rows, TAPS)


def test_buckets_and_their_limits():
    c = GraphConfig(max_rows=48, max_seq_rows=8)
    assert c.buckets == (1, 2, 4, 8, 16, 32, 48)
    assert [c.bucket(n) for n in (1, 3, 8, 9, 33, 48, 49)] == [1, 4, 8, 16, 48, 48, None]
    assert c.scratch_blocks(16) == 3
    with pytest.raises(ValueError, match="max_rows"):
        GraphConfig(max_rows=0)


def test_steps_that_stay_eager(target_dir):
    target = loaded_target(target_dir)
    step = StaticStep(target.net, target.runner.backend, target.kv, CONFIG, 6, SCRATCH)
    chunk = SeqInput(list(range(3, 3 + CONFIG.max_seq_rows + 1)), 0, list(range(6)))
    assert step.rows_for(ForwardBatch([chunk])) is None                              # a prompt chunk
    many = [SeqInput([5] * 22, 0, [6 * i, 6 * i + 1, 6 * i + 2]) for i in range(3)]
    assert step.rows_for(ForwardBatch(many)) is None                                 # 66 rows > 64
    assert step.rows_for(ForwardBatch(many[:2])) == 64
    width = len(SCRATCH)                      # the tables hold the padding sequence's blocks at least
    assert step.rows_for(ForwardBatch([SeqInput([5], width * BS, list(range(width + 1)))])) is None  # past them
    narrow = StaticStep(target.net, target.runner.backend, target.kv, CONFIG, 2, SCRATCH)   # max_model_len 16
    narrow.load(ForwardBatch([SeqInput([5], 0, [0])]), 64)     # 63 padding rows on 8 blocks: a table holds them
    assert loaded_target(target_dir, backend="torch").graphs_refused(CONFIG) is not None
    assert target.graphs_refused(GraphConfig()) == "a CPU target (graphs are CUDA's)"
    assert target.graphs_refused(CONFIG) is None


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("drafter", ["ngram", pytest.param("tree:ngram+suffix", marks=pytest.mark.slow)])
def test_the_engine_on_fixed_buffers_decodes_as_plain_decoding(target_dir, drafter, monkeypatch):
    """T=0 speculation through the fixed-buffer steps equals plain eager decoding, the steps do
    run there, and the pool is whole after."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, V, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    prompts[1] = prompts[1][:6] * 3                   # repeats: the n-gram drafter finds drafts
    kw = {"max_model_len": 128, "num_kv_blocks": 64, "block_size": BS, "max_num_seqs": 4,
          "adaptive": AdaptiveConfig(enabled=False), "attention_backend": "triton"}
    plain_llm = LLM(str(target_dir), **kw)
    pin_matmul_paths(plain_llm.engine.target.net)
    plain = [o.token_ids for o in plain_llm.generate(prompts, GREEDY)]
    runs = []
    forward = StaticStep.forward
    monkeypatch.setattr(StaticStep, "forward", lambda self, b, rows: (runs.append(rows), forward(self, b, rows))[1])
    llm = LLM(str(target_dir), drafter=drafter, graphs=CONFIG, **kw)
    pin_matmul_paths(llm.engine.target.net)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert len(runs) >= 8 and max(runs) > 1 and sum(o.stats.verify_steps for o in outs) > 0
    assert llm.engine.blocks.num_used_blocks == 0
    llm.engine.blocks.check_integrity()

"""CUDA graphs on a GPU (`make test-gpu`, issue 63): a replayed step gives the eager step's bits,
the engine decodes the same tokens with graphs as without, for plain decoding and a drafter, and
the graphs' memory stays within what the KV pool's sizing set aside for them."""
import pytest
import torch

from bench.graph_steps import eager_steps, tree_input
from conftest import mtbench_prompts
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from verifier.batch import ForwardBatch, SeqInput
from verifier.graphs.config import GraphConfig

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
FIXED = AdaptiveConfig(enabled=False)


@pytest.fixture(scope="module")
def graphed():
    return LLM(device="cuda", max_num_seqs=8, drafter="ngram", adaptive=FIXED)


@pytest.fixture(scope="module")
def prompts(graphed):
    return [graphed.apply_chat_template([{"role": "user", "content": p}]) for p in mtbench_prompts(8)]


def test_graphs_are_captured_within_their_estimate(graphed):
    target = graphed.engine.target
    graphs = target.runner.static
    assert type(graphs).__name__ == "StepGraphs"
    assert set(graphs.graphs) == set(GraphConfig().buckets)
    assert 0 < graphs.bytes <= target.graph_bytes_estimate(GraphConfig())


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_the_engine_decodes_the_same_tokens_with_graphs(graphed, prompts, drafter):
    eager = LLM(device="cuda", max_num_seqs=8, drafter=drafter, adaptive=FIXED, graphs=GraphConfig(enabled=False))
    assert eager.engine.target.runner.static is None
    want = [o.token_ids for o in eager.generate(prompts, GREEDY)]
    assert [o.token_ids for o in graphed.generate(prompts, GREEDY)] == want
    assert graphed.engine.blocks.num_used_blocks == 0


def test_a_replay_gives_the_eager_bits(graphed):
    target, blocks = graphed.engine.target, graphed.engine.blocks
    vocab, gen = target.config.vocab_size, torch.Generator().manual_seed(0)
    with blocks.scratch(-1, 200 + 16) as table_a, blocks.scratch(-2, 90 + 16) as table_b:
        for table, ctx in ((table_a, 200), (table_b, 90)):
            target.forward(ForwardBatch([SeqInput(torch.randint(100, 40000, (ctx,), generator=gen).tolist(), 0, table)]))
        batch = ForwardBatch([tree_input(11, 200, table_a, vocab, gen), tree_input(1, 90, table_b, vocab, gen)])
        replayed = target.forward(batch)                          # 12 rows: the 16-row graph
        with eager_steps(target):
            eager = target.forward(batch)                         # the eager path, unpadded
    assert torch.equal(replayed.logits, eager.logits)

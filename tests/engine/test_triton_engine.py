"""The engine end to end on the Triton attention backend, on the CPU under TRITON_INTERPRET=1.

These prove the wiring (the backend's metadata, KV writes, tree masks, prefill chunks beside
verify trees, the commit of accepted nodes), not the speed: the interpreter runs every
program instance in Python, so the models are tiny and the runs short. The kernels alone
are compared with torch in tests/kernels/test_triton_kernels.py, and in bf16 / fp16 on a GPU in
tests/gpu/.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed, so its backend cannot be tested")

from conftest import make_tiny_model  # noqa: E402
from drafters.config import SpecConfig  # noqa: E402
from spec import LLM, SamplingParams, Submission  # noqa: E402
from spec.adaptive import AdaptiveConfig  # noqa: E402
from stats import chi_square_pvalue, total_variation  # noqa: E402
from verifier.attention import triton_kernels as tk  # noqa: E402
from verifier.sampling.sampler import target_probs  # noqa: E402

assert tk.INTERPRETED, "triton_kernels was imported before TRITON_INTERPRET=1 was set"

V = 64
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("triton_target"), None, vocab_size=V, hidden_size=32,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, seed=11)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Another random model on the same vocabulary: its drafts are often rejected."""
    return make_tiny_model(tmp_path_factory.mktemp("triton_draft"), None, vocab_size=V, hidden_size=32,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, seed=12)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in (5, 17, 30)]


def make_llm(model_dir, backend: str, **kw) -> LLM:
    # fixed trees: whether drafting pays under the interpreter must not decide what is tested
    kw = {"max_model_len": 128, "num_kv_blocks": 64, "block_size": 8, "max_num_seqs": 4,
          "adaptive": AdaptiveConfig(enabled=False), **kw}
    return LLM(str(model_dir), attention_backend=backend, **kw)


@pytest.fixture(scope="module")
def reference(target_dir, prompts):
    """Plain greedy decoding on the torch backend."""
    return [o.token_ids for o in make_llm(target_dir, "torch").generate(prompts, GREEDY)]


def test_plain_decoding_matches_the_torch_backend(target_dir, prompts, reference):
    llm = make_llm(target_dir, "triton")
    assert type(llm.engine.target.runner.backend).__name__ == "TritonBackend"
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference


def test_speculation_on_a_branching_tree_matches_plain_decoding(target_dir, draft_dir, prompts, reference):
    llm = make_llm(target_dir, "triton", drafter=f"tree:small:{draft_dir}+ngram",
                   speculation=SpecConfig(num_speculative_tokens=3, topk=2, budget=6))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.stats.verify_steps for o in outs) > 0
    assert llm.engine.blocks.num_used_blocks == 0


def test_prefill_chunks_beside_verify_trees(target_dir, draft_dir, prompts, reference):
    """A 16-token budget: the 30-token prompt prefills in chunks while the others verify trees."""
    llm = make_llm(target_dir, "triton", drafter=f"tree:small:{draft_dir}",
                   speculation=SpecConfig(num_speculative_tokens=2, topk=2, budget=4), max_num_batched_tokens=16)
    engine = llm.engine
    for i in (0, 1):
        engine.add_request(str(i), Submission(prompts[i], GREEDY))
    for _ in range(3):
        engine.step()
    engine.add_request("2", Submission(prompts[2], GREEDY))
    done, mixed = {}, 0
    while engine.has_unfinished:
        long, others = engine.requests.get("2"), [engine.requests.get(k) for k in ("0", "1")]
        mixed += long is not None and long.in_prefill and any(r is not None and not r.in_prefill for r in others)
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert [done[str(i)] for i in range(3)] == reference
    assert mixed > 0
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.slow     # 2 minutes in the interpreter; the torch backend runs the same rules in `make test`
def test_sampling_at_t_above_zero_keeps_the_target_distribution(target_dir, prompts):
    """300 seeded requests of 3 tokens, speculating from the second on with a tree of the
    target's own top-2 proposals (some accepted, so accepted nodes are committed). The first token
    (a prefill) and the second (a verify step) each match their law from HF transformers'
    logits by chi-square, p > 0.001; the second's law is the first's mixture of conditionals.
    Rejections are tested on the torch backend, with 10,000 samples of the joint law, in
    tests/engine/test_speculative_exactness.py."""
    from transformers import AutoModelForCausalLM
    params = dict(temperature=0.9, top_k=16, max_tokens=3, ignore_eos=True)
    prompt, n = prompts[0], 300
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    ids = torch.cat([torch.tensor(prompt).expand(V, -1), torch.arange(V)[:, None]], 1)
    with torch.no_grad():
        logits = hf(ids).logits
    p1 = target_probs(logits[0, -2][None], SamplingParams(**params))[0]           # [V]
    p2 = p1 @ target_probs(logits[:, -1], SamplingParams(**params))               # [V], t1 summed out
    llm = make_llm(target_dir, "triton", drafter=f"tree:small:{target_dir}", max_num_seqs=150, num_kv_blocks=600,
                   speculation=SpecConfig(num_speculative_tokens=2, topk=2, budget=4))
    outs = llm.generate([prompt] * n, [SamplingParams(seed=i, **params) for i in range(n)])
    toks = torch.tensor([o.token_ids for o in outs])
    for pos, law in ((0, p1), (1, p2)):
        counts = torch.bincount(toks[:, pos], minlength=V)
        p = chi_square_pvalue(counts, law)
        print(f"triton backend, token {pos + 1}: chi-square p = {p:.3g}, TV = {total_variation(counts, law):.3f}")
        assert p > 1e-3
    assert sum(o.stats.accepted_tokens for o in outs) > n // 10        # verify steps accepted nodes
    assert llm.engine.blocks.num_used_blocks == 0

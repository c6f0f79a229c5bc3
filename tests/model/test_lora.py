"""LoRA adapters in PEFT's format served beside the base (verifier/model/lora.py): the adapted
model's tokens, whichever rows share a step and whichever drafter drafts; prefix caches kept
apart per adapter; adapters that do not fit refused with the file and the field named.

Adapters are made with PEFT (tests/lora_cases.py; `init_lora_weights=False`: A and B both random, so
the adapter changes the model) over tiny random models built with transformers' own classes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model
from drafters.base import Prediction
from drafters.config import SpecConfig
from lora_cases import ATTN_MLP, GREEDY, PROMPTS, import_peft, make_adapter
from pinned import WHOLE_TREES
from spec import LLM
from verifier.batch import ForwardBatch, SeqInput
from verifier.sampling.sampling_params import SamplingParams

FUSED = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
CHAIN = SpecConfig(num_speculative_tokens=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lora_base"), None)


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": str(make_adapter(tiny, root / "a", ATTN_MLP, seed=1)),
            "b": str(make_adapter(tiny, root / "b", ["q_proj", "v_proj", "down_proj"], r=4, seed=2,
                                  use_rslora=True))}


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def _hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF's greedy tokens, EOS not stopping them (as ignore_eos; min_new_tokens would mask it)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3"])
def test_adapted_greedy_tokens_are_hf_peft_models(tmp_path, model_type):
    """Dense base: greedy tokens under an adapter equal PEFT's PeftModel.generate, the base's
    equal the base's; the adapter changes them (Phi-3's fused qkv and gate_up adapted whole)."""
    import transformers
    base = make_tiny_model(tmp_path / "base", None, model_type, **({"pad_token_id": 0} if model_type == "phi3" else {}))
    path = make_adapter(base, tmp_path / "adapter", FUSED.get(model_type, ATTN_MLP))
    llm = LLM(model=str(base), quantization="none", lora_modules={"x": str(path)}, num_kv_blocks=64)
    ours = _tokens(llm.generate(PROMPTS, GREEDY, lora="x"))
    plain = _tokens(llm.generate(PROMPTS, GREEDY))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    assert plain == _hf_greedy(hf, PROMPTS, GREEDY.max_tokens)
    adapted = import_peft().PeftModel.from_pretrained(hf, str(path)).eval()
    assert ours == _hf_greedy(adapted, PROMPTS, GREEDY.max_tokens)
    assert ours != plain


def test_mixed_batches_equal_each_request_alone_on_the_int4_base(tiny, adapters):
    """Rows of two adapters and of the base in one step give each request the tokens it gets
    alone; each adapter changes its requests' tokens."""
    llm = LLM(model=str(tiny), quantization="int4", lora_modules=adapters, num_kv_blocks=128)
    names = ["a", None, "b", "a"]
    mixed = _tokens(llm.generate(PROMPTS, GREEDY, lora=names))
    alone = [llm.generate([p], GREEDY, lora=n)[0].token_ids for p, n in zip(PROMPTS, names)]
    assert mixed == alone
    base = _tokens(llm.generate(PROMPTS, GREEDY))
    assert mixed[1] == base[1] and mixed[0] != base[0] and mixed[2] != base[2]


@pytest.mark.parametrize("kernel", ["add", "add_c"])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(tiny, adapters, kernel):
    """Bitwise: an adapter's delta on a row alone, among 5 and among 40 rows of random inputs,
    by torch and by the C kernel (whose chunks of rows share each read of the weights)."""
    from verifier.model.lora import LoraSet
    from verifier.target import load_config
    lora = LoraSet(load_config(tiny))
    slot = lora.load("a", adapters["a"])
    x = torch.randn(40, 64).bfloat16()

    def delta(rows: torch.Tensor) -> torch.Tensor:
        with lora.rows([slot] * rows.shape[0], torch.device("cpu")):
            return getattr(lora, kernel)(0, "qkv_proj", rows, torch.zeros(rows.shape[0], 128, dtype=torch.bfloat16))
    whole = delta(x)
    assert torch.equal(delta(x[3:4]), whole[3:4]) and torch.equal(delta(x[1:6]), whole[1:6])
    assert whole.abs().sum() > 0


def test_the_native_loop_adds_the_products_the_python_layers_add(tiny, adapters):
    """Bitwise: rows under two adapters and the base, as sampled rows, through the C++ layer loop
    (csrc/decode_loop.cpp) and through the Python layers."""
    llm = LLM(model=str(tiny), quantization="int4", lora_modules=adapters, num_kv_blocks=64)
    runner = llm.engine.target.runner
    assert runner.native is not None
    batch = ForwardBatch([SeqInput([5, 9, 11], 0, [0], logits_indices=[0, 1, 2], sampled_from=0, adapter=1),
                          SeqInput([7], 0, [1], adapter=0), SeqInput([3, 4], 0, [2], logits_indices=[0, 1],
                                                                     sampled_from=0, adapter=2)])
    native = llm.engine.target.forward(batch).logits
    runner.native = None
    assert torch.equal(llm.engine.target.forward(batch).logits, native)


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "eagle3", "tree", "prediction"])
def test_speculation_under_an_adapter_gives_the_adapted_tokens(tiny, adapters, drafter, tmp_path):
    """T=0: a drafter's steps under adapters, in a mixed batch, give plain decoding's tokens: those
    drafting from the text, an EAGLE-3 head and a small model drafting for the base, and each
    request's prediction (the plain reply with a wrong token in its middle)."""
    from conftest import make_random_eagle_head
    prompts = [p * 3 for p in PROMPTS]
    names = ["a", "b", None, "a"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(model=str(tiny), quantization="int4", lora_modules=adapters, num_kv_blocks=128)
    plain = _tokens(LLM(**kw).generate(prompts, params, lora=names))
    spec, predictions = {"eagle3": f"eagle3:{make_random_eagle_head(tiny, tmp_path / 'head', draft_vocab=64)}",
                         "tree": f"tree:small:{tiny}+ngram", "prediction": None}.get(drafter, drafter), None
    if drafter == "prediction":
        predictions = [Prediction(tuple(t[:10] + [(t[10] + 1) % 256] + t[11:])) for t in plain]
    drafted = LLM(**kw, drafter=spec, adaptive=WHOLE_TREES).generate(prompts, params, predictions, lora=names)
    assert _tokens(drafted) == plain
    assert sum(o.stats.verify_steps for o, n in zip(drafted, names) if n) > 0


def test_prefix_cache_is_kept_apart_per_adapter(tiny, adapters):
    """A prompt cached under one adapter is never reused under another or the base (their
    tokens are those of a fresh engine), and is reused under the same adapter."""
    prompt = list(range(100, 100 + 40))        # two full blocks and a part
    llm = LLM(model=str(tiny), quantization="int4", lora_modules=adapters, num_kv_blocks=128)
    first = llm.generate([prompt], GREEDY, lora="a")[0]
    again, other, base = (llm.generate([prompt], GREEDY, lora=n)[0] for n in ("a", "b", None))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32 and again.token_ids == first.token_ids
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    fresh = LLM(model=str(tiny), quantization="int4", lora_modules=adapters, num_kv_blocks=128)
    assert other.token_ids == fresh.generate([prompt], GREEDY, lora="b")[0].token_ids
    assert base.token_ids == fresh.generate([prompt], GREEDY)[0].token_ids


def test_adapters_that_do_not_fit_are_refused_naming_the_file_and_field(tiny, adapters, tmp_path):
    from verifier.model.lora import LoraSet
    from verifier.target import load_config
    lora = LoraSet(load_config(tiny), max_loras=1, max_rank=4)
    with pytest.raises(ValueError, match="rank 8, above max_lora_rank 4"):
        lora.load("a", adapters["a"])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        lora.load("x", tmp_path)
    other = make_tiny_model(tmp_path / "other", None, hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: layer 0 q_proj: lora_A \(8, 32\)"):
        LoraSet(load_config(tiny)).load("y", make_adapter(other, tmp_path / "small", ["q_proj"]))
    dora = Path(adapters["b"]).parent / "dora"
    dora.mkdir()
    cfg = json.loads((Path(adapters["b"]) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="adapter_config.json: use_dora is set"):
        LoraSet(load_config(tiny)).load("d", dora)
    assert lora.load("b", adapters["b"]) == 1
    with pytest.raises(ValueError, match="all 1 slots"):
        lora.load("c", adapters["b"])
    llm = LLM(model=str(tiny), quantization="int4", num_kv_blocks=64)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a': this engine serves none"):
        llm.generate([PROMPTS[0]], GREEDY, lora="a")


@pytest.fixture(scope="module")
def law_case(tmp_path_factory):
    """The 32-token model of the exactness tests, an adapter of it, the prompt, the adapted
    model's exact law of three tokens, and the base's."""
    import transformers
    from exactness_cases import PARAMS, V, exact_joint_for, make_prompt
    root = tmp_path_factory.mktemp("lora_law")
    base = make_tiny_model(root / "v32", None, vocab_size=V, hidden_size=32, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, seed=3)
    adapter = make_adapter(base, root / "adapter", ATTN_MLP, seed=7)
    prompt = make_prompt(base)
    params = SamplingParams(**PARAMS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    base_law = exact_joint_for(base, prompt, params, hf)
    law = exact_joint_for(base, prompt, params, import_peft().PeftModel.from_pretrained(hf, str(adapter)).eval())
    return base, adapter, prompt, params, law, base_law


def _adapted_counts(case) -> tuple[torch.Tensor, int]:
    """Counts of the first three tokens of N_SAMPLES seeded requests under the adapter, the base
    drafting for it (`small:`), and the drafts it accepted."""
    from dataclasses import replace

    from exactness_cases import N_SAMPLES, V
    base, adapter, prompt, params, _, _ = case
    llm = LLM(str(base), max_model_len=64, num_kv_blocks=2048, block_size=4, max_num_seqs=500,
              drafter=f"small:{base}", speculation=CHAIN, lora_modules={"x": str(adapter)}, adaptive=WHOLE_TREES)
    outs = llm.generate([prompt] * N_SAMPLES, [replace(params, seed=i) for i in range(N_SAMPLES)], lora="x")
    toks = torch.tensor([o.token_ids for o in outs])
    assert llm.engine.blocks.num_used_blocks == 0
    return torch.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V ** 3), \
        sum(o.stats.accepted_tokens for o in outs)


def test_sampling_under_an_adapter_follows_the_adapted_models_law(law_case):
    """T > 0: the base drafts, the adapted target verifies: the tokens follow the adapted model's
    law (PEFT's logits), not the base's."""
    from stats import chi_square_pvalue
    counts, accepted = _adapted_counts(law_case)
    law, base_law = law_case[4], law_case[5]
    assert accepted >= 300 and chi_square_pvalue(counts, law) > 1e-3
    assert chi_square_pvalue(counts, base_law) < 1e-3


@pytest.mark.slow
def test_verifying_trees_without_the_adapter_fails_the_same_test(law_case, monkeypatch):
    """The control: tree nodes verified by the base (the adapter dropped from masked inputs),
    plain steps under the adapter: the law is no longer the adapted model's."""
    import spec.verification as verification_module
    from stats import chi_square_pvalue

    def base_trees(*args, adapter: int = 0, **kw):
        return SeqInput(*args, adapter=0 if kw.get("mask") is not None else adapter, **kw)
    monkeypatch.setattr(verification_module, "SeqInput", base_trees)
    counts, _ = _adapted_counts(law_case)
    assert chi_square_pvalue(counts, law_case[4]) < 1e-3


# Under `make test-slow` (about 20 s, two models of the default's size); in `make test` the int4
# base under an adapter is held to HF PEFT on tiny models (below) and the base to its own gate.
@pytest.mark.slow
def test_the_int4_base_with_an_adapter_passes_the_quality_gate(smollm2_dir, tmp_path):
    """The default model in int4 under an adapter against its fp32 weights under the same adapter
    (the dense path, PEFT's model on the tiny ones above), teacher-forced on 8 held-out replies:
    top-1 agreement >= 99%, perplexity ratio <= 1.01, as the base's own gate. The adapter: PEFT's
    random A and B (scaled to a fine-tune's size) on every projection."""
    import transformers
    from bench.quality import compare, heldout_conversations
    from conftest import shared_data
    from verifier.target import TargetModel
    heldout = shared_data("heldout/gsm8k_test.jsonl")
    cfg = transformers.AutoConfig.from_pretrained(str(smollm2_dir))
    torch.manual_seed(0)
    lora = import_peft().get_peft_model(transformers.LlamaForCausalLM(cfg), import_peft().LoraConfig(
        r=16, lora_alpha=32, target_modules=ATTN_MLP, init_lora_weights=False))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.mul_(0.02)
    lora.save_pretrained(str(tmp_path / "adapter"))
    models = [TargetModel(str(smollm2_dir), quantization=q) for q in ("none", "int4")]
    for m in models:
        m.enable_lora(1, 16).load("x", tmp_path / "adapter")
    convs = heldout_conversations(models[0].tokenizer, 8, path=heldout)
    q = compare(*models, convs, adapter=1)
    base = compare(*models, convs)
    print(f"{q.positions} positions: agreement {q.agreement:.4f} (base {base.agreement:.4f}), "
          f"perplexity ratio {q.ppl_ratio:.4f}; adapted {q.ref_ppl:.3f}, base {base.ref_ppl:.3f}")
    assert q.positions > 500 and q.agreement >= 0.99 and q.ppl_ratio <= 1.01
    assert abs(q.ref_ppl - base.ref_ppl) > 1e-3           # the adapter changes the model


@pytest.mark.parametrize("model_type", ["qwen3", "phi3"])
def test_the_int4_base_under_an_adapter_is_close_to_hf_peft(tmp_path, model_type):
    """Tiny Qwen3 (q/k norms) and Phi-3 (fused qkv and gate_up as stored) in int4 under an adapter:
    logits within the int4 tolerance of HF PeftModel's with the same adapter (test_model_families'),
    and far nearer them than the base's; a row under it is bitwise the same beside a base row."""
    import transformers
    from model_cases import FAMILIES, jitter_norms
    from verifier.target import TargetModel
    base = jitter_norms(make_tiny_model(tmp_path / "base", None, **FAMILIES[model_type]))
    path = make_adapter(base, tmp_path / "adapter", FUSED.get(model_type, ATTN_MLP))
    ids = list(range(10, 40))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.no_grad():
        plain = hf(torch.tensor([ids])).logits[0]
        want = import_peft().PeftModel.from_pretrained(hf, str(path)).eval()(torch.tensor([ids])).logits[0]
    target = TargetModel(str(base), quantization="int4")
    slot = target.enable_lora(1, 16).load("x", path)
    target.allocate_kv(8, 16)
    seqs = [SeqInput(ids, 0, [0, 1], logits_indices=list(range(len(ids))), adapter=slot)]
    got = target.forward(ForwardBatch(seqs)).logits
    beside = target.forward(ForwardBatch([*seqs, SeqInput(ids[:9], 0, [2, 3], logits_indices=[8])])).logits
    error, moved = ((got - want).norm() / want.norm()).item(), ((plain - want).norm() / want.norm()).item()
    print(f"{model_type}: int4 under the adapter {error:.3f} from PEFT's logits, the base {moved:.3f}")
    assert error < 0.3 and error < moved / 3
    assert torch.equal(beside[:len(ids)], got)


def test_a_small_drafter_drafts_under_its_own_adapter(tiny, adapters):
    """T=0, a mixed batch: the `small:` drafter (the model drafting for itself) gives plain
    decoding's tokens whether it drafts for the base or under its own copy of each adapter, and
    its own adapters raise acceptance (every draft verified whole, so the drafts alone differ)."""
    prompts, names = PROMPTS, ["a", "b", None, "a"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(model=str(tiny), quantization="int4", lora_modules=adapters, num_kv_blocks=128)
    plain = _tokens(LLM(**kw).generate(prompts, params, lora=names))
    accepted = []
    for own in ({}, adapters):
        llm = LLM(**kw, drafter=f"small:{tiny}", draft_lora_modules=own, adaptive=WHOLE_TREES)
        outs = llm.generate(prompts, params, lora=names)
        assert _tokens(outs) == plain
        accepted.append(sum(o.stats.accepted_tokens for o, n in zip(outs, names) if n))
    assert accepted[1] > accepted[0]


def test_draft_adapters_need_a_served_name_and_a_drafter_with_a_model(tiny, adapters):
    kw = dict(model=str(tiny), quantization="int4", lora_modules={"a": adapters["a"]}, num_kv_blocks=64)
    with pytest.raises(ValueError, match="'b', an adapter lora_modules does not serve"):
        LLM(**kw, drafter=f"small:{tiny}", draft_lora_modules={"b": adapters["b"]})
    with pytest.raises(ValueError, match="the ngram drafter has no model of its own"):
        LLM(**kw, drafter="ngram", draft_lora_modules={"a": adapters["a"]})


def test_an_eagle3_drafter_drafts_an_adapters_requests_with_its_own_head(tiny, adapters, tmp_path):
    """T=0, a mixed batch: with a head given for adapter a (draft_lora_modules), a's requests are
    drafted by that head and the others by the base's, and the tokens stay plain decoding's."""
    from conftest import make_random_eagle_head
    prompts, names = [p * 3 for p in PROMPTS], ["a", "b", None, "a"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(model=str(tiny), quantization="int4", lora_modules=adapters, num_kv_blocks=128)
    plain = _tokens(LLM(**kw).generate(prompts, params, lora=names))
    base, own = (make_random_eagle_head(tiny, tmp_path / n, draft_vocab=64, seed=s) for n, s in (("base", 0), ("a", 1)))
    llm = LLM(**kw, drafter=f"eagle3:{base}", draft_lora_modules={"a": str(own)}, adaptive=WHOLE_TREES)
    drafter, seen = llm.engine.drafter, set()
    propose_one = drafter._propose_one

    def recording(r):
        prop = propose_one(r)
        if r.seq_id in drafter.state:
            seen.add((r.adapter, drafter.state[r.seq_id].head is drafter.heads["a"]))
        return prop
    drafter._propose_one = recording
    outs = llm.generate(prompts, params, lora=names)
    assert _tokens(outs) == plain
    assert seen == {("a", True), ("b", False), (None, False)}
    assert sum(o.stats.verify_steps for o in outs) > 0


def test_datastore_drafting_under_an_adapter_gives_the_adapted_tokens(tiny_llama_dir, tmp_path):
    """T=0, a mixed batch on a model with a tokenizer: a datastore of the adapted replies drafts
    them back, and the tokens stay plain decoding's under the adapter and on the base."""
    from conftest import write_reply_corpus
    adapter = make_adapter(tiny_llama_dir, tmp_path / "a", ["q_proj", "v_proj"])
    prompts, names = [p * 3 for p in PROMPTS], ["a", None, "a", None]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(model=str(tiny_llama_dir), quantization="int4", lora_modules={"a": str(adapter)}, num_kv_blocks=128)
    llm = LLM(**kw)
    plain = _tokens(llm.generate(prompts, params, lora=names))
    corpus = write_reply_corpus(tmp_path / "replies.jsonl", llm, plain)
    drafted = LLM(**kw, drafter=f"datastore:{corpus}", adaptive=WHOLE_TREES).generate(prompts, params, lora=names)
    assert _tokens(drafted) == plain
    assert sum(o.stats.accepted_tokens for o, n in zip(drafted, names) if n) > 0

"""Qwen3 (per-head RMSNorm of q and k before RoPE) and Phi-3 (fused projections as stored) on
every CPU path: the quantized kernels close to the dense weights with decode rows bitwise the
same alone and batched, T=0 speculation equal to plain decoding, and GGUFs of both read by their
own names. The dense forward against HF transformers: test_model_parity.py."""
from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import make_tiny_model
from model_cases import BLOCK, FAMILIES, TINY_FIELDS, converted, hf_logits, jitter_norms, logits, write_gguf
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from verifier.batch import ForwardBatch, SeqInput
from verifier.target import TargetModel


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    return jitter_norms(make_tiny_model(tmp_path_factory.mktemp(request.param), None, **FAMILIES[request.param]))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return jitter_norms(make_tiny_model(tmp_path_factory.mktemp("qwen3"), None, **FAMILIES["qwen3"]))


@pytest.mark.parametrize("mode,tol", [("int8", 0.05), ("int4", 0.3)])
def test_quantized_is_close_to_dense_and_rows_do_not_depend_on_neighbours(family_dir, mode, tol):
    ids = list(range(10, 40))
    want = logits(TargetModel(str(family_dir), quantization="none"), ids)
    target = TargetModel(str(family_dir), quantization=mode)
    got = logits(target, ids)
    assert (got - want).norm() / want.norm() < tol
    target.allocate_kv(8, BLOCK)
    target.forward(ForwardBatch([SeqInput(ids, 0, [0, 1], logits_indices=[])]))
    target.forward(ForwardBatch([SeqInput(ids[:9], 0, [2, 3], logits_indices=[])]))
    alone = target.forward(ForwardBatch([SeqInput([7], len(ids), [0, 1])])).logits[0]
    batched = target.forward(ForwardBatch([SeqInput([9, 4, 2], 9, [2, 3]), SeqInput([7], len(ids), [0, 1])]))
    assert torch.equal(batched.logits[-1], alone)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_greedy_speculation_gives_plain_decoding_tokens(family_dir, quantization):
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] * 2 for n in (5, 9, 13)]     # repeats to draft from
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(max_model_len=256, num_kv_blocks=64, quantization=quantization)
    plain = [o.token_ids for o in LLM(str(family_dir), **kw).generate(prompts, greedy)]
    llm = LLM(str(family_dir), drafter="suffix", adaptive=AdaptiveConfig(enabled=False), **kw)
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.stats.verify_steps for o in outs) > 0


def test_a_qwen3_gguf_loads_by_its_own_names(qwen3_dir, tmp_path):
    """A GGUF of architecture qwen3 (head size in attention.key_length, q/k norms as attn_q_norm /
    attn_k_norm) gives back the checkpoint's config and tensors."""
    from safetensors.torch import load_file

    from verifier.model.gguf_convert import gguf_config, gguf_tensors
    tensors = load_file(str(qwen3_dir / "model.safetensors"))
    reader = write_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3", tensors,
                        {**TINY_FIELDS, "attention.key_length": 32, "rope.freq_base": 1e6})
    cfg = gguf_config(reader)
    assert (cfg["model_type"], cfg["architectures"], cfg["head_dim"]) == ("qwen3", ["Qwen3ForCausalLM"], 32)
    back = gguf_tensors(reader, cfg)
    assert set(back) == set(tensors) and all(torch.equal(back[n], tensors[n]) for n in tensors)


def test_a_phi3_gguf_serves_its_fused_q8_0_blocks(tmp_path):
    """A Phi-3 GGUF stores qkv and gate+up fused (attn_qkv, ffn_up), here as Q8_0 blocks: they load
    by those names, the int8 path serves the file's blocks, and the logits stay close to HF's."""
    from safetensors.torch import load_file

    from verifier.model.gguf_convert import gguf_config
    from verifier.model.gguf_quant import INDEX_FILE, read_quantized
    hf_dir = jitter_norms(make_tiny_model(tmp_path / "hf", None, **FAMILIES["phi3"]))
    path = tmp_path / "tiny-phi3.gguf"
    reader = write_gguf(path, "phi3", load_file(str(hf_dir / "model.safetensors")),
                        {**TINY_FIELDS, "attention.sliding_window": 2047}, q8_0=True)
    cfg = gguf_config(reader)
    assert (cfg["model_type"], cfg["sliding_window"]) == ("phi3", 2047)
    model = converted(reader, path, tmp_path / "converted")
    blocks = read_quantized(json.loads((model / INDEX_FILE).read_text()), cfg)
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"} <= set(blocks)
    from verifier.quantized.quantize import _projection          # the file's fused blocks, not a requantized copy
    fused = blocks["model.layers.0.self_attn.qkv_proj.weight"]
    served = _projection(blocks, "model.layers.0.self_attn", "qkv_proj", torch.zeros(1), "int8")
    assert torch.equal(served.q, fused.q) and torch.equal(served.scale, fused.scale)
    ids = list(range(10, 40))
    want = hf_logits(hf_dir, ids)
    got = logits(TargetModel(str(model), quantization="int8", load_tokenizer_files=False), ids)
    assert (got - want).norm() / want.norm() < 0.05


def test_generation_config_eos_ids_end_a_reply(qwen3_dir, tmp_path):
    """An eos id listed only in generation_config.json (as Llama 3 and Phi-3 list end-of-turn
    tokens) ends a reply where the model emits it."""
    import shutil
    prompt = [[11, 12, 13, 14]]
    free = LLM(str(qwen3_dir), max_model_len=128, num_kv_blocks=32).generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop = free[4]
    model = shutil.copytree(qwen3_dir, tmp_path / "with-generation-config")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    out = LLM(str(model), max_model_len=128, num_kv_blocks=32).generate(
        prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.token_ids[-1] == stop and len(out.token_ids) == free.index(stop) + 1
    assert out.finish_reason == "stop"

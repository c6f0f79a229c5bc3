"""Qwen3 (per-head RMSNorm of q and k before RoPE) and Phi-3 (fused projections as stored) on
every CPU path: the quantized kernels close to the dense weights with decode rows bitwise the
same alone and batched, T=0 speculation equal to plain decoding, and a GGUF of architecture
qwen3 read by its own names. The dense forward against HF transformers: test_model_parity.py."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import make_tiny_model
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from test_model_parity import jitter_norms
from verifier.batch import ForwardBatch, SeqInput
from verifier.target import TargetModel

BLOCK = 16


FAMILIES = {"qwen3": dict(model_type="qwen3", head_dim=32), "phi3": dict(model_type="phi3", pad_token_id=0)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    return jitter_norms(make_tiny_model(tmp_path_factory.mktemp(request.param), None, **FAMILIES[request.param]))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return jitter_norms(make_tiny_model(tmp_path_factory.mktemp("qwen3"), None, **FAMILIES["qwen3"]))


def logits(target, ids, beside=None):
    """Logits of every position of ids, alone or in one forward beside another sequence."""
    target.allocate_kv(8, BLOCK)
    seqs = [SeqInput(ids, 0, [0, 1], logits_indices=list(range(len(ids))))]
    if beside:
        seqs.append(SeqInput(beside, 0, [2, 3], logits_indices=[len(beside) - 1]))
    return target.forward(ForwardBatch(seqs)).logits[:len(ids)]


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
    """A GGUF of architecture qwen3 (written here with gguf-py, head size in attention.key_length,
    q/k norms as attn_q_norm / attn_k_norm) gives back the checkpoint's config and tensors."""
    import gguf
    from safetensors.torch import load_file

    from verifier.gguf_convert import _LAYER_NAMES, _TOP_NAMES, gguf_config, gguf_tensors
    tensors = load_file(str(qwen3_dir / "model.safetensors"))
    path = tmp_path / "tiny-qwen3.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    for key, value in (("block_count", 2), ("context_length", 1024), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("attention.head_count", 4), ("attention.head_count_kv", 2),
                       ("attention.key_length", 32)):
        w.add_uint32(f"qwen3.{key}", value)
    w.add_float32("qwen3.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("qwen3.rope.freq_base", 1e6)
    w.add_token_list([f"t{i}" for i in range(256)])
    for name, t in tensors.items():
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            idx, part = base[len("model.layers."):].split(".", 1)
            g = f"blk.{idx}.{next(k for k, v in _LAYER_NAMES.items() if v == part)}"
        else:
            g = next(k for k, v in _TOP_NAMES.items() if v == base)
        w.add_tensor(f"{g}.{kind}", t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(path))
    cfg = gguf_config(reader)
    assert (cfg["model_type"], cfg["architectures"], cfg["head_dim"]) == ("qwen3", ["Qwen3ForCausalLM"], 32)
    back = gguf_tensors(reader, cfg)
    assert set(back) == set(tensors) and all(torch.equal(back[n], tensors[n]) for n in tensors)


def test_generation_config_eos_ids_end_a_reply(qwen3_dir, tmp_path):
    """An eos id listed only in generation_config.json (as Llama 3 and Phi-3 list end-of-turn
    tokens) ends a reply where the model emits it."""
    import json
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

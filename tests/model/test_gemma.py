"""Gemma 2 and Gemma 3 (text) on every path: HF parity of the dense forward with prompts longer
than a tiny sliding window, soft-capping small enough to matter and jittered norms; the quantized
CPU kernels close to the dense weights with decode rows bitwise the same alone and batched; T=0
speculation equal to plain decoding; a GGUF of each read back to HF's logits; the Triton kernel's
window and soft-capping under the interpreter; refusals by name."""
from __future__ import annotations

import random

import pytest
import torch

from gemma_cases import PROMPT, VARIANTS, WINDOW, make_gemma
from model_cases import hf_logits, own_logits_chunked
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from verifier.batch import ForwardBatch, SeqInput
from verifier.target import TargetModel

BLOCK = 16
@pytest.fixture(scope="module", params=list(VARIANTS))
def gemma_dir(request, tmp_path_factory):
    return make_gemma(tmp_path_factory.mktemp(request.param), request.param)


def test_dense_forward_matches_hf(gemma_dir):
    """Logits at every position equal HF's (eager attention) within 1e-4, argmax equal, with
    prefill and decode chunks over a shuffled paged cache: the window, the soft-caps, the four
    norms, GeGLU, the embedding scale and (Gemma 3) the q/k norms and two RoPE tables all count."""
    ref = hf_logits(gemma_dir, PROMPT)
    target = TargetModel(str(gemma_dir), device="cpu", load_tokenizer_files=False)
    ours = own_logits_chunked(target, PROMPT, [20, 1, 1, 7, 8])
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4, diff
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def logits(target, ids, beside=None):
    """Logits of every position of ids, alone or in one forward beside another sequence."""
    target.allocate_kv(8, BLOCK)
    seqs = [SeqInput(ids, 0, [0, 1, 2], logits_indices=list(range(len(ids))))]
    if beside:
        seqs.append(SeqInput(beside, 0, [3, 4], logits_indices=[len(beside) - 1]))
    return target.forward(ForwardBatch(seqs)).logits[:len(ids)]


# int4 groups of 32 over four layers: a four-layer Llama of these shapes is 0.25 away too
@pytest.mark.parametrize("mode,tol", [("int8", 0.05), ("int4", 0.35)])
def test_quantized_is_close_to_dense_and_rows_do_not_depend_on_neighbours(gemma_dir, mode, tol):
    """int8 / int4 kernels within `tol` (relative norm) of the dense weights over a 37-token
    prompt; a decode row after it has the same bits alone and beside a 3-token chunk."""
    want = logits(TargetModel(str(gemma_dir), quantization="none"), PROMPT)
    target = TargetModel(str(gemma_dir), quantization=mode)
    got = logits(target, PROMPT)
    assert (got - want).norm() / want.norm() < tol
    target.allocate_kv(8, BLOCK)
    target.forward(ForwardBatch([SeqInput(PROMPT, 0, [0, 1, 2], logits_indices=[])]))
    target.forward(ForwardBatch([SeqInput(PROMPT[:9], 0, [3, 4], logits_indices=[])]))
    alone = target.forward(ForwardBatch([SeqInput([7], len(PROMPT), [0, 1, 2])])).logits[0]
    batched = target.forward(ForwardBatch([SeqInput([9, 4, 2], 9, [3, 4]), SeqInput([7], len(PROMPT), [0, 1, 2])]))
    assert torch.equal(batched.logits[-1], alone)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_greedy_speculation_gives_plain_decoding_tokens(gemma_dir, quantization):
    """T=0 suffix speculation (every step drafts) gives plain decoding's tokens, past the window."""
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] * 2 for n in (5, 9, 13)]     # repeats to draft from
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(max_model_len=256, num_kv_blocks=64, quantization=quantization)
    plain = [o.token_ids for o in LLM(str(gemma_dir), **kw).generate(prompts, greedy)]
    llm = LLM(str(gemma_dir), drafter="suffix", adaptive=AdaptiveConfig(enabled=False), **kw)
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.stats.verify_steps for o in outs) > 0


def write_gemma_gguf(path, arch: str, model_dir, fields: dict):
    """A GGUF of `arch` as llama.cpp's converter writes a Gemma: the HF tensors under their GGUF
    names, every norm weight with 1 added, q/k as they are, no output.weight (tied)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from verifier.model.gguf_names import _FUSED_LAYER_NAMES, _LAYER_NAMES, _TOP_NAMES
    layer = {hf: g for g, hf in {**_LAYER_NAMES, **_FUSED_LAYER_NAMES["gemma2"]}.items()}
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    w.add_token_list([f"t{i}" for i in range(256)])
    w.add_eos_token_id(2)
    w.add_uint32("tokenizer.ggml.eot_token_id", 106)
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            idx, part = base[len("model.layers."):].split(".", 1)
            g = f"blk.{idx}.{layer[part]}"
        else:
            g = next(k for k, v in _TOP_NAMES.items() if v == base)
        w.add_tensor(f"{g}.{kind}", (t + 1 if name.endswith("norm.weight") else t).numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


def gguf_fields(model_type: str) -> dict:
    shapes = {"block_count": 4, "context_length": 1024, "embedding_length": 64, "feed_forward_length": 128,
              "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 32,
              "attention.value_length": 32, "attention.layer_norm_rms_epsilon": 1e-5,
              "attention.sliding_window": WINDOW}
    if model_type == "gemma2":   # gemma2's pattern is fixed (alternating), as HF's default
        return {**shapes, "rope.freq_base": 10000.0, **{k: float(v) for k, v in VARIANTS["gemma2"].items()
                                                         if k.endswith("softcapping")}}
    return {**shapes, "rope.freq_base": 1e6, "attention.sliding_window_pattern": 2}


@pytest.mark.parametrize("model_type", list(VARIANTS))
def test_a_gemma_gguf_reads_back_to_hf_logits(tmp_path, model_type):
    """A gemma2 / gemma3 GGUF (llama.cpp's names, norms stored as 1 + w, query_pre_attn_scalar
    inferred as llama.cpp does: the head size) converts to a checkpoint with HF's logits, its
    end-of-turn id among the eos ids."""
    import json

    from safetensors.torch import save_file

    from verifier.model.gguf_convert import gguf_config, gguf_tensors
    # the file can only say what llama.cpp reads: scale by head size, Gemma 3's layers alternating here
    hf_dir = make_gemma(tmp_path / "hf", model_type, query_pre_attn_scalar=32,
                        **({} if model_type == "gemma2" else {"layer_types": None, "sliding_window_pattern": 2,
                                                              "rope_parameters": None}))
    arch = "gemma2" if model_type == "gemma2" else "gemma3"
    reader = write_gemma_gguf(tmp_path / f"tiny-{arch}.gguf", arch, hf_dir, gguf_fields(model_type))
    cfg = gguf_config(reader)
    assert (cfg["model_type"], cfg["eos_token_id"]) == (model_type, [2, 106])
    model = tmp_path / "converted"
    model.mkdir()
    save_file(gguf_tensors(reader, cfg), str(model / "model.safetensors"))
    (model / "config.json").write_text(json.dumps(cfg))
    target = TargetModel(str(model), device="cpu", load_tokenizer_files=False)
    assert target.config.gemma.sliding == (True, False, True, False)
    ours = own_logits_chunked(target, PROMPT, [30, 7])
    ref = hf_logits(hf_dir, PROMPT)
    assert (ours - ref).abs().max().item() < 1e-4


def test_config_reads_hf_defaults_and_old_forms():
    """Which layers slide and each RoPE table, from transformers>=5 configs and from the older
    files (no layer_types; Gemma 3's rope_theta, rope_scaling, rope_local_base_freq), equal
    transformers' own reading; the context is not capped at the window."""
    import transformers
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from verifier.model.config import ModelConfig
    from verifier.model.rope import inv_freq_and_scale
    old2 = dict(model_type="gemma2", vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=5,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=4096,
                max_position_embeddings=8192)
    hf2 = transformers.Gemma2Config(**{k: v for k, v in old2.items() if k != "model_type"})
    for d in (old2, hf2.to_dict()):
        cfg = ModelConfig.from_hf(d)
        assert cfg.gemma.sliding == tuple(t == "sliding_attention" for t in hf2.layer_types) == (1, 0, 1, 0, 1)
        assert (cfg.max_position, cfg.sliding_window, cfg.gemma.window) == (8192, None, 4096)
    old3 = dict(old2, model_type="gemma3_text", num_hidden_layers=13, rope_theta=1e6, rope_local_base_freq=1e4,
                rope_scaling={"rope_type": "linear", "factor": 8.0})
    hf3 = transformers.Gemma3TextConfig(**{k: v for k, v in old3.items() if k != "model_type"})
    rotary = Gemma3RotaryEmbedding(hf3)
    for d in (old3, hf3.to_dict()):
        cfg = ModelConfig.from_hf(d)
        assert cfg.gemma.sliding == tuple(t == "sliding_attention" for t in hf3.layer_types)
        assert cfg.gemma.sliding.count(False) == 2 and cfg.qk_norm
        for rope, layer_type in ((cfg.rope, "full_attention"), (cfg.gemma.local_rope, "sliding_attention")):
            freq, scale = inv_freq_and_scale(rope, cfg.head_dim)
            assert torch.allclose(freq, getattr(rotary, f"{layer_type}_inv_freq"), rtol=1e-6), layer_type
            assert scale == getattr(rotary, f"{layer_type}_attention_scaling")


BASE = dict(model_type="gemma2", vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=2, head_dim=32)


@pytest.mark.parametrize("change,match", [
    (dict(model_type="gemma3", text_config={}, vision_config={}), "multimodal"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(layer_types=["sliding_attention"]), "layer_types"),
    (dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
])
def test_unsupported_gemma_configs_are_refused_by_name(change, match):
    from verifier.model.config import ModelConfig
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**BASE, **change})


def test_tensor_parallelism_refuses_gemma_by_name():
    from verifier.model.config import ModelConfig
    from verifier.model.gemma import GemmaForCausalLM
    from verifier.model.shard import TensorShard
    with torch.device("meta"), pytest.raises(ValueError, match="tensor parallelism does not split gemma2"):
        GemmaForCausalLM(ModelConfig.from_hf(BASE), TensorShard(0, 2))


def test_geglu_and_soft_cap_kernels_match_torch_and_keep_bits_per_element():
    """The C kernels of the quantized path: gelu_tanh(gate) * up and cap * tanh(x / cap) against
    torch, -inf kept masked, and an element's bits the same wherever it sits (tail or not)."""
    import torch.nn.functional as F

    from verifier.cpu import cpu_ops
    gen = torch.Generator().manual_seed(0)
    gu = (torch.randn(3, 2 * 64, generator=gen) * 3).to(torch.bfloat16)
    out = torch.empty(3, 64, dtype=torch.bfloat16)
    cpu_ops.gelu_tanh_mul(gu, out)
    gate, up = gu.float().chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), F.gelu(gate, approximate="tanh") * up, atol=2e-2, rtol=1e-2)
    x = torch.randn(37, generator=gen) * 20
    x[5] = float("-inf")
    capped = x.clone()
    cpu_ops.soft_cap(capped, 30.0)
    assert capped[5] == float("-inf")
    finite = torch.arange(37) != 5
    torch.testing.assert_close(capped[finite], torch.tanh(x[finite] / 30.0) * 30.0, atol=1e-5, rtol=1e-5)
    shifted = torch.cat([torch.zeros(3), x])                     # the same values, 3 lanes further on
    cpu_ops.soft_cap(shifted, 30.0)
    assert torch.equal(shifted[3:], capped)
    for i in range(34, 37):                                      # the tail's elements, each alone
        alone = x[i:i + 1].clone()
        cpu_ops.soft_cap(alone, 30.0)
        assert torch.equal(alone, capped[i:i + 1])

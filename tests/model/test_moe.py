"""Mixtral and Qwen3-MoE (top-k routed SwiGLU experts, verifier/model/moe.py) on tiny random checkpoints
built with transformers' own classes: HF's logits and router, the quantized CPU kernels close to
the dense weights with a row's bits independent of its batch (whose other rows route to other
experts), T=0 speculation equal to plain decoding, GGUFs of both read back, and the refusals.

Qwen3-MoE here routes each token to 3 of 8 experts: with 2, a row's sum of two terms has the same
bits in either order, and a test could not see an order that depends on the batch."""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_cases import BLOCK, TINY_FIELDS, converted, hf_logits, jitter_norms, logits, own_logits_chunked
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from verifier.batch import ForwardBatch, SeqInput
from verifier.model import moe
from verifier.model.config import ModelConfig
from verifier.model.shard import TensorShard
from verifier.quantized.quantize import timed_linears
from verifier.target import TargetModel, load_config

FAMILIES = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=32),
}
VARIANTS = {
    **FAMILIES,
    "mixtral-window": dict(FAMILIES["mixtral"], sliding_window=40),       # 37 tokens: the window holds all
    # layer 0 a dense MLP (decoder_sparse_step 2), top-k probabilities as the softmax gave them
    "qwen3_moe-step2-unnormed": dict(FAMILIES["qwen3_moe"], decoder_sparse_step=2, norm_topk_prob=False),
}


def make_tiny_moe(out, model_type: str, seed: int = 0, **overrides):
    """A random-weight HF MoE checkpoint (config.json + safetensors), as conftest.make_tiny_model
    builds the dense families."""
    import transformers
    classes = {"mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
               "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}
    cfg_cls, model_cls = classes[model_type]
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**kw, **overrides})).float().eval()
    with torch.no_grad():  # larger weights than the default init (the experts are 3-D here)
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    return jitter_norms(make_tiny_moe(tmp_path_factory.mktemp(request.param), **FAMILIES[request.param]))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_moe_models_match_hf(tmp_path, variant):
    """HF's logits at every position (prefill and decode chunks over a shuffled paged cache),
    within 1e-4: both fp32, HF adds a row's experts by expert index and Tercel by rank, a few
    ulps apart; the greedy tokens are the same."""
    d = jitter_norms(make_tiny_moe(tmp_path, **VARIANTS[variant]))
    ids = random.Random(1).choices(range(256), k=37)
    ref = hf_logits(d, ids)
    ours = own_logits_chunked(TargetModel(str(d), device="cpu", load_tokenizer_files=False), ids, [20, 1, 1, 7, 8])
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("family,norm", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_is_hfs(family, norm, dtype):
    """`moe.route` gives HF's router's experts and weights bit for bit, their dtype included
    (Qwen3-MoE rounds its weights to the logits' dtype, Mixtral keeps fp32). Where bf16 logits
    tie at the k-th place HF's torch.topk picks either; Tercel the lower expert index, always."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    kw = {k: v for k, v in FAMILIES[family].items() if k != "model_type"}
    if family == "mixtral":
        cfg, router_cls = transformers.MixtralConfig(hidden_size=64, **kw), MixtralTopKRouter
    else:
        cfg = transformers.Qwen3MoeConfig(hidden_size=64, **{**kw, "norm_topk_prob": norm})
        router_cls = Qwen3MoeTopKRouter
    torch.manual_seed(0)
    router = router_cls(cfg)
    torch.nn.init.normal_(router.weight)
    router = router.to(dtype)
    h = torch.randn(256, 64, dtype=dtype)
    logits_, want_w, want_e = router(h)
    got_w, got_e = moe.route(F.linear(h, router.weight), ModelConfig.from_hf(cfg.to_dict()).moe)
    k = cfg.num_experts_per_tok
    ranked = logits_.float().sort(dim=-1, descending=True).values
    tied = ranked[:, k - 1] == ranked[:, k]
    assert got_w.dtype == want_w.dtype
    assert torch.equal(got_e[~tied], want_e[~tied]) and torch.equal(got_w[~tied], want_w[~tied])
    for row in tied.nonzero().view(-1).tolist():
        last = logits_[row].float()[got_e[row, -1]]
        assert got_e[row, -1] == (logits_[row].float() == last).nonzero().min()


def test_a_rows_expert_sum_does_not_depend_on_the_other_rows():
    """`moe.mix` adds a row's three experts in its own rank order: each row's fp32 result alone
    equals its result among rows that reach the same experts in other orders. (The quantized
    path rounds the sum to bf16, which hides a one-ulp change of order most of the time, so the
    rule is checked here, before the rounding.)"""
    gen = torch.Generator().manual_seed(0)
    rows, k, experts, hidden = 16, 3, 8, 64
    x = torch.randn(rows, hidden, generator=gen)
    scales = torch.randn(experts, hidden, generator=gen)

    def run(e, picked):                  # row-wise, as the experts' kernels are
        return torch.tanh(picked * scales[e])
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(rows)])
    weights = torch.rand(rows, k, generator=gen)
    batched = moe.mix(x, weights, chosen, run)
    for r in range(rows):
        assert torch.equal(moe.mix(x[r:r + 1], weights[r:r + 1], chosen[r:r + 1], run)[0], batched[r])


def test_moe_configs():
    """Both families' expert keys (Qwen3-MoE hub files say num_experts, transformers 5 writes
    num_local_experts), dense layers, and Qwen3-MoE's unused sliding_window."""
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2)
    mixtral = ModelConfig.from_hf({**base, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
                                   "sliding_window": 4096, "max_position_embeddings": 32768})
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.intermediate_size) == (8, 2, 16)
    assert mixtral.moe.norm_topk_prob and not mixtral.moe.weights_in_logits_dtype and not mixtral.qk_norm
    assert (mixtral.sliding_window, mixtral.max_position) == (4096, 4096)     # as Mistral's window
    qwen = dict(base, model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=4,
                norm_topk_prob=True, sliding_window=4096, use_sliding_window=False, max_position_embeddings=40960)
    cfg = ModelConfig.from_hf(qwen)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size, cfg.moe.dense_layers) == (16, 4, 4, ())
    assert cfg.qk_norm and cfg.moe.weights_in_logits_dtype and (cfg.sliding_window, cfg.max_position) == (None, 40960)
    renamed = {k: v for k, v in qwen.items() if k != "num_experts"} | {"num_local_experts": 16}
    assert ModelConfig.from_hf(renamed) == cfg
    sparse = ModelConfig.from_hf({**qwen, "decoder_sparse_step": 2, "mlp_only_layers": [3]}).moe
    assert sparse.dense_layers == (0, 2, 3) and sparse.sparse(1)


def test_moe_refusals():
    """Shared experts (Qwen2-MoE, DeepSeek), more experts per token than experts, and tensor
    parallelism over a MoE checkpoint fail naming what."""
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2)
    with pytest.raises(ValueError, match="shared experts"):
        ModelConfig.from_hf({**base, "model_type": "qwen2_moe", "num_experts": 8, "shared_expert_intermediate_size": 32})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf({**base, "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3})
    cfg = ModelConfig.from_hf({**base, "model_type": "mixtral", "num_local_experts": 4})
    with pytest.raises(ValueError, match="tensor parallelism does not split mixtral.*experts"):
        TensorShard(0, 2).check(cfg)
    TensorShard(0, 1).check(cfg)


def test_tensor_parallel_engine_refuses_moe_before_starting(family_dir):
    with pytest.raises(ValueError, match="tensor parallelism does not split .*mixture-of-experts"):
        LLM(str(family_dir), tensor_parallel_size=2, max_model_len=128, num_kv_blocks=16, device="cpu")


def record_routes(monkeypatch) -> list[torch.Tensor]:
    """Each call's experts [T, k] from here on, one call per sparse layer and forward."""
    routes, route = [], moe.route

    def recorded(logits, cfg):
        weights, experts = route(logits, cfg)
        routes.append(experts.clone())
        return weights, experts
    monkeypatch.setattr(moe, "route", recorded)
    return routes


def relative_error(got: torch.Tensor, want: torch.Tensor, mode: str) -> float:
    """Over every logit, or for gguf over each row's 4 best (its head scans in int4 and rescores the
    best candidates on the file's weights, so only those carry the experts' precision)."""
    if mode == "gguf":
        top = want.topk(4, dim=-1).indices
        got, want = got.gather(1, top), want.gather(1, top)
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("mode,tol", [("int8", 0.05), ("gguf", 0.05), ("int4", 0.3)])
def test_quantized_is_close_to_dense_and_rows_do_not_depend_on_neighbours(family_dir, mode, tol, monkeypatch):
    """The int8, gguf (int8 groups of 32) and int4 experts stay close to the dense model (int4
    moves a tiny random model's logits by about a quarter, dense families too), and a decode row
    has the same bits alone and after three rows that route to experts it does not use, in every
    sparse layer."""
    ids = list(range(10, 40))
    want = logits(TargetModel(str(family_dir), quantization="none", load_tokenizer_files=False), ids)
    target = TargetModel(str(family_dir), quantization=mode, load_tokenizer_files=False)
    assert target.runner.native is None               # the experts run in the Python layer loop
    moe, first = target.config.moe, target.net.model.layers[0]     # load times the experts a token reaches
    reached = [first.self_attn.qkv_proj, first.self_attn.o_proj,
               *(lin for e in first.mlp.experts[:moe.top_k] for lin in (e.gate_up_proj, e.down_proj))]
    assert timed_linears(target.runner.decoder[:2 + 2 * moe.num_experts], moe.top_k) == reached
    got = logits(target, ids)
    assert relative_error(got, want, mode) < tol
    target.allocate_kv(8, BLOCK)
    target.forward(ForwardBatch([SeqInput(ids, 0, [0, 1], logits_indices=[])]))
    target.forward(ForwardBatch([SeqInput(ids[:9], 0, [2, 3], logits_indices=[])]))
    routes = record_routes(monkeypatch)
    alone = target.forward(ForwardBatch([SeqInput([7], len(ids), [0, 1])])).logits[0]
    alone_routes = routes[:]
    routes.clear()
    batched = target.forward(ForwardBatch([SeqInput([9, 4, 2], 9, [2, 3], logits_indices=[0, 1, 2]),
                                           SeqInput([7], len(ids), [0, 1])]))
    assert torch.equal(batched.logits[-1], alone)
    assert len(routes) == len(alone_routes) == 2
    for own, shared in zip(alone_routes, routes):
        assert torch.equal(shared[-1], own[0])
        assert set(shared[:-1].flatten().tolist()) - set(own[0].tolist())


@pytest.mark.parametrize("quantization", ["none", "int4", "gguf"])
def test_greedy_speculation_gives_plain_decoding_tokens(family_dir, quantization):
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] * 2 for n in (5, 9, 13)]     # repeats to draft from
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(max_model_len=256, num_kv_blocks=64, quantization=quantization)
    plain = [o.token_ids for o in LLM(str(family_dir), **kw).generate(prompts, greedy)]
    outs = LLM(str(family_dir), drafter="suffix", adaptive=AdaptiveConfig(enabled=False), **kw).generate(prompts, greedy)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.stats.verify_steps for o in outs) > 0


# ---- GGUF ------------------------------------------------------------------------------------
def llama_cpp_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows in llama.cpp's RoPE order (convert_hf_to_gguf's permute), as a llama file holds them."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors_of(tensors: dict, model_type: str) -> dict[str, torch.Tensor]:
    """HF-named tensors under GGUF names, each layer's experts stacked into ffn_*_exps [E, rows, cols]."""
    from verifier.model.gguf_names import _LAYER_NAMES, _MOE_LAYER_NAMES, _TOP_NAMES
    layer = {hf: g for g, hf in {**_LAYER_NAMES, **_MOE_LAYER_NAMES[model_type]}.items()}
    out, stacks = {}, {}
    for name, t in tensors.items():
        base, kind = name.rsplit(".", 1)
        if not base.startswith("model.layers."):
            out[f"{next(k for k, v in _TOP_NAMES.items() if v == base)}.{kind}"] = t
            continue
        idx, part = base[len("model.layers."):].split(".", 1)
        expert = re.fullmatch(r"(.*\.experts)\.(\d+)\.(.*)", part)
        if expert:
            stacks.setdefault(f"blk.{idx}.{layer[f'{expert[1]}.{{}}.{expert[3]}']}.{kind}", {})[int(expert[2])] = t
        else:
            out[f"blk.{idx}.{layer[part]}.{kind}"] = t
    return out | {g: torch.stack([parts[e] for e in sorted(parts)]) for g, parts in stacks.items()}


def write_moe_gguf(path, arch: str, model_type: str, tensors: dict, fields: dict, q8_0: bool = False):
    """A GGUF of `arch` (gguf-py) holding an HF MoE checkpoint's tensors; the decoder's matrices and
    expert stacks as Q8_0 blocks if `q8_0`, the router in F32 as llama.cpp keeps it."""
    import gguf
    from gguf.quants import quantize
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    w.add_token_list([f"t{i}" for i in range(256)])
    for g, t in gguf_tensors_of(tensors, model_type).items():
        if model_type == "mixtral" and g.endswith(("attn_q.weight", "attn_k.weight")):
            t = llama_cpp_rope_rows(t, fields["attention.head_count" if "attn_q" in g else "attention.head_count_kv"])
        arr = t.numpy().astype(np.float32)
        if q8_0 and g.startswith("blk.") and arr.ndim >= 2 and "ffn_gate_inp" not in g:
            w.add_tensor(g, quantize(arr, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


def test_a_mixtral_gguf_is_a_llama_file_with_experts(tmp_path):
    """A llama GGUF with llama.expert_count (Mixtral; q/k rows in llama.cpp's RoPE order) gives back
    the HF checkpoint's config, tensors under their HF names, and HF's logits."""
    from safetensors.torch import load_file
    hf_dir = jitter_norms(make_tiny_moe(tmp_path / "hf", **FAMILIES["mixtral"]))
    tensors = load_file(str(hf_dir / "model.safetensors"))
    path = tmp_path / "tiny-mixtral.gguf"
    reader = write_moe_gguf(path, "llama", "mixtral", tensors,
                            {**TINY_FIELDS, "expert_count": 4, "expert_used_count": 2, "rope.freq_base": 1e6})
    model = converted(reader, path, tmp_path / "converted")
    back = load_file(str(model / "model.safetensors"))
    assert set(back) == set(tensors) and all(torch.equal(back[n], tensors[n]) for n in tensors)
    cfg = load_config(model)
    assert (cfg.model_type, cfg.moe.num_experts, cfg.moe.top_k) == ("mixtral", 4, 2)
    ids = list(range(10, 40))
    got = logits(TargetModel(str(model), load_tokenizer_files=False), ids)
    assert (got - hf_logits(hf_dir, ids)).abs().max() < 1e-4


@pytest.mark.parametrize("mode", ["int8", "gguf"])
def test_a_qwen3moe_gguf_serves_its_q8_0_expert_blocks(tmp_path, mode):
    """A qwen3moe GGUF with Q8_0 expert stacks: each expert's slice of the blocks is read as that
    expert's weight, the int8 path (per channel) and the gguf path (the blocks as stored) serve
    them, and the logits stay close to HF's."""
    from safetensors.torch import load_file

    from verifier.model.gguf_quant import INDEX_FILE, read_quantized
    hf_dir = jitter_norms(make_tiny_moe(tmp_path / "hf", **FAMILIES["qwen3_moe"]))
    path = tmp_path / "tiny-qwen3moe.gguf"
    reader = write_moe_gguf(path, "qwen3moe", "qwen3_moe", load_file(str(hf_dir / "model.safetensors")),
                            {**TINY_FIELDS, "attention.key_length": 32, "expert_count": 8, "expert_used_count": 3,
                             "expert_feed_forward_length": 32}, q8_0=True)
    model = converted(reader, path, tmp_path / "converted")
    cfg = load_config(model)
    assert (cfg.model_type, cfg.qk_norm, cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size,
            cfg.moe.norm_topk_prob) == ("qwen3_moe", True, 8, 3, 32, True)
    blocks = read_quantized(json.loads((model / INDEX_FILE).read_text()), json.loads((model / "config.json").read_text()))
    hf = load_file(str(hf_dir / "model.safetensors"))
    for e in (0, 7):
        name = f"model.layers.1.mlp.experts.{e}.down_proj.weight"
        assert (blocks[name].dequantize() - hf[name]).abs().max() < 2e-3        # Q8_0: scale / 2 per weight
    ids = list(range(10, 40))
    target = TargetModel(str(model), quantization=mode, load_tokenizer_files=False)
    if mode == "gguf":
        gate_up = target.net.model.layers[1].mlp.experts[7].gate_up_proj     # (down_proj's rows are one block)
        assert (gate_up.own, gate_up.bits) == ("q8x16", 8)
    got = logits(target, ids)
    want = hf_logits(hf_dir, ids)
    assert relative_error(got, want, mode) < 0.05

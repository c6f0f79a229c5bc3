"""Gemma 2 and Gemma 3 (text) on every path: HF parity of the dense forward with prompts longer
than a tiny sliding window, soft-capping small enough to matter and jittered norms; the quantized
CPU kernels close to the dense weights with decode rows bitwise the same alone and batched; T=0
speculation equal to plain decoding; a GGUF of each read back to HF's logits; the Triton kernel's
window and soft-capping under the interpreter; refusals by name."""
from __future__ import annotations

import random

import pytest
import torch

from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from test_model_parity import hf_logits, jitter_norms, own_logits_chunked
from verifier.batch import ForwardBatch, SeqInput
from verifier.target import TargetModel

WINDOW = 8              # prompts of 37 tokens: most keys fall outside a sliding layer's window
BLOCK = 16
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, sliding_window=WINDOW, query_pre_attn_scalar=24)
VARIANTS = {
    # caps small enough that tanh bends the tiny model's scores and logits
    "gemma2": dict(num_hidden_layers=4, attn_logit_softcapping=1.5, final_logit_softcapping=2.0),
    "gemma3_text": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention",
                                                          "sliding_attention", "sliding_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}


def make_gemma(out, model_type: str, seed: int = 0, **overrides):
    """A random-weight Gemma checkpoint (config.json + safetensors) built with transformers' classes."""
    import transformers
    cfg_cls, model_cls = {"gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
                          "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[model_type]
    cfg = cfg_cls(**{**TINY, **VARIANTS[model_type], **overrides})
    cfg._attn_implementation = "eager"          # the reference: soft-capping and windows as written
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    return jitter_gemma_norms(out)


def jitter_gemma_norms(model_dir):
    """`jitter_norms` shifted to Gemma's x * (1 + w): w in [-0.5, 0.5] instead of HF's zeros."""
    from safetensors.torch import load_file, save_file
    jitter_norms(model_dir)
    path = model_dir / "model.safetensors"
    tensors = {n: t - 1 if t.dim() == 1 and "norm" in n else t for n, t in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module", params=list(VARIANTS))
def gemma_dir(request, tmp_path_factory):
    return make_gemma(tmp_path_factory.mktemp(request.param), request.param)


PROMPT = random.Random(1).choices(range(256), k=37)


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

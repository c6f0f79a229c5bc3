"""Tiny random Gemma 2 and Gemma 3 (text) checkpoints built with transformers' classes, with a
sliding window small enough that a 37-token prompt (PROMPT) reaches past it: shared by
tests/model/test_gemma.py and the Triton backend's test (tests/kernels/test_gemma_triton.py)."""
from __future__ import annotations

import random

import torch

from model_cases import jitter_norms


WINDOW = 8              # prompts of 37 tokens: most keys fall outside a sliding layer's window
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


PROMPT = random.Random(1).choices(range(256), k=37)

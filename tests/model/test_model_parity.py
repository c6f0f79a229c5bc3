"""The own forward over the paged KV cache against HF transformers' reference modeling code."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import make_tiny_model
from model_cases import hf_logits, jitter_norms, own_logits_chunked
from verifier.target import TargetModel


TINY_VARIANTS = {
    "llama": dict(model_type="llama"),
    "llama-tied-llama3-rope": dict(model_type="llama", tie_word_embeddings=True,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                   rope_theta=500000.0),
    "llama-linear-rope-mha": dict(model_type="llama", num_key_value_heads=4,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-bias": dict(model_type="qwen2"),
    # q/k norms over 32-wide heads (4 x 32 = 128 query columns from a 64-wide residual)
    "qwen3-qk-norm": dict(model_type="qwen3", head_dim=32),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "mistral-window": dict(model_type="mistral", sliding_window=40),    # 37 tokens: the window holds all
    "phi3-fused": dict(model_type="phi3", pad_token_id=0),              # qkv_proj, gate_up_proj as stored
}


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_tiny_random_models_match_hf(tmp_path, variant):
    """Tiny random Llama/Qwen2/Qwen3/Mistral/Phi-3 checkpoints, loaded through the HF-directory path, give
    HF's logits at every position, with prefill and decode chunks over a shuffled paged cache."""
    kw = dict(TINY_VARIANTS[variant])
    d = jitter_norms(make_tiny_model(tmp_path, None, **kw))
    ids = random.Random(1).choices(range(256), k=37)
    ref = hf_logits(d, ids)
    target = TargetModel(str(d), device="cpu", load_tokenizer_files=False)
    ours = own_logits_chunked(target, ids, [20, 1, 1, 7, 8])
    diff = (ours - ref).abs().max().item()
    print(f"{variant}: max abs logit diff {diff:.2e}")
    assert diff < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_rope_scaling_matches_transformers():
    """Inverse frequencies and attention scaling for default, linear, llama3 and yarn RoPE equal
    transformers' own rope initialisation."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from verifier.model.config import ModelConfig
    from verifier.model.rope import inv_freq_and_scale
    cases = [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096},
    ]
    for scaling in cases:
        hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=1e6,
                             max_position_embeddings=32768, rope_scaling=scaling)
        ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
        ours = ModelConfig.from_hf(hf_cfg.to_dict())
        freq, scale = inv_freq_and_scale(ours.rope, ours.head_dim)
        assert torch.allclose(freq, ref_freq.float(), rtol=1e-5), scaling["rope_type"]
        assert abs(scale - ref_scale) < 1e-6, scaling["rope_type"]


def test_unsupported_rope_is_refused():
    """A rope type Tercel does not implement is an error naming it, never silently ignored."""
    from verifier.model.config import ModelConfig
    cfg = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
               num_attention_heads=2, rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf(cfg)


def test_old_rope_scaling_form_is_read():
    """Pre-v5 configs (`rope_theta` + `rope_scaling` with `type`) read the same as `rope_parameters`."""
    from verifier.model.config import ModelConfig
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    old = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                           "rope_theta": 5e5}})
    assert old.rope == new.rope and old.rope.rope_type == "linear" and old.rope.theta == 5e5


def test_unsupported_families_and_sliding_windows_are_refused_by_name():
    """A model type not served (a bare gemma3), Qwen3 with sliding-window layers and Phi-4-mini's partial rotary
    embeddings fail at load, naming what; a whole-model window caps the positions served."""
    from verifier.model.config import ModelConfig
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="'gemma3'.*llama, mistral, qwen2, qwen3, phi3"):
        ModelConfig.from_hf({**base, "model_type": "gemma3"})
    with pytest.raises(ValueError, match="partial rotary"):
        ModelConfig.from_hf({**base, "model_type": "phi3", "partial_rotary_factor": 0.75})
    window = ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": 2047,
                                  "max_position_embeddings": 4096})
    assert (window.max_position, window.sliding_window) == (2047, 2047)
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_hf({**base, "model_type": "qwen3", "use_sliding_window": True})
    assert ModelConfig.from_hf({**base, "model_type": "qwen3", "use_sliding_window": False}).qk_norm

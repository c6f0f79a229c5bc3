"""A target with a published model's shapes and random weights, for timing without its checkpoint.

A GPU machine here has no network and takes at most 64 MiB a call: Llama-3.1-8B's 16 GB of
weights cannot travel, but its config can. The weights are drawn on the device (N(0, 0.02)),
so a forward costs what the real model's does; its tokens mean nothing.
"""
from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import torch

import verifier.target
from verifier.target import TargetModel

SHAPES = {
    # meta-llama/Llama-3.1-8B-Instruct's config.json (the keys Tercel reads)
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    # a dry run's (bench/graph_steps.py's test): two layers of 64, a few MB
    "tiny": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def _fill_random(net, model_dir, shard=None, skip=frozenset()) -> None:
    """Stands in for `load_checkpoint`: every parameter drawn where it lives."""
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.02)


def random_target(shapes: str | dict, model_dir: str | Path, device: torch.device | str, dtype: torch.dtype,
                  backend: str | None = None) -> TargetModel:
    """A dense TargetModel with `shapes` (a SHAPES name or a config.json dict), its config written
    into `model_dir`, no tokenizer."""
    config = SHAPES[shapes] if isinstance(shapes, str) else shapes
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    with mock.patch.object(verifier.target, "load_checkpoint", _fill_random):
        return TargetModel(str(model_dir), device=str(device), dtype=dtype, backend=backend,
                           load_tokenizer_files=False, quantization="none")

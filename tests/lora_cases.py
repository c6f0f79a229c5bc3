"""LoRA adapters in PEFT's format for the tests that serve them (tests/model/test_lora.py, the
Triton, GPU, API and bench tests): PEFT imported when a test runs, adapters with random A and B
(`init_lora_weights=False`, so the adapter changes the model), the projections they adapt, and
the prompts and greedy parameters the tests decode with."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verifier.sampling.sampling_params import SamplingParams


def import_peft():
    """PEFT, imported when a test runs: at collection it would import triton before the Triton
    tests set TRITON_INTERPRET (tests/kernels/test_triton_kernels.py)."""
    return pytest.importorskip("peft")


ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [7, 7, 7, 100, 200], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [250, 13]]


def make_adapter(base: Path, out: Path, targets: list[str], r: int = 8, seed: int = 1, **config) -> Path:
    """A PEFT LoRA adapter of `base` with random A and B, saved to `out`."""
    import transformers
    peft = import_peft()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    torch.manual_seed(seed)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                      init_lora_weights=False, **config))
    lora.save_pretrained(str(out))
    return out

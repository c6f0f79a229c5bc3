"""The target model as the engine sees it: weights, tokenizer, KV pools, one `forward`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from verifier.attention import get_backend
from verifier.batch import ForwardBatch, ForwardOutput
from verifier.config import ModelConfig
from verifier.kv_cache import KVCache
from verifier.loader import resolve_model_dir
from verifier.model import LlamaForCausalLM
from verifier.tokenizer import NullTokenizer, Tokenizer
from verifier.weights import load_safetensors


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    # bf16 matmuls measured ~8x slower than fp32 on these CPUs; on CUDA bf16 is the norm.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed {path}: {e}") from e


def load_tokenizer(model_dir: Path) -> Tokenizer | NullTokenizer:
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return NullTokenizer()
    try:
        return Tokenizer(model_dir)
    except Exception as e:
        raise ValueError(f"no usable tokenizer files in {model_dir}: {e}") from e


class TargetModel:
    """Owns the Llama module, its KV cache and its attention backend."""

    def __init__(self, model: str, device: str | None = None, dtype: torch.dtype | None = None,
                 backend: str | None = None, load_tokenizer_files: bool = True):
        self.model_dir = resolve_model_dir(model)
        self.config = load_config(self.model_dir)
        self.device = torch.device(device) if device else default_device()
        self.dtype = dtype or default_dtype(self.device)
        self.tokenizer = load_tokenizer(self.model_dir) if load_tokenizer_files else None
        with torch.device("meta"):
            net = LlamaForCausalLM(self.config)
        net = net.to_empty(device=self.device).to(self.dtype)
        if self.config.tie_word_embeddings:
            net.lm_head.weight = net.model.embed_tokens.weight
        load_safetensors(net, self.model_dir)
        net.init_rotary(self.device, self.dtype)
        self.net = net.eval()
        self.backend = get_backend(backend or ("triton" if self.device.type == "cuda" else "torch"))
        self.kv: KVCache | None = None

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        c = self.config
        self.kv = KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                          self.dtype, self.device)

    def kv_bytes_per_block(self, block_size: int) -> int:
        c = self.config
        return KVCache.bytes_per_block(c.num_layers, block_size, c.num_kv_heads, c.head_dim, self.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        ids, positions, rows, offsets = _flatten(batch)
        dev = self.device
        meta = self.backend.plan(batch, self.kv.block_size, dev)
        logits, taps = self.net(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                                torch.tensor(rows, dtype=torch.long, device=dev), self.kv, self.backend, meta,
                                batch.capture_layers)
        return ForwardOutput(logits, offsets, taps)


def _flatten(batch: ForwardBatch):
    ids, positions, rows, offsets, t = [], [], [], [0], 0
    for s in batch.seqs:
        ids += s.token_ids
        positions += s.positions if s.positions is not None else list(range(s.ctx_len, s.kv_len))
        rows += [t + i for i in s.sample_indices]
        offsets.append(len(rows))
        t += s.num_new
    return ids, positions, rows, offsets

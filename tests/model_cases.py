"""Tiny models against HF transformers, shared by the model tests (tests/model/) and the kernels'
tests that serve the same checkpoints: HF's logits and the own forward's over a shuffled paged
cache, jittered norms, the tiny Qwen3 and Phi-3 families, logits of a sequence alone or beside
another, and GGUFs written with gguf-py and converted as the loader converts them."""
from __future__ import annotations

import json
import random

import numpy as np
import torch

from verifier.batch import ForwardBatch, SeqInput
from verifier.target import TargetModel


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def own_logits_chunked(target: TargetModel, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Run ids through the paged cache in chunks (prefill, then decode-sized pieces), with a
    shuffled block table so physical order differs from logical order; logits at every position."""
    bs = 4
    nblocks = (len(ids) + bs - 1) // bs
    target.allocate_kv(nblocks + 3, bs)
    table = random.Random(0).sample(range(nblocks + 3), nblocks)
    out, start = [], 0
    for n in chunks:
        piece = ids[start:start + n]
        fwd = target.forward(ForwardBatch([SeqInput(piece, start, table, logits_indices=list(range(n)))]))
        out.append(fwd.logits)
        start += n
    assert start == len(ids)
    return torch.cat(out)


def jitter_norms(model_dir):
    """Every norm weight drawn from [0.5, 1.5] instead of HF's ones: a norm applied to the wrong
    tensor, or not at all, then moves the logits."""
    from safetensors.torch import load_file, save_file
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if t.dim() == 1 and "norm" in name:
            tensors[name] = torch.rand(t.shape, generator=gen) + 0.5
    save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


BLOCK = 16


FAMILIES = {"qwen3": dict(model_type="qwen3", head_dim=32), "phi3": dict(model_type="phi3", pad_token_id=0)}


def logits(target, ids, beside=None):
    """Logits of every position of ids, alone or in one forward beside another sequence."""
    target.allocate_kv(8, BLOCK)
    seqs = [SeqInput(ids, 0, [0, 1], logits_indices=list(range(len(ids))))]
    if beside:
        seqs.append(SeqInput(beside, 0, [2, 3], logits_indices=[len(beside) - 1]))
    return target.forward(ForwardBatch(seqs)).logits[:len(ids)]


def write_gguf(path, arch: str, tensors: dict, fields: dict, q8_0: bool = False, blocks=None):
    """A GGUF of `arch` (written with gguf-py) holding HF-named `tensors` under their GGUF names, the
    decoder's matrices as Q8_0 blocks if `q8_0`, or as `blocks(gguf_name, array)` encodes them
    ((bytes, GGMLQuantizationType), or None: F32); `fields` are `{arch}.*` integers (floats where
    given as floats)."""
    import gguf
    from gguf.quants import quantize

    from verifier.model.gguf_names import _FUSED_LAYER_NAMES, _LAYER_NAMES, _TOP_NAMES
    layer = {hf: g for g, hf in {**_LAYER_NAMES, **_FUSED_LAYER_NAMES.get(arch, {})}.items()}
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    w.add_token_list([f"t{i}" for i in range(256)])
    for name, t in tensors.items():
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            idx, part = base[len("model.layers."):].split(".", 1)
            g = f"blk.{idx}.{layer[part]}"
        else:
            g = next(k for k, v in _TOP_NAMES.items() if v == base)
        arr = t.numpy().astype(np.float32)
        encoded = blocks(g, arr) if blocks and arr.ndim == 2 else None
        if encoded is not None:
            w.add_tensor(f"{g}.{kind}", encoded[0], raw_dtype=encoded[1])
        elif q8_0 and g.startswith("blk.") and arr.ndim == 2:
            w.add_tensor(f"{g}.{kind}", quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(f"{g}.{kind}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


def converted(reader, path, out):
    """The converted checkpoint directory convert_gguf writes, less the tokenizer files."""
    from safetensors.torch import save_file

    from verifier.model.gguf_convert import gguf_config, gguf_tensors
    from verifier.model.gguf_quant import INDEX_FILE, block_index
    cfg = gguf_config(reader)
    out.mkdir()
    save_file(gguf_tensors(reader, cfg), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    (out / INDEX_FILE).write_text(json.dumps(block_index(reader, path)))
    return out


TINY_FIELDS = {"block_count": 2, "context_length": 1024, "embedding_length": 64, "feed_forward_length": 128,
               "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5,
               "rope.freq_base": 10000.0}

"""Read a GGUF's Q4_0, Q4_1, Q4_K, Q5_0, Q6_K and Q8_0 blocks as they are, without a float round trip.

Block layouts (ggml, little-endian):
    Q4_0: d fp16, 16 bytes of nibbles            w = d * (q - 8)          32 weights
    Q4_1: d fp16, m fp16, 16 bytes of nibbles    w = d * q + m            32 weights
    Q8_0: d fp16, 32 int8                        w = d * q                32 weights
    Q5_0: d fp16, 4 bytes of fifth bits, 16 bytes of nibbles
                                                 w = d * (q - 16)         32 weights
    Q4_K: d fp16, dmin fp16, 12 bytes of 6-bit scales and mins (8 of each), 128 bytes of
          nibbles; sub-block j (32 weights): w = (d * sc[j]) * q - dmin * mn[j]   256 weights
Q4_0 / Q4_1 nibble byte j holds weight j (low half) and weight j + 16 (high half) of its
block; Q4_K's 32-byte chunk c holds weights 64 c + l (low halves) and 64 c + 32 + l (high).
A Q4_K sub-block is a Q4_1 block whose d and m are products (d * sc, -dmin * mn): it is
served by the same int4 kernels, groups of 32.
    Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d fp16; weight
          group j of 16: w = (d * sc[j]) * (q - 32)                         256 weights
Q5_0's bit j (of the 32-bit field) is weight j's fifth bit. Q5_0, Q6_K and Q8_0 become int8
groups (q - 16, q - 32, q) with scales per 32, 16 and 32 weights: the q8x16 kernel's form.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from verifier.model.gguf_names import ROPE_PERMUTED, hf_names, unpermute_rope_rows
from verifier.model.quant import Int4Weight, Int8Weight, QuantWeight, int4_from_affine

BLOCK = 32
_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_0": (32, 22),
           "Q6_K": (256, 210)}    # weights, bytes


def _f16(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block: [N, nb] fp32."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The 32 4-bit values of every block from byte `at`: [N, nb * 32] uint8."""
    qs = blocks[..., at:at + BLOCK // 2]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)          # [N, nb, 32] in weight order
    return torch.from_numpy(q.reshape(q.shape[0], -1))


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes per super-block -> its 8 sub-blocks' 6-bit scales and mins ([..., 8]
    each): bytes 0-3 hold scales 0-3 (and the top bits of scales 4-7), 4-7 mins 0-3 (and the
    top bits of mins 4-7), 8-11 the low four bits of scales and mins 4-7."""
    d, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k(blocks: np.ndarray) -> Int4Weight:
    """[N, super-blocks, 144] Q4_K bytes -> int4 groups of 32 (see the module docstring)."""
    n, nsb = blocks.shape[:2]
    sc, mn = (torch.from_numpy(x).float() for x in _k_scales(blocks[..., 4:16]))
    d = _f16(blocks, 0)[..., None] * sc                         # [N, nsb, 8], as ggml computes them
    m = _f16(blocks, 2)[..., None] * mn
    qs = blocks[..., 16:].reshape(n, nsb, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, nsb * 256)     # chunk c: low, then high halves
    return int4_from_affine(torch.from_numpy(q), d.reshape(n, -1), -m.reshape(n, -1))


def _q5_0(blocks: np.ndarray) -> Int8Weight:
    """[N, blocks, 22] Q5_0 bytes -> int8 groups of 32, q - 16."""
    n = blocks.shape[0]
    fifth = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")             # [N, nb, 1]
    high = ((fifth >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4       # [N, nb, 32]
    q = _nibbles(blocks, 6).view(n, -1, 32).to(torch.int16) + torch.from_numpy(high) - 16
    return Int8Weight(q.reshape(n, -1).to(torch.int8), _f16(blocks, 0))


def _q6_k(blocks: np.ndarray) -> Int8Weight:
    """[N, super-blocks, 210] Q6_K bytes -> int8 groups of 16, q - 32. Each 128-weight half takes 64
    bytes of nibbles (weights l and 64 + l from byte l's halves, 32 + l and 96 + l from byte 32 + l's)
    and 32 bytes of bit pairs (byte l: weights l, 32 + l, 64 + l, 96 + l from low to high)."""
    n, nsb = blocks.shape[:2]
    ql = blocks[..., :128].reshape(n, nsb, 2, 64).astype(np.int16)
    qh = blocks[..., 128:192].reshape(n, nsb, 2, 1, 32).astype(np.int16)
    low = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
    q = low | (((qh >> (2 * np.arange(4)).reshape(4, 1)) & 3) << 4)        # [N, nsb, 2, 4, 32]
    sc = torch.from_numpy(np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32))
    scale = _f16(blocks, 208)[..., None] * sc                                # exact: 11 x 8 bits
    return Int8Weight(torch.from_numpy((q - 32).astype(np.int8).reshape(n, -1)), scale.reshape(n, -1))


def read_block_tensor(kind: str, data: np.ndarray, rows: int, cols: int) -> QuantWeight:
    """One quantized tensor (`data`: its raw bytes, [rows, row bytes]) as Tercel's form."""
    per, nbytes = _BLOCKS[kind]
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, cols // per, nbytes)
    if kind == "Q4_K":
        return _q4_k(blocks)
    if kind == "Q5_0":
        return _q5_0(blocks)
    if kind == "Q6_K":
        return _q6_k(blocks)
    if kind == "Q4_0":
        d = _f16(blocks, 0)
        return Int4Weight(_nibbles(blocks, 2), d, torch.zeros_like(d))
    if kind == "Q4_1":
        return int4_from_affine(_nibbles(blocks, 4), _f16(blocks, 0), _f16(blocks, 2))
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
    return Int8Weight(torch.from_numpy(q.copy()), _f16(blocks, 0))


def _unpermute(w: QuantWeight, heads: int) -> QuantWeight:
    # Undo llama.cpp's RoPE row order (see gguf_names); blocks run along a row, so each
    # field permutes its rows alike.
    fields = {name: unpermute_rope_rows(getattr(w, name), heads).contiguous()
              for name in w.__dataclass_fields__}
    return type(w)(**fields)


INDEX_FILE = "gguf_blocks.json"


def block_index(reader, gguf_path: Path) -> dict:
    """Where each quantized tensor's blocks lie in the GGUF file; written beside the
    converted checkpoint so that later loads map the blocks without parsing the file's
    metadata again (the tokenizer fields alone take GGUFReader seconds; figures:
    docs/performance.md, "Load and import times")."""
    # "experts": the slices of a 3-D ffn_*_exps tensor (0: a matrix)
    tensors = [{"name": t.name, "kind": t.tensor_type.name, "rows": int(t.shape[1]), "cols": int(t.shape[0]),
                "experts": int(t.shape[2]) if len(t.shape) == 3 else 0,
                "offset": int(t.data_offset), "nbytes": int(t.n_bytes)}
               for t in reader.tensors if t.tensor_type.name in _BLOCKS]
    # the decoder's matrices stored otherwise (Q5_0, Q6_K, F16, ...): dense here, requantized by a quantized path
    others = sorted({t.tensor_type.name for t in reader.tensors
                     if t.name.startswith("blk.") and len(t.shape) >= 2 and t.tensor_type.name not in _BLOCKS})
    return {"gguf": str(Path(gguf_path).resolve()), "tensors": tensors, "other_kinds": others}


def read_quantized(index: dict, cfg: dict) -> dict[str, QuantWeight]:
    """HF name -> weight for every Q4_0 / Q4_1 / Q4_K / Q8_0 tensor of the indexed file, one per
    expert for an ffn_*_exps tensor (others come dense from the converted safetensors)."""
    unpermute = cfg["model_type"] in ROPE_PERMUTED
    out = {}
    for t in index["tensors"]:
        data = np.memmap(index["gguf"], dtype=np.uint8, mode="r", offset=t["offset"], shape=(t["nbytes"],))
        experts = t.get("experts", 0)
        slices = data.reshape(experts, -1) if experts else [data]       # an expert's rows lie together
        for name, part in zip(hf_names(t["name"], cfg["model_type"], experts), slices):
            w = read_block_tensor(t["kind"], part, t["rows"], t["cols"])
            if unpermute and t["name"].endswith("attn_q.weight"):
                w = _unpermute(w, cfg["num_attention_heads"])
            elif unpermute and t["name"].endswith("attn_k.weight"):
                w = _unpermute(w, cfg["num_key_value_heads"])
            out[name] = w
    return out

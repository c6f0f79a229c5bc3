"""Random-weight GGUFs in the shapes of the models people serve on a CPU.

    python -m bench.model_shapes --out runs/shapes --shape smollm2-1.7b --kinds Q4_0,Q4_K_M

Each file has a published model's shapes (`SHAPES`: hidden size, layers, FFN width, heads, KV
heads, vocabulary), weights drawn N(0, 0.02) (one draw per distinct shape, which every layer
reuses: the speed and memory of a forward do not depend on it), and the default model's tokenizer, its token list
padded with unused tokens up to the model's vocabulary (so that the embedding and the LM head
have their real size). Its tokens mean nothing; its load time, memory and speed are such a
file's. Q4_0 and Q4_K_M come from llama.cpp's own quantizer (llama-cpp-python, the optional
extra) over an F16 file written first and deleted after; without llama.cpp, Q4_0 and Q8_0 are
written directly by gguf-py's quantizer. Tensors are written one at a time: an 8B file is
never in memory whole. `bench.model_sizes` runs them.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGUFValueType
from gguf.quants import quantize

from verifier.model.loader import ALIASES, DEFAULT_MODEL


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float = 10000.0
    tied: bool = True          # the LM head is the embedding (no output.weight)


SHAPES = {
    "smollm2-1.7b": Shape(2048, 24, 8192, 32, 32, 49152, 130000.0),
    "llama-3.2-1b": Shape(2048, 16, 8192, 32, 8, 128256, 500000.0),
    "llama-3.2-3b": Shape(3072, 28, 8192, 24, 8, 128256, 500000.0),
    "llama-3.1-8b": Shape(4096, 32, 14336, 32, 8, 128256, 500000.0, tied=False),
}
LLAMA_CPP_FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15, "Q6_K": 18}   # llama.cpp's llama_ftype
DIRECT = ("Q4_0", "Q4_1", "Q8_0", "F16")      # kinds gguf-py writes itself


def tensors(shape: Shape) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(GGUF name, numpy shape) of every tensor of a Llama in `shape`, in file order."""
    h, kv_rows = shape.hidden, shape.hidden // shape.heads * shape.kv_heads
    out = [("token_embd.weight", (shape.vocab, h)), ("output_norm.weight", (h,))]
    out += [] if shape.tied else [("output.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        out += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (h, h)),
                (f"blk.{i}.attn_k.weight", (kv_rows, h)), (f"blk.{i}.attn_v.weight", (kv_rows, h)),
                (f"blk.{i}.attn_output.weight", (h, h)), (f"blk.{i}.ffn_norm.weight", (h,)),
                (f"blk.{i}.ffn_gate.weight", (shape.ffn, h)), (f"blk.{i}.ffn_up.weight", (shape.ffn, h)),
                (f"blk.{i}.ffn_down.weight", (h, shape.ffn))]
    return out


def _copy_tokenizer(reader, writer, vocab: int) -> None:
    """Every tokenizer.* field of `reader` into `writer`; the token list (and its scores and
    types) padded with unused tokens to `vocab` entries."""
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value, sub = f.contents(), (f.types[1] if f.types[0] == GGUFValueType.ARRAY else None)
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<unused_{i}>" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [5] * (vocab - len(value))          # 5: unused
        elif key == "tokenizer.ggml.scores":
            value = value + [0.0] * (vocab - len(value))
        writer.add_key_value(key, value, f.types[0], sub_type=sub)


def write(path: Path, shape: Shape, kind: str, tokenizer_gguf: Path, seed: int = 0) -> None:
    """A llama GGUF of `shape`, random weights, matrices in `kind` (one of DIRECT), norms F32."""
    qtype = gguf.GGMLQuantizationType[kind]
    source = gguf.GGUFReader(str(tokenizer_gguf))
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("embedding_length", shape.hidden), ("feed_forward_length", shape.ffn),
                       ("block_count", shape.layers), ("attention.head_count", shape.heads),
                       ("attention.head_count_kv", shape.kv_heads), ("context_length", 8192)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", shape.rope_theta)
    _copy_tokenizer(source, w, shape.vocab)
    rng, drawn = np.random.default_rng(seed), {}

    def data(dims: tuple[int, ...]) -> np.ndarray:
        if len(dims) == 1:
            return np.ones(dims, np.float32)
        if dims not in drawn:      # one draw per shape, reused by every layer: an 8B model's draws took minutes
            m = rng.standard_normal(dims, dtype=np.float32) * 0.02
            drawn[dims] = m.astype(np.float16) if kind == "F16" else quantize(m, qtype)
        return drawn[dims]
    layout = tensors(shape)
    for name, dims in layout:
        raw = None if len(dims) == 1 or kind == "F16" else qtype
        dtype = np.float32 if len(dims) == 1 else np.float16 if kind == "F16" else np.uint8
        nbytes = _nbytes(dims, kind)
        w.add_tensor_info(name, _stored_shape(dims, kind), np.dtype(dtype), nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, dims in layout:
        w.write_tensor_data(data(dims))
    w.close()


def _nbytes(dims: tuple[int, ...], kind: str) -> int:
    if len(dims) == 1:
        return 4 * dims[0]
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    return dims[0] * dims[1] // block * size


def _stored_shape(dims: tuple[int, ...], kind: str) -> tuple[int, ...]:
    """The byte shape gguf-py records for quantized data (it converts back to element counts)."""
    if len(dims) == 1 or kind == "F16":
        return dims
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    return (dims[0], dims[1] // block * size)


def llama_cpp_quantize(src: Path, dst: Path, kind: str, requantize: bool = False) -> None:
    """`src` quantized to `kind` by llama.cpp (`requantize`: from a quantized file)."""
    import llama_cpp  # lazy: the optional tercel[llamacpp] extra
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = LLAMA_CPP_FTYPES[kind], requantize, 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {dst}")


def has_llama_cpp() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def make(out: Path, name: str, kinds: list[str], seed: int = 0) -> list[Path]:
    """The files `{name}-{kind}.gguf` under `out` (those present are kept)."""
    tokenizer = ALIASES[DEFAULT_MODEL]()
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / f"{name}-{kind}.gguf" for kind in kinds}
    todo = [k for k, p in paths.items() if not p.is_file()]
    if todo and has_llama_cpp():
        f16 = out / f"{name}-F16.gguf"
        write(f16, SHAPES[name], "F16", tokenizer, seed)
        for kind in todo:
            llama_cpp_quantize(f16, paths[kind], kind)
        f16.unlink()
    for kind in todo if not has_llama_cpp() else ():
        if kind not in DIRECT:
            raise ValueError(f"{kind} needs llama.cpp's quantizer: pip install -e \".[llamacpp]\"")
        write(paths[kind], SHAPES[name], kind, tokenizer, seed)
    return list(paths.values())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), action="append", required=True)
    ap.add_argument("--kinds", default="Q4_0,Q4_K_M")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in args.shape:
        for path in make(Path(args.out), name, args.kinds.split(","), args.seed):
            print(path)


if __name__ == "__main__":
    main()

"""GGUF files in llama.cpp's K-quant formats, made here (llama-cpp-python, the optional extra).

    python -m bench.kquant_files --out runs/kquants                 # SmolLM2's Q4_K_M and Q6_K
    python -m bench.kquant_files --out runs/kquants --wide          # and a random model whose rows
                                                                      # are multiples of 256

SmolLM2's rows (576) are not multiples of 256, so llama.cpp stores most of its K-quant files in
the fallback formats (Q5_0, Q8_0): those files are written from the shipped Q4_1 file with
`allow_requantize`. `--wide` also writes an F16 GGUF of random weights (N(0, 0.02)) with
shapes whose rows are multiples of 256 and SmolLM2's tokenizer, and its Q4_1, Q4_K_M and Q6_K
files: there Q4_K_M is Q4_K and Q6_K blocks, as for the models people download. Its tokens mean
nothing; its speed is what such a file's is. Then, for example:

    python -m bench.gguf_formats --files runs/kquants/wide-Q4_1.gguf,runs/kquants/wide-Q4_K_M.gguf
"""
from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np

FTYPES = {"Q4_1": 3, "Q4_K_M": 15, "Q6_K": 18}      # llama.cpp's llama_ftype values
WIDE = {"embedding_length": 1024, "feed_forward_length": 2816, "block_count": 12, "attention.head_count": 16,
        "attention.head_count_kv": 4, "context_length": 8192}


def quantize(src: Path, dst: Path, ftype: int, requantize: bool) -> None:
    import llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = ftype, requantize, 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {dst}")


def _copy_tokenizer(reader, writer) -> None:
    """Every tokenizer.* field of `reader` into `writer`, with its own value type."""
    from gguf import GGUFValueType
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)


def write_wide(path: Path, tokenizer_gguf: Path, seed: int = 0) -> None:
    """An F16 llama GGUF of WIDE's shapes, random weights, the tokenizer of `tokenizer_gguf`."""
    import gguf
    source = gguf.GGUFReader(str(tokenizer_gguf))
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in WIDE.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    _copy_tokenizer(source, w)
    rng = np.random.default_rng(seed)
    h, inter, heads, kv = (WIDE[k] for k in ("embedding_length", "feed_forward_length", "attention.head_count",
                                              "attention.head_count_kv"))
    kv_rows = h // heads * kv

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)
    w.add_tensor("token_embd.weight", matrix(vocab, h))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(WIDE["block_count"]):
        for name, shape in (("attn_q", (h, h)), ("attn_k", (kv_rows, h)), ("attn_v", (kv_rows, h)),
                            ("attn_output", (h, h)), ("ffn_gate", (inter, h)), ("ffn_up", (inter, h)),
                            ("ffn_down", (h, inter))):
            w.add_tensor(f"blk.{i}.{name}.weight", matrix(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--wide", action="store_true")
    args = ap.parse_args(argv)
    from bench.llamacpp import check_llamacpp
    from verifier.model.loader import DEFAULT_MODEL
    shipped = check_llamacpp(DEFAULT_MODEL)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("Q4_K_M", "Q6_K"):
        quantize(shipped, out / f"smollm2-{name}.gguf", FTYPES[name], requantize=True)
    if args.wide:
        write_wide(out / "wide-F16.gguf", shipped)
        for name, ftype in FTYPES.items():
            quantize(out / "wide-F16.gguf", out / f"wide-{name}.gguf", ftype, requantize=False)
    print("\n".join(str(p) for p in sorted(out.glob("*.gguf"))))


if __name__ == "__main__":
    main()

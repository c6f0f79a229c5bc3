"""GGUF files in llama.cpp's K-quant formats, made here (llama-cpp-python, the optional extra).

    python -m bench.kquant_files --out runs/kquants                 # SmolLM2's Q4_K_M and Q6_K
    python -m bench.kquant_files --out runs/kquants --wide          # and a random model whose rows
                                                                      # are multiples of 256

SmolLM2's rows (576) are not multiples of 256, so llama.cpp stores most of its K-quant files in
the fallback formats (Q5_0, Q8_0): those files are written from the shipped Q4_1 file with
`allow_requantize`. `--wide` also writes an F16 GGUF of random weights (N(0, 0.02),
`bench.model_shapes.write`) with shapes whose rows are multiples of 256 and SmolLM2's
tokenizer, and its Q4_1, Q4_K_M and Q6_K files: there Q4_K_M is Q4_K and Q6_K blocks, as for
the models people download. Its tokens mean nothing; its speed is what such a file's is. Then, for example:

    python -m bench.gguf_formats --files runs/kquants/wide-Q4_1.gguf,runs/kquants/wide-Q4_K_M.gguf
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.llamacpp import check_llamacpp
from bench.model_shapes import Shape, llama_cpp_quantize, write
from verifier.model.loader import DEFAULT_MODEL

KINDS = ("Q4_1", "Q4_K_M", "Q6_K")
WIDE = Shape(hidden=1024, layers=12, ffn=2816, heads=16, kv_heads=4, vocab=49152)   # the default tokenizer's


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--wide", action="store_true")
    args = ap.parse_args(argv)
    shipped = check_llamacpp(DEFAULT_MODEL)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("Q4_K_M", "Q6_K"):
        llama_cpp_quantize(shipped, out / f"smollm2-{name}.gguf", name, requantize=True)
    if args.wide:
        write(out / "wide-F16.gguf", WIDE, "F16", shipped)
        for name in KINDS:
            llama_cpp_quantize(out / "wide-F16.gguf", out / f"wide-{name}.gguf", name)
    print("\n".join(str(p) for p in sorted(out.glob("*.gguf"))))


if __name__ == "__main__":
    main()

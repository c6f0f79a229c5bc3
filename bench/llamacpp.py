"""llama.cpp (llama-cpp-python) on the same GGUF as a baseline: `tercel bench speed --llamacpp`.

An optional extra (`pip install -e ".[llamacpp]"`, which compiles llama.cpp for minutes);
it runs the model file Tercel serves, with as many threads as torch uses, on the prompts
Tercel gets (token ids from the same chat template). Greedy at T=0 (top-k 1); above it,
llama.cpp's own sampler with no top-k, top-p or min-p, seeded per prompt.
"""
from __future__ import annotations

import time
from pathlib import Path

from bench.runner import Turn
from verifier.model.loader import ALIASES

INSTALL_HINT = ('tercel bench --llamacpp needs llama-cpp-python: pip install -e ".[llamacpp]" '
                '(on CPUs with AMX that the kernel does not grant, build it with '
                'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON")')


def check_llamacpp(model: str) -> Path:
    """The GGUF file llama.cpp would run; ValueError (exit 2) without the extra or a GGUF."""
    try:
        # lazy: llama-cpp-python is the optional tercel[llamacpp] extra
        import llama_cpp  # noqa: F401
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return gguf_file(model)


def gguf_file(model: str) -> Path:
    if model in ALIASES:
        return ALIASES[model]()
    path = Path(model).expanduser()
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        path = found[0] if len(found) == 1 else path
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"the llama.cpp baseline runs a GGUF file; {model!r} is not one")
    return path


class LlamaCppGenerator:
    def __init__(self, model: str, max_tokens: int, ignore_eos: bool, threads: int, tokenizer):
        from llama_cpp import Llama  # lazy: the optional tercel[llamacpp] extra
        self.llm = Llama(model_path=str(gguf_file(model)), n_threads=threads, n_threads_batch=threads,
                         n_ctx=4096, n_batch=512, verbose=False)
        self.max_tokens, self.ignore_eos, self.tokenizer = max_tokens, ignore_eos, tokenizer
        self.eos = self.llm.token_eos()

    def generate(self, prompt_ids: list[int], temperature: float, seed: int) -> Turn:
        self.llm.reset()
        self.llm.set_seed(seed)
        sampling = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0) if temperature > 0 \
            else dict(temp=0.0, top_k=1)
        new, first = [], None
        start = time.perf_counter()
        for token in self.llm.generate(prompt_ids, reset=True, repeat_penalty=1.0, **sampling):
            first = first or time.perf_counter()
            if token == self.eos and not self.ignore_eos:
                break
            new.append(token)
            if len(new) >= self.max_tokens:
                break
        return Turn(new, self.tokenizer.decode(new, skip_special_tokens=True), (first or time.perf_counter()) - start)

    def timing(self) -> tuple[int, float, float]:
        return 0, 0.0, 0.0

    def close(self) -> None:
        pass

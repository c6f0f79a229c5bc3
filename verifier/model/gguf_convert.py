"""A GGUF checkpoint (llama.cpp format) as an HF-style directory of metadata: config.json (from
the file's fields), the tokenizer files (transformers rebuilds them from the file) and an index of
every tensor in the file. The weights are not copied: each load reads them from the GGUF
(`verifier.model.gguf_weights`), quantized ones in their own blocks (`gguf_quant`).
Mixture-of-experts files (Mixtral as llama with `llama.expert_count`, Qwen3-MoE as qwen3moe) hold
each layer's experts in 3-D tensors (`ffn_*_exps`: [experts, rows, cols]), read as one HF tensor
per expert."""
from __future__ import annotations

import hashlib
import json
import shutil
from importlib.metadata import version
from pathlib import Path

import torch

from verifier.cpu.cache import build_once, cache_root
from verifier.model.config import GEMMA_TYPES
from verifier.model.gemma_config import gguf_fields
from verifier.model.gguf_header import GGUFHeader
from verifier.model.gguf_quant import INDEX_FILE, block_index
from verifier.model.gguf_tokenizer import buildable, byte_level_tokenizer
from verifier.model.gguf_weights import GGUFTensors, tensor_index

# GGUF general.architecture -> the HF class its config names (mistral GGUFs load as llama; a
# llama GGUF with experts is a Mixtral)
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
TOKENIZER_FORMAT = 2      # a new form of the converted tokenizer files is converted anew (2: built here)
_MODEL_TYPES = {"mistral": "llama", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}   # GGUF architecture -> model_type
def eos_ids(reader) -> int | list[int] | None:
    """The end-of-sequence id, with the end-of-turn one where the file names it (Gemma's
    <end_of_turn>, which its chat template closes each turn with)."""
    eos, eot = _field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")
    return eos if eot is None or eot == eos else [i for i in (eos, eot) if i is not None]


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not one Tercel serves "
                         f"({', '.join(GGUF_ARCHITECTURES)})")
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    if any(n.startswith("rope_factors") for n in tensor_names):
        raise ValueError(f"GGUF architecture {arch!r} with LongRoPE factors (rope_factors_*) is not supported")
    experts = int(a("expert_count", 0))
    cfg = {
        "architectures": ["MixtralForCausalLM" if experts else GGUF_ARCHITECTURES[arch]],
        "model_type": "mixtral" if arch == "llama" and experts else _MODEL_TYPES.get(arch, arch),
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length", a("expert_feed_forward_length"))),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": int(a("attention.key_length", a("rope.dimension_count", hidden // heads))),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(a("context_length", 4096)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids(reader),
        "torch_dtype": "float32",
    }
    if experts:
        cfg.update(_moe_fields(cfg["model_type"], a, experts, tensor_names))
    if a("attention.sliding_window"):
        cfg["sliding_window"] = int(a("attention.sliding_window"))
    if cfg["model_type"] in GEMMA_TYPES:
        cfg.update(gguf_fields(arch, a, cfg))
    scaling = a("rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(a("rope.scaling.factor", 1.0)),
                               "original_max_position_embeddings":
                                   int(a("rope.scaling.original_context_length", cfg["max_position_embeddings"]))}
    return cfg


def _moe_fields(model_type: str, a, experts: int, tensor_names: set[str]) -> dict:
    """config.json's expert keys. llama.cpp renormalises Qwen3-MoE's top-k weights unless the
    file says otherwise; a layer without a router (ffn_gate_inp) is a dense one."""
    if int(a("expert_shared_count", 0)):
        raise ValueError(f"GGUF {model_type} with shared experts (expert_shared_count) is not supported")
    if int(a("expert_gating_func", 1)) != 1 or float(a("expert_weights_scale", 1.0)) != 1.0:
        raise ValueError(f"GGUF {model_type}: only softmax routing with unscaled weights is supported "
                         "(expert_gating_func, expert_weights_scale)")
    if a("expert_used_count") is None:
        raise ValueError(f"GGUF {model_type} with experts lacks expert_used_count")
    fields = {"num_experts_per_tok": int(a("expert_used_count"))}
    if model_type == "mixtral":
        return {**fields, "num_local_experts": experts}
    layers = int(a("block_count"))
    return {**fields, "num_experts": experts, "moe_intermediate_size": int(a("expert_feed_forward_length")),
            "norm_topk_prob": bool(a("expert_weights_norm", True)),
            "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]}


def gguf_tensors(reader, cfg: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the file, fp32, by HF name (one per expert for an ffn_*_exps tensor)."""
    tensors = GGUFTensors(reader.data.filename, tensor_index(reader), cfg)
    return {name: tensors.get(name) for name in tensors.names()}


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, the tensors' index and tokenizer files into out_dir: the weights stay
    in the GGUF, read from it at each load (`verifier.model.gguf_weights`)."""
    reader = GGUFHeader(str(gguf_path))
    cfg = gguf_config(reader)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    (out_dir / INDEX_FILE).write_text(json.dumps({**block_index(reader, gguf_path), "all": tensor_index(reader)}))
    tokenizer = tokenizer_folder(reader)
    if not (tokenizer / "tokenizer.json").is_file():
        build_once(tokenizer, lambda tmp: _convert_tokenizer(reader, gguf_path, tmp))
    for f in tokenizer.iterdir():
        shutil.copyfile(f, out_dir / f.name)


def tokenizer_folder(reader) -> Path:
    """Where the file's converted tokenizer is cached: keyed by the bytes of its tokenizer.*
    fields, its architecture and transformers' version, so the files of one family (its sizes
    and quantizations) share one conversion."""
    digest = hashlib.sha256(f"{TOKENIZER_FORMAT}:{version('transformers')}".encode())
    for key, (start, end) in reader.spans.items():
        if key.startswith("tokenizer.") or key == "general.architecture":
            digest.update(reader.data[start:end])
    return cache_root() / "tokenizers" / digest.hexdigest()[:16]


def _convert_tokenizer(reader, gguf_path: Path, out_dir: Path) -> None:
    """The tokenizer files of the GGUF's metadata: a byte-level BPE vocabulary built here
    (`verifier.model.gguf_tokenizer`), others by transformers, which rebuilds a fast tokenizer
    (and the chat template). A BPE ("gpt2") vocabulary gets the generic class whichever way:
    asked for it directly, it skips AutoTokenizer's reading the whole file's metadata with gguf-py
    to choose a class (most of its time: docs/performance.md, "Load and import times")."""
    fields = {k: _field(reader, k) for k in reader.fields if k.startswith("tokenizer.")}
    if buildable(fields):
        _write_tokenizer(reader, fields, out_dir)
        return
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # lazy: ~1 s; a tokenizer not built above
    bpe = _field(reader, "tokenizer.ggml.model") == "gpt2"
    tok = (PreTrainedTokenizerFast if bpe else AutoTokenizer).from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    tok.save_pretrained(str(out_dir))


def _write_tokenizer(reader, fields: dict, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json and the chat template, as transformers saves them."""
    tok, config = byte_level_tokenizer(reader.strings("tokenizer.ggml.tokens"), reader.strings("tokenizer.ggml.merges"),
                                       fields.get("tokenizer.ggml.token_type"), fields)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if isinstance(fields.get("tokenizer.chat_template"), str):
        (out_dir / "chat_template.jinja").write_text(fields["tokenizer.chat_template"])

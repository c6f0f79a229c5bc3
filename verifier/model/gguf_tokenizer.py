"""A GGUF's byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2": Llama 3, Qwen 2 and 3, SmolLM)
built with `tokenizers` from the file's fields as transformers' GGUF conversion builds it
(transformers/integrations/gguf/gguf_tokenizer_mapping.py: a GPT2Tokenizer over the file's
vocabulary and merges, its control tokens special, its user-defined ones added, the split its
`tokenizer.ggml.pre` names, BOS and EOS by the file's flags), without importing transformers:
that import and its Python read of the file's metadata were most of a first load's tokenizer
conversion (docs/performance.md, "First loads"). tests/model/test_gguf_tokenizer.py holds the two
to the same tokenizer.json.

What this does not build (`buildable` is False), transformers converts: sentencepiece and
unigram vocabularies, a file without merges, a pre-tokenizer named neither in `SPLITS` nor in
`GPT2_SPLIT`. One difference by design: transformers' GPT2Tokenizer adds "<|endoftext|>" as a new
token where the vocabulary lacks it (Llama 3's), an id past the model's vocabulary; this does not.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from verifier.model.tokenizer import byte_spelling

CONTROL, USER_DEFINED = 3, 4          # llama.cpp's token types

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# The splits transformers gives these pre-tokenizers (GGUF_PRE_TOKENIZER_SPLITS; tested equal).
SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
          "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
# Pre-tokenizers transformers leaves to GPT-2's own split (absent from its table; tested).
GPT2_SPLIT = ("smollm", "gpt-2")


def buildable(fields: dict) -> bool:
    """Whether `byte_level_tokenizer` builds this file's tokenizer (`fields`: its tokenizer.* fields by key)."""
    pre = fields.get("tokenizer.ggml.pre")
    return fields.get("tokenizer.ggml.model") == "gpt2" and "tokenizer.ggml.merges" in fields \
        and (pre in SPLITS or pre in GPT2_SPLIT)


def byte_level_tokenizer(tokens: list[str], merges: list[str], token_types: list[int] | None,
                         fields: dict) -> tuple[Tokenizer, dict]:
    """(the tokenizer, its tokenizer_config fields) of a file `buildable` takes."""
    spelling = byte_spelling()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = SPLITS.get(fields.get("tokenizer.ggml.pre"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = token_types or []
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab])
    names = _special_names(tokens, fields)
    bos, eos = (names[n] if fields.get(f"tokenizer.ggml.add_{n}", False) else None for n in ("bos_token", "eos_token"))
    tok.post_processor = _post_processor(tok, bos, eos)
    return tok, {"backend": "tokenizers", **names, "model_max_length": int(1e30), "tokenizer_class": "TokenizersBackend"}


def _special_names(tokens: list[str], fields: dict) -> dict[str, str | None]:
    """The named special tokens by the file's ids (tokenizer_config.json's fields, as transformers writes them)."""
    return {name: tokens[fields[f"tokenizer.ggml.{key}"]] if f"tokenizer.ggml.{key}" in fields else None
            for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                              ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}


def _post_processor(tok: Tokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """`bos` before and `eos` after each sequence (None: not added), as transformers sets them."""
    single = f"{f'{bos}:0 ' if bos else ''}$A:0{f' {eos}:0' if eos else ''}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[(t, tok.token_to_id(t)) for t in (bos, eos) if t])

"""A GGUF's byte-level BPE tokenizer built without transformers (verifier/model/gguf_tokenizer.py)
is the one transformers' GGUF conversion builds: the same tokenizer.json, special tokens and
chat template, on the default model's file and on a Llama-3-style one (its split, BOS added,
control and user-defined tokens, a token outside the byte alphabet)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from verifier.model import gguf_convert
from verifier.model.gguf_header import GGUFHeader
from verifier.model.gguf_tokenizer import GPT2_SPLIT, SPLITS, buildable
from verifier.model.loader import ALIASES, DEFAULT_MODEL

SPELLED = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ"]     # "Ġ": a space, "Ċ": a newline


def _llama3_style(path, pre: str = "llama-bpe"):
    """A GGUF holding only a tokenizer of Llama 3's make: control tokens first, the byte
    alphabet's printable part, merges, a user-defined <think>, a token spelled in UTF-8 ("€")."""
    import gguf
    controls = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|endoftext|>"]
    merged = ["Ġt", "he", "Ġthe", "in", "Ġin"]
    tokens = controls + SPELLED + merged + ["<think>", "€"]
    types = [3] * len(controls) + [1] * (len(SPELLED) + len(merged)) + [4, 1]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he", "i n", "Ġ in"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _both(path, tmp_path):
    """(ours, transformers') converted folders of the GGUF at `path`."""
    from transformers import PreTrainedTokenizerFast
    reader = GGUFHeader(str(path))
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    gguf_convert._convert_tokenizer(reader, path, ours)
    PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name,
                                            local_files_only=True).save_pretrained(str(theirs))
    return ours, theirs


def _same_folders(ours, theirs) -> None:
    assert json.loads((ours / "tokenizer.json").read_text()) == json.loads((theirs / "tokenizer.json").read_text())
    mine, their = (json.loads((d / "tokenizer_config.json").read_text()) for d in (ours, theirs))
    assert mine == {k: v for k, v in their.items() if k not in ("is_local", "local_files_only")}
    assert (ours / "chat_template.jinja").read_text() == (theirs / "chat_template.jinja").read_text()


def test_the_default_models_tokenizer_is_transformers_own(tmp_path):
    path = ALIASES[DEFAULT_MODEL]()
    assert buildable({k: f.contents() for k, f in GGUFHeader(str(path)).fields.items()})
    _same_folders(*_both(path, tmp_path))


def test_a_llama3_style_tokenizer_is_transformers_own_and_encodes_alike(tmp_path):
    from tokenizers import Tokenizer
    path = _llama3_style(tmp_path / "tok.gguf")
    ours, theirs = _both(path, tmp_path)
    _same_folders(ours, theirs)
    a, b = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (ours, theirs))
    for text in ("the thin<think>in", "<|eot_id|> the\n\nthe  €in", "x"):
        assert a.encode(text).ids == b.encode(text).ids and a.encode(text).ids[0] == 0     # BOS added
        assert a.decode(a.encode(text).ids, skip_special_tokens=False) == b.decode(b.encode(text).ids,
                                                                                   skip_special_tokens=False)


def test_its_splits_are_transformers_own():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    assert all(GGUF_PRE_TOKENIZER_SPLITS[pre] == split for pre, split in SPLITS.items())
    assert not set(GPT2_SPLIT) & set(GGUF_PRE_TOKENIZER_SPLITS)      # transformers leaves GPT-2's split there


@pytest.mark.parametrize("fields", [{"tokenizer.ggml.model": "llama", "tokenizer.ggml.merges": 1},
                                    {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe"},
                                    {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "tekken",
                                     "tokenizer.ggml.merges": 1}])
def test_what_it_does_not_build_is_left_to_transformers(fields):
    """A sentencepiece vocabulary, a file without merges, a split it does not hold."""
    assert not buildable(fields)


def test_converting_the_default_models_gguf_imports_no_transformers(tmp_path):
    code = ("import sys; from pathlib import Path; from verifier.model.gguf_convert import convert_gguf; "
            "from verifier.model.loader import ALIASES, DEFAULT_MODEL; "
            "convert_gguf(ALIASES[DEFAULT_MODEL](), Path(sys.argv[1])); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True,
                         env={**__import__("os").environ, "TERCEL_CACHE": str(tmp_path / "cache")}, check=True)
    assert out.stdout.split() == ["False"]
    assert (tmp_path / "out" / "tokenizer.json").is_file()

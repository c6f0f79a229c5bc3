"""A thin tokenizer over `tokenizers` + the model's Jinja chat template.

Importing transformers is slow (figures: docs/performance.md, "Load and import times");
serving only needs encode, decode and the chat template, so we read tokenizer.json and the
template directly (transformers is still what converts GGUF tokenizers, and the tests check
this wrapper against it).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


class Tokenizer:
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as HFTokenizer
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer.json in {model_dir}")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.chat_template = _read_template(model_dir, cfg)
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size()
        self._template = None

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def special_token_ids(self) -> list[int]:
        """Added tokens marked special (chat markers, EOS): never text inside an output."""
        return sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def vocab_encoding(self) -> tuple[str, bool]:
        """How vocabulary entries spell their bytes, as grammar engines need it: ("byte_level",
        GPT-2's byte-to-unicode map), ("byte_fallback", SentencePiece with <0xNN> tokens) or
        ("raw", ...), and whether a leading space is added to the text (SentencePiece's "▁")."""
        spec = json.loads(self._tok.to_str())
        decoder = spec.get("decoder") or {}
        steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        kinds = {d.get("type") for d in steps}
        encoding = "byte_level" if "ByteLevel" in kinds else "byte_fallback" if "ByteFallback" in kinds else "raw"
        prefix = "Metaspace" in kinds or any(d.get("type") == "Strip" and d.get("start") for d in steps)
        return encoding, prefix

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._tok.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True, **_ignored) -> list[int] | str:
        """Render the template as transformers does (sandboxed Jinja, trim/lstrip blocks)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        text = self._compiled().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        # The template already writes special tokens such as BOS; do not add them twice.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _compiled(self):
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template


def prompt_ids(tokenizer, prompt: str | list[int]) -> list[int]:
    """A prompt as token ids: text through `tokenizer` (an empty string is no tokens), ids as given."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"] if prompt else []
    return list(prompt)


def _raise(message: str):
    raise ValueError(f"chat template: {message}")


def _read_template(model_dir: Path, cfg: dict) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):   # named templates: take the default one
        tpl = next((t["template"] for t in tpl if t.get("name") == "default"), None)
    return tpl


class NullTokenizer:
    """For checkpoints without tokenizer files (tiny test models): token ids in, no text out."""
    bos_token_id = eos_token_id = None
    chat_template = None
    vocab = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        raise ValueError("this model has no tokenizer files; pass prompts as token ids")

    encode = __call__

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""

    def apply_chat_template(self, *args, **kwargs):
        raise ValueError("this model has no tokenizer files, so no chat template")

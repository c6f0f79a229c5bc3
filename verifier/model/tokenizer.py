"""A thin tokenizer over `tokenizers` + the model's Jinja chat template.

Importing transformers is slow (figures: docs/performance.md, "Load and import times");
serving only needs encode, decode and the chat template, so we read tokenizer.json and the
template directly (a GGUF's tokenizer files are written by `verifier.model.gguf_convert`, by
transformers where it does not build them itself, and the tests check this wrapper against
transformers).
"""
from __future__ import annotations

import copy
import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


@lru_cache(maxsize=1)
def byte_spelling() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: the alphabet byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def _jinja2():
    """jinja2 with its meta and sandbox modules, imported with the first chat template read or rendered."""
    # lazy: ~0.07 s on `import spec` (jinja2 compiles its identifier pattern); only chat templates need it
    import jinja2.meta
    import jinja2.sandbox
    return jinja2


class Tokenizer:
    def __init__(self, model_dir: Path):
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
        self._reads_tools = None  # (template, whether it reads `tools`)
        self._specials = None     # ({text: AddedToken}, pattern) of special added tokens
        self._plain = None

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
        # encode_batch releases the GIL (encode holds it): a long prompt tokenized on a
        # server's worker thread then does not stall the event loop.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._tok.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True, allow_special_tokens_in_content: bool = False,
                            tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                            **_ignored) -> list[int] | str:
        """Render the template as transformers does (sandboxed Jinja, trim/lstrip blocks;
        `tools` in the template's `tools` variable, `chat_template_kwargs` as more variables).

        Special-token strings inside what a client wrote (message content, names, tool calls,
        the tools, the extra variables) become plain text tokens, so a client cannot forge a
        turn; `allow_special_tokens_in_content=True` parses them as tokens instead, as
        transformers does. The rendered text is the same either way."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        extra = chat_template_kwargs or {}
        if not tokenize:
            return self._render(messages, add_generation_prompt, tools, extra)
        written = [messages, tools, list(extra.values())]    # an extra variable may be named `role`
        if allow_special_tokens_in_content or not any(map(self._has_special_text, _strings(written))):
            # Nothing to forge: encode the whole text, so ordinary chats keep their ids exactly.
            # The template already writes special tokens such as BOS; do not add them twice.
            return self.encode(self._render(messages, add_generation_prompt, tools, extra), add_special_tokens=False)
        return self._encode_escaped(messages, add_generation_prompt, tools, extra)

    def with_chat_template(self, template: str) -> "Tokenizer":
        """This tokenizer rendering `template` instead of the model's (`tercel serve
        --chat-template`); compiled here, so a template that does not parse fails at startup."""
        twin = copy.copy(self)
        twin.chat_template, twin._template, twin._reads_tools = template, None, None
        twin._compiled()
        return twin

    @property
    def renders_tools(self) -> bool:
        """The chat template reads a `tools` variable: it writes the tools and calls itself."""
        if self.chat_template is None:
            return False
        if self._reads_tools is None or self._reads_tools[0] != self.chat_template:
            meta = _jinja2().meta
            names = meta.find_undeclared_variables(self._environment().parse(self.chat_template))
            self._reads_tools = self.chat_template, "tools" in names
        return self._reads_tools[1]

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
                extra: dict | None = None) -> str:
        TemplateError = _jinja2().TemplateError
        try:    # the caller's variables first: the ones the template is given win
            return self._compiled().render({**(extra or {}), "messages": messages,
                                            "add_generation_prompt": add_generation_prompt, "tools": tools,
                                            "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""})
        except TemplateError as e:    # what it was given does not render (undefined, sandboxed): the input's
            raise ValueError(f"chat template: {e}") from None

    def _special_table(self) -> tuple[dict, re.Pattern]:
        """Special added tokens by text, and a pattern of their texts longest first (the
        tokenizer's leftmost-longest match)."""
        if self._specials is None:
            specials = {t.content: t for t in self._tok.get_added_tokens_decoder().values() if t.special}
            words = sorted(specials, key=len, reverse=True)
            self._specials = specials, re.compile("|".join(map(re.escape, words)) if words else "(?!)")
        return self._specials

    def _special_pattern(self) -> re.Pattern:
        return self._special_table()[1]

    def _has_special_text(self, text: str) -> bool:
        pattern, norm = self._special_pattern(), self._tok.normalizer
        # A normalized added token matches the normalized text, so look there too.
        return bool(pattern.search(text) or (norm is not None and pattern.search(norm.normalize_str(text))))

    def _encode_escaped(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
                        extra: dict) -> list[int]:
        """Hide content's special-token strings behind placeholders while rendering, so the
        only special strings left are the template's; the text between those is encoded with
        special-token parsing off, the hidden strings restored."""
        hidden: list[str] = []
        mark = _free_mark(self.chat_template)
        # The mark itself is hidden too, so content cannot spell a placeholder.
        pattern = re.compile(f"{self._special_pattern().pattern}|{mark}")

        def hide(text: str) -> str:
            def one(m: re.Match) -> str:
                hidden.append(m[0])
                return f"{mark}{len(hidden) - 1}{mark}"
            return pattern.sub(one, text)

        text = self._render(_map_strings(messages, hide), add_generation_prompt, _map_strings(tools, hide),
                            {k: _map_strings(v, hide) for k, v in extra.items()})
        placeholder = re.compile(f"{mark}(\\d+){mark}")

        def restore(m: re.Match) -> str:
            # A non-content field may spell a placeholder; it stays as written.
            return hidden[int(m[1])] if int(m[1]) < len(hidden) else m[0]

        ids: list[int] = []
        for piece, special in self._split_specials(text):
            if special:
                ids.append(self._tok.token_to_id(piece))
            elif piece:
                ids += self._as_text(placeholder.sub(restore, piece))
        return ids

    def _split_specials(self, text: str) -> list[tuple[str, bool]]:
        """(piece, is special token) in order, as the tokenizer splits on added tokens first;
        an lstrip/rstrip token takes the whitespace beside it, as it does in the tokenizer."""
        specials, pattern = self._special_table()
        pieces: list[tuple[str, bool]] = []
        start = 0
        for m in pattern.finditer(text):
            pieces += [(text[start:m.start()], False), (m[0], True)]
            start = m.end()
        pieces.append((text[start:], False))
        for i in range(1, len(pieces), 2):
            tok = specials[pieces[i][0]]
            if tok.lstrip:
                pieces[i - 1] = (pieces[i - 1][0].rstrip(), False)
            if tok.rstrip:
                pieces[i + 1] = (pieces[i + 1][0].lstrip(), False)
        return pieces

    def _as_text(self, text: str) -> list[int]:
        # A copy of the tokenizer that reads special-token strings as ordinary text.
        if self._plain is None:
            plain = HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    def _compiled(self):
        if self._template is None:
            self._template = self._environment().from_string(self.chat_template)
        return self._template

    @staticmethod
    def _environment():
        ImmutableSandboxedEnvironment = _jinja2().sandbox.ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env


def prompt_ids(tokenizer, prompt: str | list[int]) -> list[int]:
    """A prompt as token ids: text through `tokenizer` (an empty string is no tokens), ids as given."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"] if prompt else []
    return list(prompt)


def _strings(value):
    """Every text a client wrote: the strings inside messages and tools, roles aside."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, v in value.items():
            if key != "role":
                yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _map_strings(value, fn):
    """`value` with `fn` applied to each of its `_strings`."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: v if k == "role" else _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value


def _free_mark(template: str) -> str:
    """A private-use character the template never writes: placeholders nothing else spells."""
    return next(c for c in map(chr, range(0xE000, 0xF900)) if c not in template)


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

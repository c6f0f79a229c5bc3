"""Logprobs in OpenAI's shapes (chat: `logprobs.content`; completions: `tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`), from the engine's `TokenLogprob`s.

A token is reported as its own text, and as its bytes: a byte-level BPE token can hold part of
a character, which its text alone cannot show (the bytes come from the vocabulary's spelling).
An impossible token's -inf is OpenAI's -9999.0: JSON has no infinity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from verifier.model.tokenizer import byte_spelling
from verifier.sampling.logprobs import TokenLogprob

IMPOSSIBLE = -9999.0


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: how byte-level vocabularies spell each byte."""
    return {c: b for b, c in byte_spelling().items()}


@dataclass
class TokenPieces:
    """Each token's text and bytes, cached (read on the event loop: a dict lookup after the first)."""
    tokenizer: object
    _cache: dict = field(default_factory=dict)

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            text = self.tokenizer.decode([token])
            hit = self._cache[token] = (text, self._bytes(token, text))
        return hit

    def _bytes(self, token: int, text: str) -> list[int]:
        encoding = getattr(self.tokenizer, "vocab_encoding", None)
        if encoding is not None and encoding()[0] == "byte_level":
            piece = self.tokenizer.convert_ids_to_tokens([token])[0]
            table = _unicode_to_byte()
            if piece is not None and all(c in table for c in piece):
                return [table[c] for c in piece]
        return list(text.encode("utf-8", "surrogatepass"))


def _value(logprob: float) -> float:
    return IMPOSSIBLE if math.isinf(logprob) or math.isnan(logprob) else logprob


def chat_logprobs(entries: list[TokenLogprob], pieces: TokenPieces) -> dict:
    def one(token: int, logprob: float) -> dict:
        text, raw = pieces(token)
        return {"token": text, "logprob": _value(logprob), "bytes": raw}
    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob | None], pieces: TokenPieces, tokens: list[int],
                        offset: int = 0) -> dict:
    """`tokens[i]`'s entry is entries[i] (None: the prompt's first token, which has no logprob);
    text offsets count from `offset`, the characters before the first token."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, e in zip(tokens, entries):
        text = pieces(token)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(None if e is None else _value(e.logprob))
        out["top_logprobs"].append(None if e is None else {pieces(t)[0]: _value(lp) for t, lp in e.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out

"""Incremental detokenization with stop strings.

Byte-level BPE tokens can split one UTF-8 character across tokens; decoding a partial
character yields U+FFFD. We decode a small window (prefix_offset..end) and only release
text once it no longer ends in U+FFFD, so streamed deltas never carry a broken character.
With stop strings, the last len(longest stop) - 1 characters are held back until they
cannot be the start of a stop string, so a stop string never leaks into a delta.

As vLLM: the text leaves out the stop string and the text of the token that ended the
request (EOS, a stop token) unless `include_stop`, and stop strings count only once the
output is longer than min_tokens (they search the text that arrives from then on).
"""
from __future__ import annotations

from verifier.sampling.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 include_stop: bool = False, min_tokens: int = 0, finishing_ids: frozenset[int] = frozenset()):
        """`finishing_ids`: the tokens that end the request once past min_tokens (their text is
        left out unless `include_stop`)."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special = skip_special_tokens
        self.include_stop, self.min_tokens, self.finishing_ids = include_stop, min_tokens, finishing_ids
        self.text = ""               # decoded so far (cut at a stop string once one is found)
        self.emitted = 0             # chars of self.text already handed out as deltas
        self.prefix_offset = 0       # token window start for decoding the next piece
        self.read_offset = 0         # tokens whose text is already in self.text
        self.stopped_by: str | None = None
        self._holdback = max((len(s) for s in stop), default=1) - 1

    @classmethod
    def of(cls, tokenizer, params: SamplingParams, finishing_ids: frozenset[int]) -> "IncrementalDetokenizer":
        return cls(tokenizer, params.stop, params.skip_special_tokens, params.include_stop_str_in_output,
                   params.min_tokens, finishing_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _visible(self, output_ids: list[int]) -> list[int]:
        """The tokens whose text the output shows: all but a last one that ended the request."""
        ends = output_ids and output_ids[-1] in self.finishing_ids and len(output_ids) > self.min_tokens
        return output_ids[:-1] if ends and not self.include_stop else output_ids

    def add(self, output_ids: list[int]) -> None:
        """Decode tokens appended since the last call; detect stop strings."""
        total, output_ids = len(output_ids), self._visible(output_ids)
        if self.stopped_by is not None or len(output_ids) == self.read_offset:
            return
        prefix_text = self._decode(output_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(output_ids[self.prefix_offset:])
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            return  # an incomplete character (or nothing visible yet): wait for more tokens
        start = max(0, len(self.text) - self._holdback)
        self.text += new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        self._find_stop(start, total)

    def _find_stop(self, start: int, num_output: int) -> None:
        if num_output <= self.min_tokens:
            return
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if hits:
            i, s = min(hits)
            self.text, self.stopped_by = self.text[:i + len(s) if self.include_stop else i], s

    def flush(self, output_ids: list[int]) -> None:
        """At finish: take whatever is left, an incomplete trailing character included."""
        total, output_ids = len(output_ids), self._visible(output_ids)
        if self.stopped_by is None and len(output_ids) > self.read_offset:
            prefix_text = self._decode(output_ids[self.prefix_offset:self.read_offset])
            start = max(0, len(self.text) - self._holdback)
            self.text += self._decode(output_ids[self.prefix_offset:])[len(prefix_text):]
            self.read_offset = len(output_ids)
            self._find_stop(start, total)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, keep back a possible stop-string start."""
        end = len(self.text) if finished or self.stopped_by else max(self.emitted, len(self.text) - self._holdback)
        delta, self.emitted = self.text[self.emitted:end], end
        return delta

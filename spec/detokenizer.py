"""Incremental detokenization with stop strings.

Byte-level BPE tokens can split one UTF-8 character across tokens; decoding a partial
character yields U+FFFD. We decode a small window (prefix_offset..end) and only release
text once it no longer ends in U+FFFD, so streamed deltas never carry a broken character.
With stop strings, the last len(longest stop) - 1 characters are held back until they
cannot be the start of a stop string, so a stop string never leaks into a delta.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special = skip_special_tokens
        self.text = ""               # decoded so far (cut at a stop string once one is found)
        self.emitted = 0             # chars of self.text already handed out as deltas
        self.prefix_offset = 0       # token window start for decoding the next piece
        self.read_offset = 0         # tokens whose text is already in self.text
        self.stopped_by: str | None = None
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, output_ids: list[int]) -> None:
        """Decode tokens appended since the last call; detect stop strings."""
        if self.stopped_by is not None or len(output_ids) == self.read_offset:
            return
        prefix_text = self._decode(output_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(output_ids[self.prefix_offset:])
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            return  # an incomplete character (or nothing visible yet): wait for more tokens
        start = max(0, len(self.text) - self._holdback)
        self.text += new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        self._find_stop(start)

    def _find_stop(self, start: int) -> None:
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if hits:
            i, s = min(hits)
            self.text, self.stopped_by = self.text[:i], s

    def flush(self, output_ids: list[int]) -> None:
        """At finish: take whatever is left, an incomplete trailing character included."""
        if self.stopped_by is None and len(output_ids) > self.read_offset:
            prefix_text = self._decode(output_ids[self.prefix_offset:self.read_offset])
            start = max(0, len(self.text) - self._holdback)
            self.text += self._decode(output_ids[self.prefix_offset:])[len(prefix_text):]
            self.read_offset = len(output_ids)
            self._find_stop(start)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, keep back a possible stop-string start."""
        end = len(self.text) if finished or self.stopped_by else max(self.emitted, len(self.text) - self._holdback)
        delta, self.emitted = self.text[self.emitted:end], end
        return delta

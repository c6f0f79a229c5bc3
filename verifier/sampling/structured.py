"""`StructuredOutputs`: the constraint a request's output must satisfy (vLLM's
`StructuredOutputsParams`, under `SamplingParams(structured=...)`).

Exactly one kind per request:
    json         a JSON Schema (a dict, or its text); OpenAI's `response_format` json_schema
    json_object  any JSON object; OpenAI's `response_format` {"type": "json_object"}
    regex        a regular expression the whole output matches
    grammar      an EBNF grammar (GBNF, as llama.cpp writes it; the root rule is `root`)
    choice       one of these strings, exactly
    structural_tag  an xgrammar structural tag (its JSON): free text with constrained spans,
                 as tool calls are (serving/tools/); vLLM's `structural_tag`

Plain data, no xgrammar: `verifier.sampling.grammar` compiles it against the model's vocabulary.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "grammar", "choice", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None               # JSON Schema text (a dict is serialised in its key order:
    #                                       properties are generated in that order)
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    structural_tag: str | None = None      # a dict is serialised as `json` is

    def __post_init__(self):
        for name in ("json", "structural_tag"):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, json.dumps(getattr(self, name)))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if self._given(k)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured output {name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c
                                                               for c in self.choice)):
            raise ValueError(f"structured output choice must be non-empty strings, got {self.choice!r}")

    def _given(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is not False and value is not None

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._given(k))

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: (kind, its text)."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            value = json.dumps(value)
        return self.kind, "" if value is True else value

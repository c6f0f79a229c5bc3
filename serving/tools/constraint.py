"""The grammar of a reply that may or must call tools: an xgrammar structural tag (vLLM and
SGLang constrain tool calls the same way), written here from the format's own strings.

    auto       free text in which the format's trigger does not appear, then calls (none or
               more) to listed functions with arguments valid for their `parameters`, one
               after another with the format's separator between, and nothing after them
    required   the same calls, at least one, from the reply's first character
    a name     exactly one call to that function, and nothing else
`parallel_tool_calls: false` allows one call at most. With `auto`, a constraint on the text
(`response_format`, `guided_*`) holds a reply that calls no tool: it is either that text or
calls from its first character.

Arguments are held to the schema whatever `strict` says (as `response_format` is), and an
omitted `parameters` is OpenAI's "no parameters": the object {}.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from serving.tools.formats import ToolFormat
from verifier.sampling.structured import StructuredOutputs

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str                   # "none", "auto", "required" or "named"
    name: str | None = None     # the function of "named"
    parallel: bool = True


def tool_constraint(fmt: ToolFormat, tools: list[dict] | None, choice: ToolChoice,
                    text: StructuredOutputs | None = None) -> StructuredOutputs | None:
    """The constraint of a request offering `tools` (OpenAI's shape), `text` the one its text
    reply has; None when the reply is unconstrained."""
    if choice.mode == "none" or not tools:
        return text
    functions = [t["function"] for t in tools]
    if choice.mode == "named":
        return _tag(_call(fmt, next(f for f in functions if f["name"] == choice.name)))
    if choice.mode == "required":
        return _tag(_calls(fmt, functions, choice.parallel, at_least_one=True))
    if text is not None:
        return _tag({"type": "or", "elements": [as_format(text), _calls(fmt, functions, choice.parallel, True)]})
    free = {"type": "any_text", "excludes": [fmt.trigger]}
    return _tag({"type": "sequence", "elements": [free, _calls(fmt, functions, choice.parallel, at_least_one=False)]})


def _calls(fmt: ToolFormat, functions: list[dict], parallel: bool, at_least_one: bool) -> dict:
    return {"type": "tags_with_separator", "tags": [_call(fmt, f) for f in functions], "separator": fmt.separator,
            "at_least_one": at_least_one, "stop_after_first": not parallel}


def as_format(text: StructuredOutputs) -> dict:
    """A text constraint as a structural tag's format."""
    kind, value = text.key
    if kind in ("json", "json_object"):
        return {"type": "json_schema", "json_schema": json.loads(value) if kind == "json" else {"type": "object"}}
    if kind in ("regex", "choice"):
        return {"type": "regex", "pattern": value if kind == "regex" else "|".join(map(re.escape, text.choice))}
    if kind == "grammar":
        return {"type": "grammar", "grammar": value}
    return json.loads(value)["format"]


def _call(fmt: ToolFormat, function: dict) -> dict:
    params = function.get("parameters")
    return {"type": "tag", "begin": f"{fmt.begin}{function['name']}{fmt.between}",
            "content": {"type": "json_schema", "json_schema": NO_PARAMETERS if params is None else params},
            "end": fmt.end}


def _tag(format_: dict) -> StructuredOutputs:
    return StructuredOutputs(structural_tag={"type": "structural_tag", "format": format_})

"""A conversation with tools as the chat template gets it.

A template that renders tools itself (it reads a `tools` variable, as Qwen's and Llama 3.1's
do) gets them as transformers passes them: `tools=`, assistant turns with `tool_calls` (their
arguments as objects, as vLLM hands them over) and `tool` turns as they are. A template that
does not (SmolLM2's) gets plain turns written in the server's tool format: the tools'
preamble, the calls as the format writes them, the results in the format's role (Hermes:
a user turn of `<tool_response>` blocks). `developer` is the system role either way.
"""
from __future__ import annotations

import json

from serving.tools.formats import ToolFormat


def template_messages(messages: list[dict], tools: list[dict] | None, fmt: ToolFormat,
                      template_knows_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to render; tools is None where the messages now carry them."""
    messages = [_system_role(m) for m in messages]
    if template_knows_tools:
        return [_native(m) for m in messages], tools
    turns = _written(messages, fmt)
    return (_offer(turns, tools, fmt) if tools else turns), None


def _system_role(message: dict) -> dict:
    return {**message, "role": "system"} if message["role"] == "developer" else message


def _native(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _as_object(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "content": message.get("content") or "", "tool_calls": calls}


def _as_object(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _written(messages: list[dict], fmt: ToolFormat) -> list[dict]:
    turns: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            if fmt.name == "hermes":
                block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
                if turns and turns[-1].get("_results"):       # consecutive results: one user turn
                    turns[-1] = {**turns[-1], "content": turns[-1]["content"] + "\n" + block}
                else:
                    turns.append({"role": fmt.tool_role, "content": block, "_results": True})
            else:
                turns.append({"role": fmt.tool_role, "content": m.get("content") or ""})
        elif m.get("tool_calls"):
            calls = fmt.separator.join(fmt.call_text(c["function"]["name"], c["function"]["arguments"])
                                       for c in m["tool_calls"])
            text = m.get("content") or ""
            turns.append({k: v for k, v in m.items() if k != "tool_calls"}
                         | {"content": f"{text}\n{calls}" if text else calls})
        else:
            turns.append(m)
    return [{k: v for k, v in t.items() if k != "_results"} for t in turns]


def _offer(turns: list[dict], tools: list[dict], fmt: ToolFormat) -> list[dict]:
    preamble = fmt.preamble(tools)
    if fmt.in_system:
        if turns and turns[0]["role"] == "system":
            return [{**turns[0], "content": f"{turns[0].get('content') or ''}\n\n{preamble}"}, *turns[1:]]
        return [{"role": "system", "content": preamble}, *turns]
    at = next((i for i, t in enumerate(turns) if t["role"] == "user"), None)
    if at is None:
        return [{"role": "user", "content": preamble}, *turns]
    first = turns[at]
    return [*turns[:at], {**first, "content": f"{preamble}\n\n{first.get('content') or ''}"}, *turns[at + 1:]]

"""The tool fields of a chat request checked and put in plain form, before any work: a
mistake is a ValueError naming its field (`Refused`), which the route answers with a 400."""
from __future__ import annotations

from serving.tools.constraint import ToolChoice


class Refused(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def chat_messages(messages) -> list[dict]:
    """The request's messages as the template's dicts: text parts joined with "\\n" (as vLLM),
    `name`, `tool_calls` and `tool_call_id` kept where given."""
    out = []
    for i, m in enumerate(messages):
        _check_message(i, m)
        content = m.content if m.content is None or isinstance(m.content, str) else "\n".join(
            p.text for p in m.content)
        turn = {"role": m.role, "content": content}
        if m.name is not None:
            turn["name"] = m.name
        if m.tool_calls:
            turn["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        out.append(turn)
    return out


def _check_message(i: int, m) -> None:
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise Refused(f"messages[{i}].content", f"'messages[{i}].content' may be null only in an assistant "
                                                f"message with tool_calls")
    if m.tool_calls and m.role != "assistant":
        raise Refused(f"messages[{i}].tool_calls", f"'messages[{i}].tool_calls' belongs to assistant messages, "
                                                   f"not {m.role!r} ones")
    if m.role == "tool" and not m.tool_call_id:
        raise Refused(f"messages[{i}].tool_call_id", f"'messages[{i}].tool_call_id' is required in a tool message")


def tool_request(body) -> tuple[list[dict] | None, ToolChoice]:
    """(the tools in OpenAI's shape, the choice among them)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    names = [t["function"]["name"] for t in tools or ()]
    seen = set()
    for i, name in enumerate(names):
        if name in seen:
            raise Refused(f"tools[{i}].function.name", f"two tools are named {name!r}")
        seen.add(name)
    parallel = body.parallel_tool_calls is not False
    choice = body.tool_choice
    if choice is None:
        return tools, ToolChoice("auto" if tools else "none", parallel=parallel)
    if isinstance(choice, str):
        if choice == "required" and not tools:
            raise Refused("tool_choice", "'tool_choice' is \"required\" but the request has no tools")
        return tools, ToolChoice(choice, parallel=parallel)
    if choice.function.name not in seen:
        raise Refused("tool_choice.function.name", f"'tool_choice' names {choice.function.name[:64]!r}, "
                                                   f"which is not among the request's tools")
    return tools, ToolChoice("named", choice.function.name, parallel)

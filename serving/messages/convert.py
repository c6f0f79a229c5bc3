"""A Messages body as the chat request the chat route validates and runs: the limits, the
refusals and the fault isolation are then the chat route's own (serving/app.py:Routes.parsed_chat).

    system                          a system message first (text blocks joined with newlines)
    user text blocks                a user message (consecutive ones, joined with newlines)
    user tool_result blocks         a `tool` message each, for the call `tool_use_id` names
    assistant text, tool_use        an assistant message with `tool_calls` ({"id", "name", input as JSON})
    assistant thinking blocks       left out: the template is given the replies, not their thinking
    tools, tool_choice              OpenAI's tools; auto/any/tool/none -> auto/required/named/none
    stop_sequences, thinking        stop; the template's enable_thinking (enabled: true, disabled: false),
                                    budget_tokens as thinking_token_budget under a reasoning parser
    output_config.format            response_format json_schema

What the body asks and Tercel does not do is a 400 naming the field, before any work: a block
the text-only model cannot read, Anthropic's own tools, a last assistant turn to continue.
"""
from __future__ import annotations

import json

from pydantic import ValidationError

from serving.fields import Unsupported, check_extra
from serving.messages.schemas import CountTokensRequest, MessagesRequest, OtherBlock, TextBlock, \
    ThinkingEnabled, ThinkingDisabled, ToolResultBlock, ToolUseBlock
from serving.protocol import bad
from serving.schemas import ChatCompletionRequest

# Fields of Anthropic's request that would change the reply and that Tercel does not do.
UNSUPPORTED = {
    "container": Unsupported("is not supported: there is no code-execution container"),
    "mcp_servers": Unsupported("is not supported: the server connects to no MCP server", (None, [])),
    "context_management": Unsupported("is not supported: the conversation is used as sent"),
}
# Bookkeeping: accepted, no effect (the prefix cache needs no `cache_control`; there is one region).
ACCEPTED = frozenset({"cache_control", "inference_geo", "speed", "diagnostics", "user_profile_id", "workspace_id"})
DROPPED = ("thinking", "redacted_thinking")     # an assistant's earlier thinking: not in the prompt
CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_request(body: MessagesRequest | CountTokensRequest, budgets: bool = False) -> ChatCompletionRequest:
    """The chat request `body` asks for; APIError (400) naming the Messages field for what it cannot.
    `budgets`: the server parses reasoning, so thinking.budget_tokens is held (not only accepted)."""
    check_extra(body.model_extra, UNSUPPORTED, ACCEPTED)
    fields = {"model": body.model, "messages": [*_system(body.system), *_turns(body.messages)],
              **_tools(body), **_output(body, budgets)}
    if isinstance(body, MessagesRequest):
        fields.update(_sampling(body))
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:    # the body's own checks should have caught it; say what, not where
        raise bad(None, f"the request is not valid as a conversation: {e.errors()[0]['msg']}") from None


def _sampling(body: MessagesRequest) -> dict:
    return {"max_tokens": body.max_tokens, "stop": body.stop_sequences or None, "temperature": body.temperature,
            "top_p": body.top_p, "top_k": body.top_k, "stream": bool(body.stream), "speculation": body.speculation}


def _system(system) -> list[dict]:
    if system is None:
        return []
    content = system if isinstance(system, str) else [{"type": "text", "text": b.text} for b in system]
    return [{"role": "system", "content": content}]


def _turns(messages) -> list[dict]:
    if messages[-1].role == "assistant":
        raise bad(f"messages[{len(messages) - 1}]", f"'messages[{len(messages) - 1}]' is an assistant turn: "
                                                    f"continuing it (prefill) is not supported; the reply is "
                                                    f"always a new assistant turn")
    turns = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            turns.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            turns += _user(i, m.content)
        else:
            turns.append(_assistant(i, m.content))
    return turns


def _user(i: int, blocks: list) -> list[dict]:
    """Text blocks as user turns, each tool_result as a tool turn, in their order."""
    turns, text = [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append({"type": "text", "text": b.text})
            continue
        if not isinstance(b, ToolResultBlock):
            raise _misplaced(f"messages[{i}].content[{j}]", b, "user")
        if text:
            turns.append({"role": "user", "content": text})
            text = []
        turns.append({"role": "tool", "tool_call_id": b.tool_use_id,
                      "content": _result(f"messages[{i}].content[{j}].content", b.content)})
    if text or not turns:
        turns.append({"role": "user", "content": text or ""})
    return turns


def _result(param: str, content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for k, part in enumerate(content):
        if isinstance(part, OtherBlock):
            raise _unreadable(f"{param}[{k}]", part)
    return "\n".join(part.text for part in content)


def _assistant(i: int, blocks: list) -> dict:
    text, calls = [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append({"type": "text", "text": b.text})
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": _arguments(f"messages[{i}].content[{j}]", b)}})
        elif b.type not in DROPPED:
            raise _misplaced(f"messages[{i}].content[{j}]", b, "assistant")
    turn = {"role": "assistant", "content": text or (None if calls else "")}
    return {**turn, "tool_calls": calls} if calls else turn


def _arguments(param: str, block: ToolUseBlock) -> str:
    arguments = json.dumps(block.input, ensure_ascii=False)
    try:
        arguments.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{param}.input", f"'{param}.input' holds a lone surrogate (a UTF-16 half, not text)") from None
    return arguments


def _misplaced(param: str, block, role: str):
    if isinstance(block, OtherBlock):
        return _unreadable(param, block)
    article = "an" if role == "assistant" else "a"
    return bad(param, f"'{param}' is a {block.type} block, which does not belong in {article} {role} message")


def _unreadable(param: str, block: OtherBlock):
    if block.type in ("image", "document"):
        return bad(param, f"'{param}' is {'an' if block.type == 'image' else 'a'} {block.type} block: this server's "
                          f"model reads text only")
    return bad(param, f"'{param}' is a {block.type[:64]!r} block, which this server does not take "
                      f"(text, tool_use, tool_result and thinking blocks only)")


def _tools(body) -> dict:
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice.type in ("any", "tool"):
            raise bad("tool_choice", f"'tool_choice' is {{\"type\": \"{body.tool_choice.type}\"}} "
                                     f"but the request has no tools")
        return {"tool_choice": "none"} if body.tool_choice is not None else {}
    tools = [_tool(i, t) for i, t in enumerate(body.tools)]
    choice = body.tool_choice
    if choice is None:
        return {"tools": tools}
    picked = {"type": "function", "function": {"name": choice.name}} if choice.type == "tool" \
        else CHOICES[choice.type]
    parallel = {"parallel_tool_calls": False} if getattr(choice, "disable_parallel_tool_use", None) else {}
    return {"tools": tools, "tool_choice": picked, **parallel}


def _tool(i: int, tool) -> dict:
    if tool.type not in (None, "custom"):
        raise bad(f"tools[{i}].type", f"'tools[{i}].type' is {tool.type[:64]!r}: Anthropic's own tools are not "
                                      f"supported; send a custom tool with an input_schema")
    if tool.input_schema is None:
        raise bad(f"tools[{i}].input_schema", f"'tools[{i}].input_schema' is required")
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _output(body, budgets: bool) -> dict:
    """The template's thinking switch and budget, and the text's JSON Schema."""
    out = {}
    if isinstance(body.thinking, (ThinkingEnabled, ThinkingDisabled)):
        out["chat_template_kwargs"] = {"enable_thinking": isinstance(body.thinking, ThinkingEnabled)}
    if isinstance(body.thinking, ThinkingEnabled) and budgets:
        out["thinking_token_budget"] = body.thinking.budget_tokens
    config = body.output_config
    if config is not None and config.format is not None:
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "output", "schema": config.format.schema_}}
    return out

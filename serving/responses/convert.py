"""A Responses body as the chat request it asks for, so that the chat route's own checks,
limits and refusals hold for it; and the chat route's refusals named by the Responses fields.

Input items become chat messages: a message as it is (its text parts joined by newlines, as
the chat route joins them); consecutive `function_call` items one assistant turn with those
`tool_calls` (after the assistant's text, where a message item came just before); a
`function_call_output` a `tool` turn; a `reasoning` item nothing (chat templates drop earlier
turns' reasoning). `instructions` is a system message first, for this request alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import ValidationError

from serving.protocol import APIError, bad, validation_error
from serving.responses.schemas import (SHARED, FunctionCallItem, FunctionCallOutput, InputMessage, ResponsesRequest,
                                       TextConfig)
from serving.schemas import ChatCompletionRequest


@dataclass(frozen=True)
class Turn:
    """One request's conversation: what came before it and its input, as chat messages."""
    conversation: tuple[dict, ...]      # instructions left out: they are not carried over
    chat: ChatCompletionRequest         # the chat request: instructions, conversation, fields


def turn(body: ResponsesRequest, history: tuple[dict, ...]) -> Turn:
    """`history`: the stored conversation `previous_response_id` names (empty without one)."""
    conversation = history + tuple(input_messages(body.input, history))
    system = ({"role": "system", "content": body.instructions},) if body.instructions is not None else ()
    fields = body.model_dump(include=set(SHARED), exclude_none=True, by_alias=True)
    if body.reasoning is not None and body.reasoning.effort is not None:
        # vLLM's name for it; the client's own chat_template_kwargs win
        fields["chat_template_kwargs"] = {"reasoning_effort": body.reasoning.effort,
                                          **fields.get("chat_template_kwargs", {})}
    if not conversation:
        raise bad("input", "'input' holds no message (reasoning items alone are left out of the prompt)")
    chat = {**fields, "model": body.model, "messages": [*system, *conversation],
            "max_tokens": body.max_output_tokens, "response_format": response_format(body.text), **tool_fields(body)}
    try:
        return Turn(conversation, ChatCompletionRequest.model_validate(chat))
    except ValidationError as e:    # the Responses schema checked every field: a chat rule it does not state
        raise renamed(validation_error([{**x, "loc": ("body", *x["loc"])} for x in e.errors()])) from None


def input_messages(items, history: tuple[dict, ...]) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    calls = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    messages: list[dict] = []
    for i, item in enumerate(items):
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": text_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            _add_call(messages, {"id": item.call_id, "type": "function",
                                 "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutput):
            if item.call_id not in calls:
                raise bad(f"input[{i}].call_id", f"'input[{i}].call_id' is {item.call_id[:64]!r}, which names no "
                                                 f"function call before it (in the input or the previous response)")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
    return messages


def _add_call(messages: list[dict], call: dict) -> None:
    """Into the assistant turn just before (its text, or its calls so far), else a turn of its own."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        messages[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or ()), call]}
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def text_of(content) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def tool_fields(body: ResponsesRequest) -> dict:
    out = {}
    if body.tools:
        out["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                        for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        out["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                     "function": {"name": choice.name}}
    return out


# ---- refusals ---------------------------------------------------------------------------------
# A chat field's name -> the Responses field it came from (a prefix of the param, a word in the message).
RENAMED = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
           ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
           ("tool_choice.function.name", "tool_choice.name"), ("messages", "input"))
TOOL_FIELD = re.compile(r"^tools\[(\d+)\]\.function\.")
QUOTED_MESSAGES = re.compile(r"'messages(\[\d+\][\w.\[\]]*)?'")


def renamed(e: APIError) -> APIError:
    """The chat route's refusal, naming the Responses field at fault. The messages' indices are
    not the input's (instructions and a previous response come first): `messages[i]` is `input`."""
    param, message = e.param, QUOTED_MESSAGES.sub("'input'", e.message)
    for chat, ours in RENAMED:
        if param is not None and (param == chat or param.startswith((chat + ".", chat + "["))):
            param = ours if chat == "messages" else ours + param[len(chat):]
        if chat != "messages":      # a field's name, not the English word
            message = re.sub(rf"\b{re.escape(chat)}\b", ours, message)
    if param is not None:
        param = TOOL_FIELD.sub(r"tools[\1].", param)
    return APIError(e.status, message, param=param, type_=e.type, code=e.code, headers=e.headers)

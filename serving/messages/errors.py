"""Errors as Anthropic sends them, on the Messages routes alone: `{"type": "error", "error":
{"type", "message"}}` with the status the chat route answers for the same refusal (the
OpenAI routes keep OpenAI's shape). The error's type follows the status, as Anthropic's do;
its message names the Messages field at fault, as the `param` of OpenAI's shape would.
"""
from __future__ import annotations

import re

from serving.messages.schemas import field_names
from serving.protocol import APIError, validation_error

PREFIX = "/v1/messages"
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
         503: "overloaded_error"}     # the engine is stopping or failed, or the replica was lost: retry
FIELD_NAMES = field_names()
EXPECTED = {"content": "a string or an array of content blocks", "system": "a string or an array of text blocks",
            "speculation": '"auto", "off" or an object {"drafter", "gamma", "topk", "budget"}'}


def is_messages(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def anthropic_body(e: APIError) -> dict:
    kind = TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def messages_validation_error(errors: list[dict]) -> APIError:
    """A body that fails validation: a 400 naming the Messages field (its own names and unions)."""
    return validation_error(errors, FIELD_NAMES, EXPECTED)


# A refusal of the chat request a Messages body became names the chat's field; the client sent
# another. Each rule rewrites a quoted chat name (in the message, and the param) to the Messages one.
RENAMES = [(re.compile(r"'stop(?=['\[])"), "'stop_sequences"),
           (re.compile(r"'tools\[(\d+)\]\.function\.parameters"), r"'tools[\1].input_schema"),
           (re.compile(r"'tools\[(\d+)\]\.function"), r"'tools[\1]"),
           (re.compile(r"'tool_choice\.function\.name"), "'tool_choice.name"),
           (re.compile(r"'response_format\.json_schema\.schema"), "'output_config.format.schema"),
           (re.compile(r"'response_format"), "'output_config.format"),
           (re.compile(r"'chat_template_kwargs[^']*"), "'thinking"),
           (re.compile(r"'thinking_token_budget"), "'thinking.budget_tokens")]


def renamed(e: APIError) -> APIError:
    """The chat route's refusal `e` in the words of the Messages body."""
    message, param = e.message, None if e.param is None else f"'{e.param}'"
    for pattern, name in RENAMES:
        message = pattern.sub(name, message)
        param = None if param is None else pattern.sub(name, param)
    return APIError(e.status, message, None if param is None else param.strip("'"), e.type, e.code, e.headers)

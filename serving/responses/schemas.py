"""The request body of `POST /v1/responses`, and the response object `/openapi.json` documents.

OpenAI's Responses fields, and the sampling fields /v1/chat/completions takes beyond them
(`top_k`, `seed`, `stop`, `speculation`, ...): those are the chat request's own declarations,
shared (`SHARED`), so both routes validate them alike. Validation is as strict as the chat
route's (serving/schemas.py). Unknown fields are kept aside (`model_extra`) for
serving/responses/policy.py; items and tools ignore the fields of OpenAI's that change nothing
here (an output item's `status`, a text part's `annotations`).

Unions whose members are told apart by `type` use a callable discriminator whose tags are no
field's name: a validation error's `param` is then the path a client wrote (`text.format.schema`,
not `text.format.json_schema.schema`; serving/protocol.py drops what is not a field's name).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, create_model

from serving.schemas import FUNCTION_NAME, ChatCompletionRequest, NonEmptyText, Text, TercelStats, whole

# The chat request's fields a Responses body takes as they are (vLLM takes these too).
SHARED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logit_bias", "stop_token_ids", "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "seed",
          "stop", "ignore_eos", "speculation", "parallel_tool_calls", "chat_template_kwargs", "user", "service_tier")
TEXT_ONLY = ("input_image", "input_file", "input_audio")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Item(BaseModel):
    # Fields of OpenAI's this server does not read (an item's `status`, a part's `annotations`) are ignored.
    model_config = ConfigDict(strict=True, extra="ignore")


def _shared_fields() -> dict:
    fields = ChatCompletionRequest.model_fields
    return {name: (fields[name].annotation, fields[name]) for name in SHARED}


SharedFields = create_model("ResponsesSharedFields", __base__=_Body, **_shared_fields())


def _text_only(value):
    if value in TEXT_ONLY:
        raise ValueError(f"is {value!r}: this server takes text only")
    return value


def _function_only(value):
    if isinstance(value, str) and value != "function":
        raise ValueError(f"is {value[:64]!r}: this server runs no built-in tools (OpenAI's web search, file "
                         f"search, code interpreter, ...), only function tools")
    return value


def _by_type(prefix: str, kinds: tuple[str, ...], default: str | None = None):
    """The tag of a union member: its `type` (or `default` when absent) under `prefix`, or None."""
    def tag(value) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        return f"{prefix}:{kind}" if kind in kinds else None
    return tag


class ContentPart(_Item):
    type: Annotated[Literal["input_text", "output_text"], BeforeValidator(_text_only)]
    text: Text


Content = Union[Text, list[ContentPart]]


class InputMessage(_Item):
    """A message: `{role, content}` (OpenAI's easy form) or an item of type `message`,
    an assistant's output message included."""
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content = Field(description="a string, or text parts (input_text, output_text) joined by newlines")


class FunctionCallItem(_Item):
    """A call the model made (an earlier response's output item)."""
    type: Literal["function_call"]
    call_id: NonEmptyText
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: Text = Field(description="the arguments as a JSON text")


class FunctionCallOutput(_Item):
    """The result of a call, to the call with this `call_id`."""
    type: Literal["function_call_output"]
    call_id: NonEmptyText
    output: Content


class ReasoningItem(_Item):
    """An earlier response's reasoning, handed back: accepted, and left out of the prompt (chat
    templates drop earlier turns' reasoning)."""
    type: Literal["reasoning"]


ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
InputItem = Annotated[
    Union[Annotated[InputMessage, Tag("item:message")], Annotated[FunctionCallItem, Tag("item:function_call")],
          Annotated[FunctionCallOutput, Tag("item:function_call_output")],
          Annotated[ReasoningItem, Tag("item:reasoning")]],
    Discriminator(_by_type("item", ITEM_KINDS, "message"), custom_error_type="invalid_item",
                  custom_error_message="should be an item of type 'message', 'function_call', 'function_call_output' "
                                       "or 'reasoning' (item references and built-in tools' items are not supported)")]


class FunctionTool(_Item):
    type: Annotated[Literal["function"], BeforeValidator(_function_only)]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments; absent: none")
    strict: bool | None = Field(None, description="arguments always follow the schema, strict or not (as vLLM)")


class FunctionChoice(_Item):
    type: Annotated[Literal["function"], BeforeValidator(_function_only)]
    name: str


class FormatText(_Item):
    type: Literal["text"]


class FormatJSONObject(_Item):
    type: Literal["json_object"]


class FormatJSONSchema(_Item):
    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON Schema the output follows")
    description: str | None = None
    strict: bool | None = Field(None, description="the schema is always enforced, strict or not (as vLLM)")


TextFormat = Annotated[
    Union[Annotated[FormatText, Tag("format:text")], Annotated[FormatJSONObject, Tag("format:json_object")],
          Annotated[FormatJSONSchema, Tag("format:json_schema")]],
    Discriminator(_by_type("format", ("text", "json_object", "json_schema")), custom_error_type="invalid_format",
                  custom_error_message="should be an object of type 'text', 'json_object' or 'json_schema'")]


class TextConfig(_Item):
    format: TextFormat | None = Field(None, description="structured output (docs/structured.md)")
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="\"medium\" or null only (400)")


class ReasoningConfig(_Item):
    effort: str | None = Field(None, description="given to the chat template as `reasoning_effort` (as vLLM)")
    summary: str | None = Field(None, description="accepted; no summary is written (reasoning items carry "
                                                  "the reasoning text itself)")


class ResponsesRequest(SharedFields):
    model: str
    input: NonEmptyText | Annotated[list[InputItem], Field(min_length=1)] = Field(
        description="a user message's text, or items: messages, function calls and their outputs")
    instructions: Text | None = Field(None, description="a system message before the input; not carried over "
                                                        "by previous_response_id")
    previous_response_id: str | None = Field(None, description="a stored response this one continues")
    max_output_tokens: whole(ge=1) | None = Field(None, description="default: what the context length leaves")
    stream: bool | None = False
    store: bool | None = Field(True, description="keep the response for previous_response_id and GET (in "
                                                 "this server's memory, bounded)")
    tools: list[FunctionTool] | None = Field(None, description="function tools only")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = Field(
        None, description='default: "auto" with tools, "none" without')
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = Field(None, description="returned with the response")
    include: list[str] | None = Field(None, description="none supported: a non-empty list is a 400")
    background: bool | None = Field(None, description="false only: a response runs while its request is open")
    truncation: Literal["auto", "disabled"] | None = Field(None, description='"disabled" only: a conversation '
                                                                             'past the context is refused')
    top_logprobs: whole(ge=0, le=20) | None = Field(None, description="0 only: logprobs are not supported here")
    max_tool_calls: whole(ge=1) | None = Field(None, description="accepted; no effect (it caps built-in tools)")
    prompt_cache_key: str | None = Field(None, description="accepted; no effect")
    safety_identifier: str | None = Field(None, description="accepted; no effect")
    stream_options: dict[str, Any] | None = Field(None, description="accepted; no effect")


# ---- the response object (documented in /openapi.json; the routes build dicts) ----------------
class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list = Field(description="always empty")
    logprobs: list = Field(description="always empty")


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: Literal["completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"]
    id: str
    summary: list = Field(description="always empty")
    content: list[ReasoningText]
    status: Literal["completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="the reply's tokens up to the end of its reasoning block")


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict | None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[Annotated[Union[OutputMessage, OutputFunctionCall, OutputReasoning], Field(discriminator="type")]]
    usage: ResponseUsage | None
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[FunctionTool]
    tool_choice: str | FunctionChoice
    parallel_tool_calls: bool
    text: dict
    reasoning: dict
    store: bool
    metadata: dict[str, str]
    tercel: TercelStats | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


def responses_field_names() -> frozenset[str]:
    """Every field name of the request's models: what a validation error's location can name."""
    models = (ResponsesRequest, ContentPart, InputMessage, FunctionCallItem, FunctionCallOutput, ReasoningItem,
              FunctionTool, FunctionChoice, FormatJSONSchema, TextConfig, ReasoningConfig)
    return frozenset(f.alias or name for m in models for name, f in m.model_fields.items())

"""The bodies of Anthropic's Messages API as pydantic models: what FastAPI validates and
`/openapi.json` publishes for `/v1/messages` and `/v1/messages/count_tokens`.

Field names and shapes are those of Anthropic's API (as the `anthropic` SDK sends them).
Validation is as strict as the chat route's (serving/schemas.py). A content block of a kind
Tercel does not take (an image, a document, a server tool's result) passes validation as
`OtherBlock`, so that the refusal can say what it is and where (convert.py); unknown fields
of the request are kept aside for the field policy (convert.py), those of a block ignored
(`cache_control`, `citations`: bookkeeping).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from serving.schemas import FUNCTION_NAME, NonEmptyText, Speculation, SpeculationOptions, TercelStats, Text, whole


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Model):
    type: Literal["text"]
    text: Text


class ToolUseBlock(_Model):
    """An assistant's call, replayed: given to the chat template as the chat route's tool_calls."""
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(_Model):
    """An assistant's earlier thinking, replayed: accepted and left out of the prompt."""
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str


class OtherBlock(_Model):
    """Any other kind of block (image, document, server tools' blocks): refused, naming it."""
    model_config = ConfigDict(strict=True, extra="allow")
    type: str


def _tag(known: frozenset[str]):
    """The union's tag of a block: its kind if known, else "other". A tag is never a field name
    (it would show in the field a validation error names)."""
    def tag(value) -> str:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return f"{kind} block" if isinstance(kind, str) and kind in known else "other block"   # any JSON comes here
    return tag


ResultPart = Annotated[Union[Annotated[TextBlock, Tag("text block")], Annotated[OtherBlock, Tag("other block")]],
                       Discriminator(_tag(frozenset({"text"})))]


class ToolResultBlock(_Model):
    """A tool's result, sent in a user message: the chat route's `tool` message."""
    type: Literal["tool_result"]
    tool_use_id: str
    content: Text | list[ResultPart] | None = Field(None, description="text, or text blocks joined with newlines")
    is_error: bool | None = Field(None, description="accepted; the model reads the result's text alone")


Block = Annotated[Union[Annotated[TextBlock, Tag("text block")], Annotated[ToolUseBlock, Tag("tool_use block")],
                        Annotated[ToolResultBlock, Tag("tool_result block")],
                        Annotated[ThinkingBlock, Tag("thinking block")],
                        Annotated[RedactedThinkingBlock, Tag("redacted_thinking block")],
                        Annotated[OtherBlock, Tag("other block")]],
                  Discriminator(_tag(frozenset({"text", "tool_use", "tool_result", "thinking", "redacted_thinking"})))]


class MessageParam(_Model):
    role: Literal["user", "assistant"]
    content: Text | list[Block]


class ToolParam(_Model):
    """A client tool. `input_schema` is required of it; a `type` other than "custom" is one of
    Anthropic's own tools (server tools, its bash or editor tools), refused (convert.py)."""
    name: str = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    input_schema: dict[str, Any] | None = Field(None, description="a JSON Schema of the input (required)")
    type: str | None = Field(None, description='"custom" or absent')
    strict: bool | None = Field(None, description="the input always follows the schema, strict or not")


class _Choice(_Model):
    disable_parallel_tool_use: bool | None = Field(None, description="true: one call at most")


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    type: Literal["any"]


class NamedChoice(_Choice):
    type: Literal["tool"]
    name: str


class NoChoice(_Model):
    type: Literal["none"]


ToolChoice = Annotated[Union[AutoChoice, AnyChoice, NamedChoice, NoChoice], Field(discriminator="type")]


class ThinkingEnabled(_Model):
    type: Literal["enabled"]
    budget_tokens: whole(ge=1) = Field(description="the thinking block's tokens at most, then its end is forced "
                                                "(under the server's --reasoning-parser; accepted, not held, "
                                                "without one); the thinking counts in max_tokens")


class ThinkingDisabled(_Model):
    type: Literal["disabled"]


class ThinkingAdaptive(_Model):
    type: Literal["adaptive"]


Thinking = Annotated[Union[ThinkingEnabled, ThinkingDisabled, ThinkingAdaptive], Field(discriminator="type")]


class JSONOutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON Schema the reply's text follows")


class OutputConfig(_Model):
    format: JSONOutputFormat | None = None
    effort: str | None = Field(None, description="accepted; no effect (a hint to Claude's own thinking)")


class _Conversation(_Model):
    """What both routes read: the conversation, its tools and the template's thinking switch.
    Unknown fields are kept aside (`model_extra`) for the field policy."""
    model_config = ConfigDict(strict=True, extra="allow")
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: Text | list[TextBlock] | None = Field(None, description="text, or text blocks joined with newlines")
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = Field(None, description='default: {"type": "auto"} with tools')
    thinking: Thinking | None = Field(None, description="sets the chat template's enable_thinking "
                                                        "(enabled: true, disabled: false)")
    output_config: OutputConfig | None = None


class MessagesRequest(_Conversation):
    max_tokens: whole(ge=1)
    stop_sequences: list[NonEmptyText] | None = None
    temperature: float | None = Field(None, ge=0, le=1, description="default: the model's generation_config.json")
    top_p: float | None = Field(None, gt=0, le=1, description="default: the model's generation_config.json")
    top_k: whole(ge=0) | None = Field(None, description="0: off; default: the model's generation_config.json")
    stream: bool | None = False
    metadata: dict[str, Any] | None = Field(None, description="accepted; no effect")
    service_tier: str | None = Field(None, description="accepted; no effect")
    speculation: Speculation | None = Field(
        "auto", description='Tercel\'s: "auto" (the server decides), "off", or caps on the draft tree')


class CountTokensRequest(_Conversation):
    pass


# ---- responses (documented in /openapi.json) ------------------------------------------------
class MessageUsage(BaseModel):
    input_tokens: int = Field(description="prompt tokens not read from the prefix cache")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="prompt tokens read from the prefix cache")
    cache_creation_input_tokens: int = Field(description="always 0: the prefix cache fills itself")


class TextContent(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(description="the call's arguments; {} where max_tokens cut them")


class ThinkingContent(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str = Field(description="always empty")


class Message(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[TextContent | ToolUseContent | ThinkingContent]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage
    tercel: TercelStats = Field(description="how the speculation went (Tercel's)")


class TokenCount(BaseModel):
    input_tokens: int


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    type: Literal["error"]
    error: ErrorDetail


def field_names() -> frozenset[str]:
    """Every field name of the request models: what a validation error's location can name."""
    models = (MessagesRequest, CountTokensRequest, MessageParam, TextBlock, ToolUseBlock, ToolResultBlock,
              ThinkingBlock, RedactedThinkingBlock, OtherBlock, ToolParam, AutoChoice, AnyChoice, NamedChoice,
              NoChoice, ThinkingEnabled, ThinkingDisabled, ThinkingAdaptive, JSONOutputFormat, OutputConfig,
              SpeculationOptions)
    return frozenset(f.alias or name for m in models for name, f in m.model_fields.items())

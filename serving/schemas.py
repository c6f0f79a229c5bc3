"""The request and response bodies of the OpenAI-compatible routes, as pydantic models.

FastAPI validates every body against these before a handler runs, and `/openapi.json`
publishes them. Field names, types and ranges are OpenAI's; `speculation`, `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos` and the `guided_*` constraints are the extensions vLLM and
SGLang clients already send.

Validation is strict, as JSON Schema reads the published schema: a string is not an integer,
`true` is not a number, and 2.0 is the integer 2. `null` means "the default" wherever OpenAI's own API allows it.

Text: JSON can carry a lone UTF-16 surrogate ("\\ud800"), which is no character and which no
tokenizer can encode, so it is refused (400, naming the field). NUL ("\\u0000") is a character
like any other: the byte-level tokenizer encodes it as its byte token, and it is kept.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from verifier.sampling.sampling_params import MAX_LOGIT_BIAS, MIN_REPETITION_PENALTY

MAX_N = 16                      # choices per request (OpenAI's limit is 128; ours is the batch)
MAX_LOGIT_BIAS_TOKENS = 1024    # logit_bias entries: each row of a step adds them
MAX_STOP_TOKEN_IDS = 256        # each sampled token is looked up among them
MODEL_DEFAULT = "the model's generation_config.json (unless --generation-config none), else"
Role = Literal["system", "developer", "user", "assistant", "tool"]
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"     # OpenAI's rule; it also keeps names out of the call's quotes


def _encodable(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"holds a lone surrogate (\\u{ord(value[e.start]):04x}) at character {e.start}: "
                         f"not text") from None
    return value


def _whole(value):
    """JSON Schema counts 2.0 as an integer (json.loads makes it a float); 2.5 and "2" stay wrong."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def whole(**limits):
    """An integer field within `limits` (ge, le, lt) that also takes 2.0. The limits sit inside
    the validator, so that /openapi.json shows them as minimum/maximum."""
    return Annotated[int, Field(**limits), BeforeValidator(_whole)]


Text = Annotated[str, AfterValidator(_encodable)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_encodable)]
TokenId = whole(ge=0)
ChatTemplateKwargs = dict[str, Any]     # variables for the chat template (serving/fields.py checks the names)


class _Strict(BaseModel):
    # Unknown fields are ignored, as OpenAI's own API does for fields it does not use.
    model_config = ConfigDict(strict=True, extra="ignore")


class SpeculationOptions(BaseModel):
    """Caps on this request's draft tree; an omitted field is the server's own setting."""
    model_config = ConfigDict(strict=True, extra="forbid")
    drafter: str | None = Field(None, description="the server's drafter (its kind or full spec), "
                                                  "or 'none'/'off' to decode this request plainly")
    gamma: whole(ge=1) | None = Field(None, description="draft depth, at most the server's")
    topk: whole(ge=1) | None = Field(None, description="children per draft node, at most the server's")
    budget: whole(ge=1) | None = Field(None, description="draft nodes per step, at most the server's")


Speculation = Union[Literal["auto", "off"], SpeculationOptions]


class JSONSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema; absent: any JSON object")
    strict: bool | None = Field(None, description="the schema is always enforced, strict or not (as vLLM)")


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[Union[TextFormat, JSONObjectFormat, JSONSchemaResponseFormat], Field(discriminator="type")]


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _Generation(_Strict):
    """The sampling and speculation fields both routes share. Unknown fields are kept aside
    (`model_extra`): serving/fields.py refuses the ones that would change the output and logs
    the rest once per name, as vLLM does."""
    model_config = ConfigDict(strict=True, extra="allow")
    model: str
    max_tokens: whole(ge=1) | None = Field(None, description="default: what the context length leaves")
    n: whole(ge=1, le=MAX_N) | None = 1
    temperature: float | None = Field(None, ge=0, le=2, description=f"default: {MODEL_DEFAULT} 1")
    top_p: float | None = Field(None, gt=0, le=1, description=f"default: {MODEL_DEFAULT} 1")
    top_k: whole(ge=-1) | None = Field(None, description=f"-1 or 0: off; default: {MODEL_DEFAULT} off")
    min_p: float | None = Field(None, ge=0, le=1, description=f"default: {MODEL_DEFAULT} 0")
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=10,
                                             description=f"default: {MODEL_DEFAULT} 1")
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                               Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
                          Field(max_length=MAX_LOGIT_BIAS_TOKENS,     # as the published schema reads it
                                json_schema_extra={"additionalProperties": False})] | None = Field(
        None, description="token id (as a string) -> a bias in [-100, 100] added to its logit before sampling; "
                          "-100 bans the token, 100 all but forces it")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="token ids that end the output (vLLM)")
    min_tokens: whole(ge=0) | None = Field(
        None, description="EOS and stop tokens (and stop strings) count only after this many output tokens (vLLM)")
    include_stop_str_in_output: bool | None = Field(
        False, description="keep the stop string, or the stop token's text, at the end of the text (vLLM)")
    skip_special_tokens: bool | None = Field(True, description="leave special tokens out of the text (vLLM)")
    best_of: whole(ge=1) | None = Field(None, description="1 or n: candidates beyond n are not supported (400)")
    metadata: dict[str, Any] | None = Field(None, description="accepted; no effect")
    store: bool | None = Field(None, description="accepted; no effect (nothing is stored)")
    service_tier: str | None = Field(None, description="accepted; no effect")
    seed: whole(ge=-2**63, lt=2**63) | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    ignore_eos: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    speculation: Speculation | None = Field(
        "auto", description='"auto" (the server decides), "off", or caps on the draft tree')
    # Constraints on the output: at most one of these (docs/structured.md).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | NonEmptyText | None = Field(None, description="a JSON Schema (vLLM)")
    guided_regex: NonEmptyText | None = Field(None, description="a regular expression the output matches (vLLM)")
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = Field(
        None, description="the output is one of these strings (vLLM)")
    guided_grammar: NonEmptyText | None = Field(None, description="an EBNF grammar, GBNF syntax, root rule `root` (vLLM)")
    prediction: PredictionContent | None = Field(
        None, description="Predicted Outputs: the reply's expected text, drafted (docs/predicted.md); not with n > 1")


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class PredictionContent(_Strict):
    """OpenAI's Predicted Outputs: the text the reply is expected to be (e.g. the file being
    edited). Its tokens are drafted, so it can speed the reply up and never change it."""
    type: Literal["content"]
    content: Text | list[TextPart] = Field(description="a string, or text parts joined as they are")


class CalledFunction(_Strict):
    name: str
    arguments: Text = Field(description="the arguments as a JSON text")


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    role: Role
    content: Text | list[TextPart] | None = Field(None, description="null only in an assistant turn with tool_calls")
    name: str | None = Field(None, description="the author's name, given to the chat template")
    tool_calls: list[ToolCall] | None = Field(None, description="assistant turns: the calls it made")
    tool_call_id: str | None = Field(None, description="tool turns: the call this is the result of")


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments; absent: none")
    strict: bool | None = Field(None, description="arguments always follow the schema, strict or not (as vLLM)")


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: whole(ge=1) | None = Field(None, description="OpenAI's newer name for max_tokens")
    logprobs: bool | None = Field(False, description="each output token's logprob (docs/serving.md, Logprobs)")
    top_logprobs: whole(ge=0, le=20) | None = Field(None, description="alternatives per token; needs logprobs")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='default: "auto" with tools, "none" without')
    parallel_tool_calls: bool | None = Field(True, description="false: one call at most")
    thinking_token_budget: whole(ge=1) | None = Field(
        None, description="at most this many tokens of the reasoning block, then its end is forced and the answer "
                          "follows (vLLM; needs the server's --reasoning-parser; the block counts in max_tokens)")
    chat_template_kwargs: ChatTemplateKwargs | None = Field(
        None, description="extra variables for the chat template's render (vLLM); not messages, tools, "
                          "add_generation_prompt, bos_token, eos_token or the template's functions")


Prompt = Union[NonEmptyText, Annotated[list[TokenId], Field(min_length=1)],
               Annotated[list[NonEmptyText], Field(min_length=1)],
               Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]]


class CompletionRequest(_Generation):
    prompt: Prompt = Field(description="a string, an array of token ids, or an array of either")
    logprobs: whole(ge=0, le=5) | None = Field(None, description="each token's logprob and this many alternatives")
    echo: bool | None = Field(False, description="the prompt before the completion, with its logprobs if asked")
    suffix: Text | None = Field(None, description="not supported: a non-empty suffix is refused (400)")


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a `prompt`, or `messages` through the chat template as a chat request's."""
    model: str | None = Field(None, description="a served model name; absent: the served model")
    prompt: Text | None = Field(None, description="a text to tokenize (this or messages)")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        None, description="a conversation, tokenized as /v1/chat/completions would (this or prompt)")
    add_generation_prompt: bool | None = Field(True, description="messages: open the assistant's turn")
    add_special_tokens: bool | None = Field(True, description="prompt: add the tokenizer's BOS and the like")
    tools: list[Tool] | None = Field(None, description="messages: the tools offered, as a chat request's")
    chat_template_kwargs: ChatTemplateKwargs | None = None


class DetokenizeRequest(_Strict):
    model: str | None = Field(None, description="a served model name; absent: the served model")
    tokens: list[TokenId]


# ---- responses (documented in /openapi.json) ------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int | None = Field(None, description="tokens of the prediction accepted by "
                                                                     "verification (with a prediction)")
    rejected_prediction_tokens: int | None = Field(None, description="tokens of the prediction verified and not "
                                                                     "accepted (with a prediction)")
    reasoning_tokens: int | None = Field(None, description="the reply's tokens up to the end of its reasoning "
                                                           "block (with --reasoning-parser)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="present when the request carried a prediction or the server parses reasoning")


class TercelStats(BaseModel):
    """How the speculation went, summed over the choices."""
    proposed: int
    accepted: int
    verify_steps: int
    mean_accepted_length: float | None


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float = Field(description="-9999.0 for a token that could not be chosen")
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for the prompt's first token")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    tercel: TercelStats


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    tercel: TercelStats


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    parent: str | None = Field(None, description="a LoRA adapter's base model")
    root: str | None = Field(None, description="a LoRA adapter's folder")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def request_field_names() -> frozenset[str]:
    """Every field name of the request models: what a validation error's location can name."""
    models = (ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, SpeculationOptions, StreamOptions,
              JSONSchemaResponseFormat, JSONSchemaFormat, ToolCall, CalledFunction, Tool, FunctionDefinition,
              NamedToolChoice, FunctionName, PredictionContent, TokenizeRequest, DetokenizeRequest)
    return frozenset(f.alias or name for m in models for name, f in m.model_fields.items())

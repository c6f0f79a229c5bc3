"""OpenAI request handling between validation and the engine, and the response shapes.

FastAPI validates bodies against serving/schemas.py; `validation_error` turns its errors into
one OpenAI-style error `{"error": {"message", "type", "param", "code"}}` with status 400, so
FastAPI's own 422 never reaches a client.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass

from drafters.config import SpecConfig
from serving.reasoning import ReasoningFormat, after_reasoning
from serving.responses.schemas import responses_field_names
from serving.schemas import ChatCompletionRequest, CompletionRequest, Speculation, request_field_names
from serving.tools.constraint import ToolChoice, tool_constraint
from serving.tools.formats import ToolFormat
from serving.tools.request import Refused, chat_messages, tool_request
from verifier.sampling.sampling_params import SamplingParams
from verifier.sampling.structured import StructuredOutputs

FIELD_NAMES = request_field_names() | responses_field_names()


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass(frozen=True)
class ParsedRequest:
    """What the handlers need from a validated chat or completion body."""
    prompts: list                  # chat: [messages]; completions: [str | list[int], ...]
    params: SamplingParams         # every choice's; `for_prompt` gives each its length and seed
    max_tokens: int | None         # None: what the context length leaves after each prompt
    n: int
    stream: bool
    include_usage: bool
    speculation: Speculation | None
    model: str
    structured_param: str | None = None            # the field that asked for params.structured (for a 400)
    echo: bool = False                             # completions: the prompt before the text
    tools: list[dict] | None = None                # chat: the tools offered (OpenAI's shape)
    tool_choice: ToolChoice = ToolChoice("none")   # "none": the reply is text, never parsed for calls
    prediction: str | None = None                  # Predicted Outputs: the text the reply is expected to be

    def for_prompt(self, prompt_len: int, choice: int, context: int) -> SamplingParams:
        """One choice's params for a prompt of `prompt_len` tokens: max_tokens as asked or what the
        context leaves, the seed counted up per choice (n > 1 draws different replies)."""
        max_tokens = self.max_tokens or max(1, context - prompt_len)
        check_min_tokens(self.params.min_tokens, max_tokens)
        seed = self.params.seed
        return dataclasses.replace(self.params, max_tokens=max_tokens, seed=None if seed is None else seed + choice)


def parse_chat(body: ChatCompletionRequest, fmt: ToolFormat, context: int,
               reasoning: ReasoningFormat | None = None) -> ParsedRequest:
    """`fmt`: how the server's model writes tool calls (--tool-call-parser); `context`: the
    model's context length (max_tokens when the request leaves it out); `reasoning`: the
    server's reasoning format (--reasoning-parser), whose block the constraint lets come first."""
    req = _chat(body, fmt, context)
    if reasoning is None or req.params.structured is None:
        return req
    try:
        held = after_reasoning(reasoning, req.params.structured)
    except ValueError as e:      # a structural tag that is not JSON
        raise bad(req.structured_param, f"invalid constraint: {e}") from None
    return dataclasses.replace(req, params=dataclasses.replace(req.params, structured=held))


def _chat(body: ChatCompletionRequest, fmt: ToolFormat, context: int) -> ParsedRequest:
    try:
        messages = chat_messages(body.messages)
        tools, choice = tool_request(body)
    except Refused as e:
        raise bad(e.param, str(e)) from None
    if body.top_logprobs is not None and not body.logprobs:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    req = _parsed(body, [messages], body.max_completion_tokens or body.max_tokens,
                  (body.top_logprobs or 0) if body.logprobs else None, context)
    if choice.mode == "none":
        return dataclasses.replace(req, tools=tools)
    try:
        constraint = tool_constraint(fmt, tools, choice, req.params.structured)
    except ValueError as e:      # a text constraint that is not what its kind says
        raise bad(req.structured_param, f"invalid constraint: {e}") from None
    param = req.structured_param if choice.mode == "auto" and req.params.structured else "tools"
    return dataclasses.replace(req, params=_constrained(req.params, constraint, param), structured_param=param,
                               tools=tools, tool_choice=choice)


def parse_completion(body: CompletionRequest, context: int) -> ParsedRequest:
    p = body.prompt
    # One prompt (a string or one array of ids) or a batch of them.
    prompts = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
    req = _parsed(body, prompts, body.max_tokens, body.logprobs, context)
    if not body.echo:
        return req
    # echo: the prompt's logprobs too, the first token's null (nothing comes before it)
    params = dataclasses.replace(req.params, prompt_logprobs=body.logprobs) if body.logprobs is not None \
        else req.params
    return dataclasses.replace(req, echo=True, params=params)


def _parsed(body, prompts: list, max_tokens: int | None, logprobs: int | None, context: int) -> ParsedRequest:
    opts = body.stream_options
    param, structured = _structured(body)
    controls = _output_controls(body)
    check_min_tokens(controls["min_tokens"], max_tokens or context)     # named, before SamplingParams' own check
    params = _params(max_tokens=max_tokens or context, **_sampling(body), **controls, logprobs=logprobs)
    return ParsedRequest(prompts, _constrained(params, structured, param), max_tokens, _or(body.n, 1),
                         bool(body.stream), bool(opts and opts.include_usage), body.speculation, body.model, param,
                         prediction=_prediction(body))


def _params(**fields) -> SamplingParams:
    """The schema has checked each field alone; what SamplingParams refuses beyond that is a 400
    naming the field its message starts with."""
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise bad(name if name in fields else None, str(e)) from None


def _constrained(params: SamplingParams, constraint: StructuredOutputs | None, param: str | None) -> SamplingParams:
    if constraint is None:
        return params
    if params.min_tokens:
        raise bad("min_tokens", f"'min_tokens' cannot be combined with {param or 'a constraint'}: "
                                f"the constraint may end the output before it")
    return dataclasses.replace(params, structured=constraint)


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    if min_tokens > max_tokens:
        raise bad("min_tokens", f"'min_tokens' is {min_tokens}, above the {max_tokens} tokens allowed "
                                f"(max_tokens, or what the context leaves)")


def _prediction(body) -> str | None:
    """The prediction's text (its parts concatenated: pieces of one reply); 400 with n > 1, as OpenAI."""
    p = body.prediction
    if p is None:
        return None
    if _or(body.n, 1) > 1:
        raise bad("prediction", "'prediction' cannot be used with n > 1, as in OpenAI's API")
    return p.content if isinstance(p.content, str) else "".join(part.text for part in p.content)


def _structured(body) -> tuple[str | None, StructuredOutputs | None]:
    """(the field, the constraint) of `response_format` or one `guided_*` field; 400 for two."""
    asked = [(name, c) for name, c in (("response_format", _response_format(body.response_format)),
                                       *((f"guided_{kind}", _guided(kind, getattr(body, f"guided_{kind}")))
                                         for kind in ("json", "regex", "choice", "grammar")))
             if c is not None]
    if len(asked) > 1:
        raise bad(asked[1][0], f"one constraint per request: {asked[0][0]} and {asked[1][0]} were both given")
    if not asked:
        return None, None
    name, constraint = asked[0]
    if name == "response_format" and constraint.json is not None:
        name = "response_format.json_schema.schema"
    return name, constraint


def _guided(kind: str, value) -> StructuredOutputs | None:
    return None if value is None else StructuredOutputs(**{kind: value})


def _response_format(fmt) -> StructuredOutputs | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema.schema_ is None:
        return StructuredOutputs(json_object=True)
    return StructuredOutputs(json=fmt.json_schema.schema_)


def _sampling(body) -> dict:
    stop = body.stop if body.stop is not None else ()
    return dict(temperature=_or(body.temperature, 1.0), top_p=_or(body.top_p, 1.0),
                top_k=max(0, _or(body.top_k, 0)), min_p=_or(body.min_p, 0.0),
                presence_penalty=_or(body.presence_penalty, 0.0),
                frequency_penalty=_or(body.frequency_penalty, 0.0),
                repetition_penalty=_or(body.repetition_penalty, 1.0), seed=body.seed,
                stop=(stop,) if isinstance(stop, str) else tuple(stop), ignore_eos=bool(body.ignore_eos))


def _output_controls(body) -> dict:
    """vLLM's fields over the output: stop tokens, min_tokens, the bias, what the text keeps."""
    return dict(stop_token_ids=tuple(body.stop_token_ids or ()), min_tokens=_or(body.min_tokens, 0),
                logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
                include_stop_str_in_output=bool(body.include_stop_str_in_output),
                skip_special_tokens=_or(body.skip_special_tokens, True))


def _or(value, default):
    return default if value is None else value


# ---- speculation ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SpeculationChoice:
    """The request's `speculation` field resolved against the server's own settings."""
    speculate: bool
    tree: SpecConfig | None        # None: the server's tree (and the adaptive controller's caps)


def resolve_speculation(field: Speculation | None, server: SpecConfig, drafter: str | None) -> SpeculationChoice:
    """Raise APIError (400) for a drafter the server does not run or a cap above the server's;
    an omitted field of the object is the server's own setting."""
    if field in (None, "auto"):
        return SpeculationChoice(True, None)
    if field == "off" or field.drafter in ("none", "off"):
        return SpeculationChoice(False, None)
    if field.drafter is not None and field.drafter not in (drafter, (drafter or "").partition(":")[0]):
        kind = (drafter or "").partition(":")[0] or "no drafter"    # a drafter's path is the server's own
        raise APIError(400, f"this server drafts with {kind!r}; 'speculation.drafter' "
                            f"can name that drafter or 'none', not {field.drafter[:64]!r}",
                       param="speculation.drafter", code="unsupported_drafter")
    over = server.first_above(field.gamma, field.topk, field.budget)
    if over:
        name, asked, cap = over
        raise bad(f"speculation.{name}", f"'speculation.{name}' is {asked}; this server's limit is {cap}")
    if (field.gamma, field.topk, field.budget) == (None, None, None):
        return SpeculationChoice(True, None)
    try:
        tree = SpecConfig(num_speculative_tokens=_or(field.gamma, server.num_speculative_tokens),
                          topk=_or(field.topk, server.topk), budget=_or(field.budget, server.budget))
    except ValueError as e:     # budget below the depth
        raise bad("speculation.budget", str(e)) from None
    return SpeculationChoice(True, tree)


# ---- validation errors ----------------------------------------------------------------------
# What a union field takes, for a message when no branch of it matched.
EXPECTED = {
    "prompt": "a non-empty string, an array of token ids (integers >= 0), or an array of either",
    "speculation": '"auto", "off" or an object {"drafter", "gamma", "topk", "budget"}',
    "stop": "a non-empty string or an array of non-empty strings",
    "content": "a string or an array of text parts",
    "input": "a non-empty string or an array of items",
    "output": "a string or an array of text parts",
}
TEXT_ERRORS = ("value_error", "string_unicode")     # our lone-surrogate check, pydantic's own


def validation_error(errors: list[dict], names: frozenset[str] = FIELD_NAMES,
                     expected: dict[str, str] | None = None) -> APIError:
    """FastAPI's validation errors as one OpenAI-style 400 naming the first field at fault;
    `names`: the field names of the body's models, `expected`: what their unions take (another
    route's body, the Messages API's, has its own)."""
    expected = EXPECTED if expected is None else expected
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad(None, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    if tuple(first["loc"]) == ("body",):
        return bad(None, "the request body must be a JSON object")
    best = min(errors, key=lambda e: (e["type"] not in TEXT_ERRORS, -len(_path(e["loc"], names))))
    param = _param(best["loc"], names)
    if best["type"] == "missing":
        return bad(param, f"'{param}' is required")
    if best["type"] in TEXT_ERRORS:
        return bad(param, f"'{param}' holds a lone surrogate (a UTF-16 half, not text)"
                   if best["type"] == "string_unicode" else f"'{param}' {best['msg'].removeprefix('Value error, ')}")
    siblings = [e for e in errors if _param(e["loc"], names) == param]
    field = _path(best["loc"], names)[-1]
    if len(siblings) > 1 and field in expected:        # no branch of a union matched
        return bad(param, f"'{param}' must be {expected[field]}")
    return bad(param, f"'{param}' {best['msg'].removeprefix('Input ')}")


def _path(loc, names: frozenset[str]) -> list:
    """The field names and indices of a pydantic location, without "body" and union-branch tags
    (a discriminated union's tag can be a field's name too: response_format.json_schema)."""
    path = [x for x in loc[1:] if isinstance(x, int) or x in names]
    return [x for i, x in enumerate(path) if i == 0 or x != path[i - 1]]


def _param(loc, names: frozenset[str]) -> str | None:
    out = ""
    for x in _path(loc, names):
        out += f"[{x}]" if isinstance(x, int) else f".{x}" if out else x
    return out or None


# ---- response shapes ----------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def tercel_stats(outputs) -> dict:
    proposed = sum(o.stats.draft_tokens for o in outputs)
    accepted = sum(o.stats.accepted_tokens for o in outputs)
    steps = sum(o.stats.verify_steps for o in outputs)
    emitted = sum(o.stats.emitted_tokens for o in outputs)
    return {"proposed": proposed, "accepted": accepted, "verify_steps": steps,
            "mean_accepted_length": round(emitted / steps, 3) if steps else None}


def envelope(kind: str, rid: str, model: str, choices: list, **extra) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}

"""OpenAI request parsing and response shapes.

Bodies are validated by hand, so every problem becomes one OpenAI-style error
`{"error": {"message", "type", "param", "code"}}` with status 400 (404 for an unknown
model); FastAPI's own 422 body never reaches a client.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from spec.config import SpecConfig
from spec.sampling_params import SamplingParams

ROLES = ("system", "user", "assistant")
MAX_N = 16


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


@dataclass
class ParsedRequest:
    """What the handlers need from a chat or completion body."""
    prompts: list                  # chat: [messages]; completions: [str | list[int], ...]
    params: SamplingParams | None  # built once the prompt length is known (default max_tokens)
    max_tokens: int | None
    sampling: dict
    n: int
    stream: bool
    include_usage: bool
    speculate: bool
    speculation: SpecConfig | None
    model: str
    drafter: str | None = None     # speculation.drafter as asked; the app checks it is the server's


# ---- field readers ------------------------------------------------------------------------
def _get(body: dict, key: str, kinds, default=None, check=None, rule: str = ""):
    if key not in body or body[key] is None:
        return default
    v = body[key]
    if isinstance(v, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise bad(key, f"'{key}' must be {rule or _kind_name(kinds)}, got {v!r}")
    if not isinstance(v, kinds):
        raise bad(key, f"'{key}' must be {rule or _kind_name(kinds)}, got {type(v).__name__}")
    if check is not None and not check(v):
        raise bad(key, f"'{key}' must be {rule}, got {v!r}")
    return v


def _text(value: str, param: str) -> str:
    """Text the tokenizer can take: JSON may carry a lone UTF-16 surrogate ("\\ud800"), which is
    no character and cannot be encoded."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(param, f"'{param}' holds a lone surrogate (\\u{ord(value[e.start]):04x}) at character "
                         f"{e.start}: not text") from None
    return value


def _kind_name(kinds) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
             dict: "an object"}
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(names.get(k, k.__name__) for k in kinds if not (k is int and float in kinds))


def _sampling(body: dict) -> dict:
    num = (int, float)
    top_k = _get(body, "top_k", int, 0, lambda v: v >= -1, "an integer >= -1 (-1 or 0 disables)")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise bad("stop", "'stop' must be a non-empty string or an array of non-empty strings")
    for s in stop:
        _text(s, "stop")
    return dict(
        temperature=float(_get(body, "temperature", num, 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")),
        top_p=float(_get(body, "top_p", num, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=max(0, top_k),
        min_p=float(_get(body, "min_p", num, 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]")),
        presence_penalty=float(_get(body, "presence_penalty", num, 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]")),
        frequency_penalty=float(_get(body, "frequency_penalty", num, 0.0, lambda v: -2 <= v <= 2,
                                     "a number in [-2, 2]")),
        repetition_penalty=float(_get(body, "repetition_penalty", num, 1.0, lambda v: 0 < v <= 10,
                                      "a number in (0, 10]")),
        seed=_get(body, "seed", int, None, lambda v: -2**63 <= v < 2**63, "a 64-bit integer"),
        stop=tuple(stop),
        ignore_eos=bool(_get(body, "ignore_eos", bool, False)),
    )


def _speculation(body: dict) -> tuple[bool, SpecConfig | None, str | None]:
    v = body.get("speculation", "auto")
    if v in ("auto", None):
        return True, None, None
    if v == "off":
        return False, None, None
    if not isinstance(v, dict):
        raise bad("speculation", "'speculation' must be \"off\", \"auto\" or an object "
                                 "{\"drafter\", \"gamma\", \"topk\", \"budget\"}")
    unknown = set(v) - {"drafter", "gamma", "topk", "budget"}
    if unknown:
        raise bad("speculation", f"unknown speculation field(s): {', '.join(sorted(unknown))}")
    for key in ("gamma", "topk", "budget"):
        if key in v and (isinstance(v[key], bool) or not isinstance(v[key], int) or v[key] < 1):
            raise bad(f"speculation.{key}", f"'speculation.{key}' must be an integer >= 1")
    try:
        spec = SpecConfig(num_speculative_tokens=v.get("gamma", 4), topk=v.get("topk", 1), budget=v.get("budget"))
    except ValueError as e:
        raise bad("speculation", str(e)) from None
    drafter = v.get("drafter")
    if drafter is not None and not isinstance(drafter, str):
        raise bad("speculation.drafter", "'speculation.drafter' must be a string")
    if drafter in ("none", "off"):
        return False, None, None
    return True, spec, drafter


def _common(body, prompts) -> ParsedRequest:
    n = _get(body, "n", int, 1, lambda v: 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]")
    max_tokens = _get(body, "max_completion_tokens", int, None, lambda v: v >= 1, "an integer >= 1")
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, None, lambda v: v >= 1, "an integer >= 1")
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict, {})
    include_usage = bool(opts.get("include_usage", False)) if isinstance(opts, dict) else False
    _get(body, "user", str, None)
    speculate, speculation, drafter = _speculation(body)
    return ParsedRequest(prompts, None, max_tokens, _sampling(body), n, stream, include_usage, speculate,
                         speculation, body["model"], drafter)


def _require_model(body) -> None:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    if "model" not in body:
        raise bad("model", "'model' is required")
    if not isinstance(body["model"], str):
        raise bad("model", "'model' must be a string")


def parse_chat(body) -> ParsedRequest:
    _require_model(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise bad("messages", "'messages' is required and must be an array")
    if not msgs:
        raise bad("messages", "'messages' must not be empty")
    return _common(body, [[_message(m, i) for i, m in enumerate(msgs)]])


def _message(m, i: int) -> dict:
    if not isinstance(m, dict):
        raise bad(f"messages[{i}]", f"messages[{i}] must be an object")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise bad(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
    if isinstance(content, list):   # content parts: only text is supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f"messages[{i}].content", "only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string")
    return {"role": role, "content": _text(content, f"messages[{i}].content")}


def parse_completion(body) -> ParsedRequest:
    _require_model(body)
    p = body.get("prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                                  for t in p)):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or (isinstance(x, list) and x and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x)) for x in p):
        prompts = list(p)
    else:
        raise bad("prompt", "'prompt' is required: a string, an array of token ids, or an array of those")
    if any(x == "" for x in prompts):
        raise bad("prompt", "'prompt' must not be empty")
    for x in prompts:
        if isinstance(x, str):
            _text(x, "prompt")
    return _common(body, prompts)


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

"""The Responses fields Tercel does not do, refused before any work with a 400 naming the field,
by serving/fields.py's rule: a field that would change the output is refused unless its value
asks for what Tercel does anyway; bookkeeping (`metadata`, `user`, `prompt_cache_key`,
`safety_identifier`, `service_tier`, `max_tool_calls`, `stream_options`) is accepted; any
other unknown field is ignored and logged once per name.
"""
from __future__ import annotations

from serving.fields import BOTH, Unsupported, check_extra, inert
from serving.protocol import bad
from serving.responses.schemas import ResponsesRequest

CHAT_ONLY = "is a /v1/chat/completions field"
# Unknown here: OpenAI's fields Tercel does not do, and chat fields a client may send by mistake
# (ignoring them would change the output without a word).
EXTRA = {
    "conversation": Unsupported("is not supported (no Conversations API); send 'previous_response_id' or the items"),
    "prompt": Unsupported("is not supported: stored prompt templates are OpenAI's; send 'instructions' and 'input'"),
    "messages": Unsupported(f"{CHAT_ONLY}; send 'input'"),
    "max_tokens": Unsupported(f"{CHAT_ONLY}; send 'max_output_tokens'"),
    "max_completion_tokens": Unsupported(f"{CHAT_ONLY}; send 'max_output_tokens'"),
    "response_format": Unsupported(f"{CHAT_ONLY}; send 'text.format'"),
    "n": Unsupported("is not supported: a response has one output", (None, 1)),
    "logprobs": Unsupported(f"{CHAT_ONLY}; logprobs are not written on this route", (None, False)),
    "prediction": Unsupported(f"{CHAT_ONLY}"),
    **{f"guided_{kind}": Unsupported(f"{CHAT_ONLY}; send 'text.format'") for kind in ("json", "regex", "choice",
                                                                                         "grammar")},
}
# Declared (so /openapi.json shows them), done only at these values.
DECLARED = {
    "background": Unsupported("is not supported: a response runs while its request is open", (None, False)),
    "include": Unsupported("is not supported: no extra output (logprobs, encrypted reasoning, ...) is written",
                           (None, [])),
    "truncation": Unsupported('"auto" is not supported: a conversation past the context length is refused, '
                              'never cut', (None, "disabled")),
    "top_logprobs": Unsupported("is not supported: logprobs are not written on this route", (None, 0)),
}


def check_fields(body: ResponsesRequest) -> None:
    check_extra(body.model_extra, {**BOTH, **EXTRA})
    for name, rule in DECLARED.items():
        if not inert(getattr(body, name), rule):
            raise bad(name, f"'{name}' {rule.why}")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise bad("text.verbosity", f"'text.verbosity' {body.text.verbosity!r} is not supported: the model writes "
                                    f"as it does (\"medium\")")

"""Request fields beyond the ones the routes read, and the checks of the newer sampling fields
that need the engine's limits; each refusal is a 400 naming its field, before any work.

Field policy (as vLLM): a field that would change the output and that Tercel does not do is
refused; OpenAI's bookkeeping fields (`user`, `metadata`, `store`, `service_tier`) are
accepted and change nothing; any other unknown field is ignored and logged once per name.
`logprobs`, `top_logprobs`, `echo` and `prediction` are request fields of their own
(serving/schemas.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from serving.protocol import ParsedRequest, bad
from spec.stats import EngineLimits

log = logging.getLogger("tercel.serve")


@dataclass(frozen=True)
class Unsupported:
    """A field Tercel refuses unless its value changes nothing."""
    why: str                       # the rest of the 400's message
    inert: tuple = (None,)         # values that ask for what Tercel does anyway


_LIST = (None, [])
BOTH = {
    "functions": Unsupported("is OpenAI's deprecated form of 'tools'; send 'tools'", _LIST),
    "function_call": Unsupported("is OpenAI's deprecated form of 'tool_choice'; send 'tool_choice'"),
    "use_beam_search": Unsupported("is not supported: beam search is not implemented", (None, False)),
    "length_penalty": Unsupported("is not supported: it applies to beam search", (None, 1, 1.0)),
    "allowed_token_ids": Unsupported("is not supported; 'logit_bias' -100 bans tokens", _LIST),
    "bad_words": Unsupported("is not supported; 'logit_bias' -100 bans tokens", _LIST),
    "logits_processors": Unsupported("is not supported", _LIST),
    "structured_outputs": Unsupported("is not supported; send 'response_format' or a 'guided_*' field"),
    "guided_whitespace_pattern": Unsupported("is not supported: JSON whitespace follows xgrammar's default"),
    "truncate_prompt_tokens": Unsupported("is not supported: a prompt past the context length is refused"),
    "audio": Unsupported("is not supported: text only"),
    "modalities": Unsupported("is not supported: text only", (None, ["text"])),
    "web_search_options": Unsupported("is not supported"),
}
CHAT = {
    "chat_template": Unsupported("is not accepted per request; the server's is set by --chat-template"),
    "documents": Unsupported("is not supported"),
    "continue_final_message": Unsupported("is not supported: the assistant's turn is always opened", (None, False)),
    "add_generation_prompt": Unsupported("is not supported: the assistant's turn is always opened", (None, True)),
    "add_special_tokens": Unsupported("is not supported: the chat template writes the special tokens",
                                      (None, False)),
}
COMPLETIONS = {
    "add_special_tokens": Unsupported("is not supported: a text prompt gets the tokenizer's special tokens",
                                      (None, True)),
}
# Names the chat template is given, or calls, itself: a client's variable must not replace them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                     "raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler",
                                     "joiner", "namespace"})
MAX_LOGGED_NAMES = 256      # a client inventing names must not grow the set without end
_logged: set[str] = set()


def check_fields(body, chat: bool) -> None:
    """Refuse what the request asks and Tercel does not do; log the unknown names."""
    check_extra(body.model_extra, {**BOTH, **(CHAT if chat else COMPLETIONS)})
    n = body.n or 1
    if body.best_of not in (None, 1, n):
        raise bad("best_of", f"'best_of' is {body.best_of}: only 1 or n ({n}) is supported, "
                             f"as candidates beyond the choices returned are not")
    if not chat and body.suffix:
        raise bad("suffix", "'suffix' is not supported (no fill-in-the-middle)")
    check_template_kwargs(getattr(body, "chat_template_kwargs", None))


def check_extra(extra: dict | None, table: dict[str, Unsupported], accepted: frozenset[str] = frozenset()) -> None:
    """The fields a body's model does not name: a 400 for those in `table` unless inert, the
    `accepted` ones (bookkeeping) kept quiet, any other logged once per name."""
    for name, value in (extra or {}).items():
        rule = table.get(name)
        if rule is None:
            if name not in accepted:
                _log_unknown(name)
        elif not inert(value, rule):
            raise bad(name, f"'{name}' {rule.why}")


def inert(value, rule: Unsupported) -> bool:
    """The value asks for what Tercel does anyway (`false` is not 0: the type must match too)."""
    return any(value == v and type(value) is type(v) for v in rule.inert)


def check_template_kwargs(kwargs: dict | None) -> None:
    for name in sorted(set(kwargs or ()) & RESERVED_TEMPLATE_NAMES):
        raise bad(f"chat_template_kwargs.{name}", f"'chat_template_kwargs' may not set {name!r}: "
                                                  f"the server gives the template that itself")


def _log_unknown(name: str) -> None:
    if name in _logged or len(_logged) >= MAX_LOGGED_NAMES:
        return
    _logged.add(name)
    log.warning("ignored an unknown request field %r (logged once per name)", name[:64])


def check_sampling(req: ParsedRequest, limits: EngineLimits) -> None:
    """Token ids within the vocabulary (the checks that need no engine run at parse,
    serving/protocol.py)."""
    for token, _ in req.params.logit_bias:
        if token >= limits.vocab_size:
            raise bad("logit_bias", f"'logit_bias' names token {token}; this model's vocabulary has "
                                    f"{limits.vocab_size} tokens")
    for i, token in enumerate(req.params.stop_token_ids):
        if token >= limits.vocab_size:
            raise bad(f"stop_token_ids[{i}]", f"'stop_token_ids[{i}]' is {token}; this model's vocabulary has "
                                              f"{limits.vocab_size} tokens")

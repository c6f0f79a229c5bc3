"""Failures that belong to one request.

A step runs many requests together; what one of them brings (a grammar that allows nothing,
a row with no finite logit) must fail that request alone. `RequestFault` is raised where the
engine can tell the request is at fault; `RequestError` is what its last output carries.
"""
from __future__ import annotations

from dataclasses import dataclass

NO_TOKEN_ALLOWED = "the request's grammar allows no next token here (its language is empty, or it reached a dead end)"


class RequestFault(Exception):
    """The request's own input made this step impossible for it (a 400 at the server)."""


@dataclass(frozen=True)
class RequestError:
    """Why one request failed alone. `invalid`: its own fault (a RequestFault), else an engine
    bug its data reached (the server answers 500 and logs `message`, which may name internals)."""
    message: str
    invalid: bool

    @classmethod
    def of(cls, e: Exception) -> "RequestError":
        if isinstance(e, RequestFault):
            return cls(str(e), True)
        return cls(f"{type(e).__name__}: {e}", False)

"""Drafter kinds by name: each drafter module registers its factory (and the tree shape it is
tuned for) here; `drafters/kinds.py` builds one from a spec string."""
from __future__ import annotations

from typing import Callable

from drafters.base import Drafter

FACTORIES: dict[str, Callable[..., Drafter]] = {}   # kind -> factory(arg, target, speculation)
DEFAULT_SPECULATION: dict = {}     # kind -> the SpecConfig a drafter runs with unless told otherwise
#                                  (or a function of the drafter's argument giving it: `tree:`'s)


def register_drafter(kind: str, default_speculation=None):
    def deco(factory):
        FACTORIES[kind] = factory
        if default_speculation is not None:
            DEFAULT_SPECULATION[kind] = default_speculation
        return factory
    return deco

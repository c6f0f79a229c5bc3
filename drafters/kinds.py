"""The built-in drafters, by the drafter strings the engine, the server and bench take."""
from __future__ import annotations

import drafters.datastore  # noqa: F401  (each drafter module registers its kind)
import drafters.eagle3.drafter  # noqa: F401
import drafters.ngram  # noqa: F401
import drafters.small  # noqa: F401
import drafters.suffix  # noqa: F401
import drafters.tree_merge  # noqa: F401
from drafters.base import Drafter
from drafters.config import SpecConfig
from drafters.registry import DEFAULT_SPECULATION, FACTORIES


def default_speculation(drafter: str | None) -> SpecConfig:
    """The tree shape a drafter kind is tuned for (e.g. EAGLE-3's dynamic tree; a `tree:`
    drafter's from its parts'), else SpecConfig()."""
    kind, _, arg = (drafter or "").partition(":")
    shape = DEFAULT_SPECULATION.get(kind, SpecConfig())
    return shape(arg) if callable(shape) else shape


def check_drafter(drafter: str) -> None:
    """ValueError unless `drafter`'s kind is registered (nothing is loaded)."""
    kind = drafter.partition(":")[0]
    if kind not in FACTORIES:
        raise ValueError(f"unknown drafter {drafter!r}; known kinds: {', '.join(sorted(FACTORIES))}")


def build_drafter(drafter: str, target, speculation) -> Drafter:
    """`drafter` is `kind` or `kind:argument`: "ngram", "small:/path/to/model",
    "tree:small:/path+ngram". The target supplies the tokenizer and device."""
    check_drafter(drafter)
    kind, _, arg = drafter.partition(":")
    return FACTORIES[kind](arg, target, speculation)

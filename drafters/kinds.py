"""The built-in drafters, by the spec strings the engine, the server and bench take."""
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


def default_speculation(spec: str | None) -> SpecConfig:
    """The tree shape a drafter kind is tuned for (e.g. EAGLE-3's dynamic tree), else SpecConfig()."""
    kind = (spec or "").partition(":")[0]
    return DEFAULT_SPECULATION.get(kind, SpecConfig())


def check_drafter(spec: str) -> None:
    """ValueError unless `spec`'s kind is registered (nothing is loaded)."""
    kind = spec.partition(":")[0]
    if kind not in FACTORIES:
        raise ValueError(f"unknown drafter {spec!r}; known kinds: {', '.join(sorted(FACTORIES))}")


def build_drafter(spec: str, target, speculation) -> Drafter:
    """`spec` is `kind` or `kind:argument`: "ngram", "small:/path/to/model",
    "tree:small:/path+ngram". The target supplies the tokenizer and device."""
    check_drafter(spec)
    kind, _, arg = spec.partition(":")
    return FACTORIES[kind](arg, target, speculation)

"""Argument checks every layer shares (here, at the bottom, so that any folder may use them)."""
from __future__ import annotations


def positive_int(name: str, value) -> None:
    """ValueError unless `value` is an int >= 1 (a bool is not: True would pass as 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def positive_ints(obj, names: tuple[str, ...], flag: bool = False) -> None:
    """positive_int for each named attribute of `obj`; `flag` names them as CLI flags (--max-len)."""
    for name in names:
        positive_int(f"--{name.replace('_', '-')}" if flag else name, getattr(obj, name))

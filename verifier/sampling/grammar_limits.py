"""What a constraint may cost to compile (docs/serving.md, "Limits"; docs/structured.md).

Compile time grows with a schema's nesting and a pattern's alternatives, and one compiled
grammar can hold megabytes of token masks. Size and depth are checked before compiling; the
time limit needs the compile in a child process (`verifier/sampling/grammar_worker.py`), the only
way to stop xgrammar mid-compile.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from verifier.sampling.structured import StructuredOutputs

MiB = 1 << 20


class GrammarTimeout(ValueError):
    """The compile ran past the time limit and was stopped."""


class GrammarCancelled(ValueError):
    """The client left while its grammar compiled; the compile was stopped."""


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 64 * 1024            # schema, pattern or grammar text (choices: all of them)
    max_depth: int = 32                   # nesting of a JSON schema document, or of a regex's groups
    cache_bytes: int = 256 * MiB          # Tercel's LRU of compiled grammars, by their token masks' size
    xgrammar_cache_bytes: int = 256 * MiB  # xgrammar's own cache (it is unbounded by default)
    # Seconds a compile may take; it then runs in a child process that is killed past it
    # (None: compile in this process, with no time limit: the offline API's default).
    timeout_s: float | None = None

    def __post_init__(self):
        for name in ("max_bytes", "max_depth", "cache_bytes", "xgrammar_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")

    def check(self, spec: StructuredOutputs) -> None:
        """ValueError naming the limit a constraint exceeds, before any compile."""
        kind, text = spec.key
        size = sum(len(c.encode()) for c in spec.choice) if kind == "choice" else len(text.encode())
        if size > self.max_bytes:
            raise ValueError(f"the constraint is {size} bytes, more than this server's limit of "
                             f"{self.max_bytes} (--max-grammar-bytes)")
        depth = (json_depth(text) if kind == "json" else group_depth(text) if kind == "regex"
                 else tag_schema_depth(text) if kind == "structural_tag" else 0)
        if depth > self.max_depth:
            what = "regular expression nests groups" if kind == "regex" else "JSON schema nests"
            raise ValueError(f"the {what} {depth} levels deep, more than this server's limit of "
                             f"{self.max_depth} (--max-grammar-depth)")


def json_depth(text: str) -> int:
    """Nesting depth of a JSON document's objects and arrays (0 for a scalar)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return 0                      # not JSON: the compiler names that error
    depth, stack = 0, [(doc, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            depth = max(depth, d)
            stack += [(v, d + 1) for v in (node.values() if isinstance(node, dict) else node)]
    return depth


def tag_schema_depth(text: str) -> int:
    """The deepest JSON schema inside a structural tag (its own nesting is the server's)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return 0
    deepest, stack = 0, [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                deepest = max(deepest, json_depth(json.dumps(node["json_schema"])))
            else:
                stack += node.values()
        elif isinstance(node, list):
            stack += node
    return deepest


def group_depth(pattern: str) -> int:
    """Deepest nesting of parentheses in a regular expression (escaped and bracketed ones aside)."""
    depth = best = 0
    escaped = in_class = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            best = max(best, depth)
        elif ch == ")":
            depth = max(0, depth - 1)
    return best

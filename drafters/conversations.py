"""Conversation files: the JSONL readers that train-drafter and the datastore drafter share.

Two JSONL schemas are read, one conversation per line:
- Tercel's common schema: {"id", "source", "conversations": [{"role", "content"}, ...]}
- ShareGPT: {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}

Bad lines never stop a run: each is skipped, counted, and reported with file and line.

They live in drafters/ because the datastore drafter indexes the same files a drafter is
trained on; training/ (chat templating and loss masks, training/data.py) and bench/ sit
above drafters/ and read them from here. Plain Python, no torch.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("tercel.training")     # the logger skipped lines have always gone to

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


@dataclass(frozen=True)
class Conversation:
    id: str
    source: str
    messages: tuple[dict, ...]       # {"role": system|user|assistant, "content": str}


@dataclass
class LoadReport:
    """What reading the files found: used conversations and every skipped line, by file:line."""
    files: list[str] = field(default_factory=list)
    conversations: int = 0
    skipped: list[str] = field(default_factory=list)   # "path:line: reason"

    def summary(self) -> str:
        return (f"{self.conversations} conversations from {len(self.files)} file(s); "
                f"{len(self.skipped)} line(s) skipped")


class DataError(ValueError):
    """No usable data at all (missing file, nothing valid): the run cannot start."""


def expand_paths(paths: list[str]) -> list[Path]:
    """Files as given; a directory means every *.jsonl inside it, sorted."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.jsonl"))
            if not found:
                raise DataError(f"data directory {p} has no *.jsonl files")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"data file not found: {p}")
    return out


def parse_line(line: str) -> tuple[str | None, str | None, list[dict]]:
    """(id, source, messages) from one JSON line; ValueError names what is wrong."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    turns = obj.get("conversations", obj.get("messages"))
    if not isinstance(turns, list):
        raise ValueError("missing 'conversations' list")
    messages = [parse_message(t, i) for i, t in enumerate(turns)]
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise ValueError("conversation has no non-empty assistant turn")
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("conversation has no user turn")
    return obj.get("id"), obj.get("source"), messages


def parse_message(turn, i: int) -> dict:
    """One turn as {"role", "content"}; both schemas. ValueError names the turn."""
    if not isinstance(turn, dict):
        raise ValueError(f"turn {i} is not an object")
    if "role" in turn:
        role, content = turn.get("role"), turn.get("content")
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"turn {i} has unknown role {role!r}")
    elif "from" in turn:
        role, content = _SHAREGPT_ROLES.get(str(turn.get("from")).lower()), turn.get("value")
        if role is None:
            raise ValueError(f"turn {i} has unknown 'from' {turn.get('from')!r}")
    else:
        raise ValueError(f"turn {i} has neither 'role' nor 'from'")
    if not isinstance(content, str):
        raise ValueError(f"turn {i} content is not a string")
    return {"role": role, "content": content}


def load_conversations(paths: list[str], limit_per_source: int | None = None,
                       seed: int = 0) -> tuple[list[Conversation], LoadReport]:
    """Read every file; with `limit_per_source`, a seeded sample of at most that many
    conversations per source (the training mix is heavy on math)."""
    report, convs = LoadReport(), []
    for path in expand_paths(paths):
        report.files.append(str(path))
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    cid, source, messages = parse_line(line)
                except ValueError as e:
                    report.skipped.append(f"{path}:{lineno}: {e}")
                    continue
                convs.append(Conversation(str(cid or f"{path.stem}-{lineno}"),
                                          str(source or path.stem), tuple(messages)))
    for msg in report.skipped[:20]:
        log.warning("skipped %s", msg)
    if len(report.skipped) > 20:
        log.warning("... and %d more skipped lines", len(report.skipped) - 20)
    if limit_per_source is not None:
        convs = _sample_per_source(convs, limit_per_source, seed)
    report.conversations = len(convs)
    if not convs:
        raise DataError(f"no usable conversations in {', '.join(report.files)} "
                        f"({len(report.skipped)} line(s) skipped)")
    return convs, report


def _sample_per_source(convs: list[Conversation], limit: int, seed: int) -> list[Conversation]:
    by_source: dict[str, list[Conversation]] = {}
    for c in convs:
        by_source.setdefault(c.source.split("/")[0], []).append(c)
    rng, out = random.Random(seed), []
    for group in by_source.values():
        out.extend(rng.sample(group, min(limit, len(group))))
    rng.shuffle(out)
    return out

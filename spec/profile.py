"""Tuned speculation profiles: what `tercel bench grid` found fastest, per task.

A profile is JSON:

    {"version": 1, "model": "...", "default": CHOICE, "tasks": {"rag": CHOICE, ...}}
    CHOICE = {"drafter": "ngram" | null, "gamma": 4, "topk": 1, "budget": null,
              "speedup": 1.4, "tau": 2.7, "temperature": 0.0}

`drafter` null means plain decoding was fastest. `tercel serve --profile FILE` and
`LLM(profile=FILE)` read the default choice (or one task's with `profile_task`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from drafters.config import SpecConfig

PROFILE_VERSION = 1


@dataclass(frozen=True)
class ProfileChoice:
    drafter: str | None               # None: plain decoding
    speculation: SpecConfig | None    # None with a drafter: that drafter's default tree

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "ProfileChoice":
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
        drafter = obj.get("drafter")
        if drafter in ("", "none", "plain"):
            drafter = None
        if drafter is not None and not isinstance(drafter, str):
            raise ValueError(f"{where}: 'drafter' must be a string or null, got {drafter!r}")
        if drafter is None or obj.get("gamma") is None:
            return cls(drafter, None)
        try:
            spec = SpecConfig(num_speculative_tokens=obj["gamma"], topk=obj.get("topk") or 1,
                              budget=obj.get("budget"))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return cls(drafter, spec)


def load_profile(path: str | Path, task: str | None = None) -> ProfileChoice:
    """The profile's default choice, or the one for `task`; ValueError names what is wrong."""
    path = Path(path)
    try:
        prof = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read profile {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(prof, dict) or "default" not in prof:
        raise ValueError(f"profile {path} has no 'default' entry (write one with `tercel bench grid --profile-out`)")
    if task is None:
        return ProfileChoice.from_json(prof["default"], f"profile {path} default")
    tasks = prof.get("tasks") or {}
    if task not in tasks:
        raise ValueError(f"profile {path} has no task {task!r}; it has: {', '.join(sorted(tasks)) or 'none'}")
    return ProfileChoice.from_json(tasks[task], f"profile {path} task {task}")


def write_profile(path: str | Path, model: str, default: dict, tasks: dict[str, dict]) -> None:
    body = {"version": PROFILE_VERSION, "model": model, "default": default, "tasks": tasks}
    for where, choice in [("default", default), *tasks.items()]:
        ProfileChoice.from_json(choice, where)       # never write a profile that cannot load
    Path(path).write_text(json.dumps(body, indent=2) + "\n")

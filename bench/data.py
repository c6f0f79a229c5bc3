"""Benchmark prompt sets: Spec-Bench and MT-bench question files, plain JSONL prompts and
conversations. Read from the shared data folder (never copied into the repo).

Formats, detected per line:
- question files `{"question_id", "category", "turns": [...]}` (Spec-Bench, MT-bench): the
  task is the category; in Spec-Bench the eight MT-bench categories fold into `mt_bench`,
  its six tasks being mt_bench, translation, summarization, qa, math_reasoning and rag.
- `{"prompt": "..."}` (optional `"task"`), one user turn;
- conversations `{"messages"|"conversations": [{"role","content"} | {"from","value"}]}`:
  the turns up to the first assistant reply are the prompt.
Malformed lines are skipped and counted (`Dataset.skipped` names them by file:line).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from drafters.conversations import parse_message

DATA = Path(os.environ.get("TERCEL_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
ALIASES = {"specbench": ("specbench", "question.jsonl"), "mtbench": ("mtbench", "question.jsonl")}
MT_CATEGORIES = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                           "humanities"})
SPECBENCH_TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class BenchPrompt:
    task: str
    id: str
    system: str | None
    turns: tuple[str, ...]          # user turns; turn i > 0 follows the model's own answer to i - 1

    def messages(self, answers: list[str] = ()) -> list[dict]:
        """The conversation for the next turn, given the model's answers so far."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for i, answer in enumerate(answers):
            out += [{"role": "user", "content": self.turns[i]}, {"role": "assistant", "content": answer}]
        return out + [{"role": "user", "content": self.turns[len(answers)]}]


@dataclass
class Dataset:
    prompts: list[BenchPrompt] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)        # "file:line: reason"

    def tasks(self) -> list[str]:
        return list(dict.fromkeys(p.task for p in self.prompts))

    def by_task(self) -> dict[str, list[BenchPrompt]]:
        out: dict[str, list[BenchPrompt]] = {}
        for p in self.prompts:
            out.setdefault(p.task, []).append(p)
        return out


def resolve(name: str) -> Path:
    """A dataset alias (`specbench`, `mtbench`) or a file path."""
    if name in ALIASES:
        path = DATA.joinpath(*ALIASES[name])
        if not path.is_file():
            raise ValueError(f"dataset {name!r} not found at {path} (set TERCEL_DATA to the data folder)")
        return path
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"dataset file not found: {path} (or use an alias: {', '.join(ALIASES)})")
    return path


def load_datasets(names: list[str], tasks: list[str] | None = None, limit: int | None = None,
                  both_turns: bool = False) -> Dataset:
    """Prompts of every file in file order, at most `limit` per task, only `tasks` if given.
    ValueError for a missing file, an unknown task name or nothing to run."""
    data = Dataset()
    for name in names:
        _read_file(resolve(name), data, both_turns)
    known = data.tasks()
    if tasks:
        unknown = [t for t in tasks if t not in known]
        if unknown:
            raise ValueError(f"unknown task(s) {', '.join(unknown)}; the dataset has: {', '.join(known) or 'none'}")
        data.prompts = [p for p in data.prompts if p.task in tasks]
    if limit is not None:
        counts: dict[str, int] = {}
        kept = []
        for p in data.prompts:
            counts[p.task] = counts.get(p.task, 0) + 1
            if counts[p.task] <= limit:
                kept.append(p)
        data.prompts = kept
    if not data.prompts:
        raise ValueError(f"no usable prompts in {', '.join(names)} ({len(data.skipped)} malformed line(s) skipped)")
    return data


def _read_file(path: Path, data: Dataset, both_turns: bool) -> None:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("a line must be a JSON object")
            rows.append((n, obj))
        except (json.JSONDecodeError, ValueError) as e:
            data.skipped.append(f"{path}:{n}: {e}")
    specbench = any(r.get("category") in SPECBENCH_TASKS[1:] for _, r in rows)
    for n, obj in rows:
        try:
            data.prompts.append(_prompt(obj, path, n, specbench, both_turns))
        except ValueError as e:
            data.skipped.append(f"{path}:{n}: {e}")


def _prompt(obj: dict, path: Path, line: int, specbench: bool, both_turns: bool) -> BenchPrompt:
    pid = str(obj.get("question_id", obj.get("id", f"{path.stem}:{line}")))
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError("'turns' must be a non-empty list of non-empty strings")
        task = str(obj.get("category", path.stem))
        if specbench and task in MT_CATEGORIES:
            task = "mt_bench"
        return BenchPrompt(task, pid, None, tuple(turns if both_turns else turns[:1]))
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError("'prompt' must be a non-empty string")
        return BenchPrompt(str(obj.get("task", path.stem)), pid, None, (obj["prompt"],))
    if "messages" in obj or "conversations" in obj:
        return _conversation_prompt(obj, path, pid)
    raise ValueError("expected 'turns', 'prompt', 'messages' or 'conversations'")


def _conversation_prompt(obj: dict, path: Path, pid: str) -> BenchPrompt:
    turns = obj.get("messages", obj.get("conversations"))
    if not isinstance(turns, list):
        raise ValueError("'messages'/'conversations' must be a list")
    system, users = None, []
    for i, t in enumerate(turns):
        m = parse_message(t, i)
        if m["role"] == "assistant":
            break
        if m["role"] == "system":
            system = m["content"]
        elif m["content"]:
            users.append(m["content"])
    if not users:
        raise ValueError("conversation has no user turn before the first assistant reply")
    # Consecutive user turns before any reply are one turn.
    return BenchPrompt(str(obj.get("task", path.stem)), pid, system, ("\n\n".join(users),))


# ---- shortcuts for the scripts and tests that want plain strings ----------------------------
def mtbench_first_turns(limit: int | None = None) -> list[str]:
    return [p.turns[0] for p in load_datasets(["mtbench"], limit=None).prompts[:limit]]


def specbench_prompts(tasks: list[str] | None = None, limit: int | None = None) -> dict[str, list[str]]:
    """First turns per Spec-Bench task (MT-bench categories fold into 'mt_bench')."""
    by_task = load_datasets(["specbench"], tasks, limit).by_task()
    return {task: [p.turns[0] for p in ps] for task, ps in by_task.items()}

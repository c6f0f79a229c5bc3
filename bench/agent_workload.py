"""The multi-turn agent workload: where text recurs across turns, as in agent loops.

Two kinds of session, alternating:

- **tools**: the calculator agent of bench/agent.py run as a loop. The opening shows the first
  half of a held-out GSM8K solution as JSON tool calls and results; then every reply of the model
  is run as a tool call (bench/agent.py:tool_reply) and its result is the next user turn, until
  the model calls final_answer or has replied `MAX_TOOL_REPLIES` times. The tool-call shape and
  its arguments recur in the prompt, across turns and across sessions.
- **edit**: a code-writing exchange from GPTeacher's codegen set (the user's request and the
  reply that defines a Python function), then two edits of that code: rename the function, then
  add a docstring, each asking for the whole code again. The replies rewrite code shown earlier.
  (The set is in `../shared/data/train/`: suffix decoding, the default drafter, does not read it;
  a datastore built on train/ would.)

Every turn carries the whole conversation so far, the model's own replies included, so a server
with prefix reuse prefills only the new turn. Replies end at the model's end of turn (EOS is not
ignored). At T=0 every server produces the same replies, so each runs the same sessions.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from bench.agent import agent_sessions, tool_reply
from bench.data import DATA
from bench.serve_load import Conversation

MAX_TOOL_REPLIES = 6
CODEGEN = DATA / "train" / "gpteacher_codegen.jsonl"
_PY_DEF = re.compile(r"^def (\w+)\(.*\):\s*$", re.M)


@dataclass(frozen=True)
class AgentSpec:
    """One session: its opening messages and, for a code edit, the user turns after each reply
    (a tools session has none: each reply runs as a tool call)."""
    kind: str                          # "tools" | "edit"
    opening: tuple[dict, ...]
    edits: tuple[str, ...] = ()
    id: str = ""

    @property
    def task(self) -> str:
        return f"agent-{self.kind}"

    def messages(self) -> list[dict]:
        return list(self.opening)

    def follow_up(self, first: dict) -> "Conversation | ToolSession":
        """The unit a bench worker runs (bench/serve_load.py:run_item), `first` the opening's body."""
        return ToolSession(first) if self.kind == "tools" else Conversation(first, self.edits)


@dataclass(frozen=True)
class ToolSession:
    """A tools session for one worker: after each reply, the tool's result (None: it has ended)."""
    first: dict
    max_replies: int = MAX_TOOL_REPLIES

    def next_user(self, turn: int, reply: str) -> str | None:
        return tool_reply(reply) if turn + 1 < self.max_replies else None


def edit_specs(limit: int, path: Path | None = None, max_lines: int = 30) -> list[AgentSpec]:
    """Code-edit sessions from the codegen exchanges whose reply defines a Python function in at
    most `max_lines` lines, in file order, at most `limit`."""
    out = []
    with open(path or CODEGEN) as f:
        for line in f:
            user, reply = json.loads(line)["conversations"][:2]
            found = _PY_DEF.search(reply["content"])
            if found is None or reply["content"].count("\n") >= max_lines:
                continue
            name = found.group(1)
            edits = (f"Rename `{name}` to `{name}_v2` everywhere and reply with the whole code again, changed, "
                     "in one code block.",
                     f"Now add a one-line docstring to `{name}_v2` and reply with the whole code again, "
                     "in one code block.")
            messages = ({"role": "user", "content": user["content"]},
                        {"role": "assistant", "content": reply["content"]}, {"role": "user", "content": edits[0]})
            out.append(AgentSpec("edit", messages, edits[1:], id=f"edit-{len(out)}"))
            if len(out) == limit:
                break
    return out


def agent_specs(limit: int, gsm8k: Path | None = None, codegen: Path | None = None) -> list[AgentSpec]:
    """`limit` sessions, tools and edit alternating (tools first)."""
    tools = [AgentSpec("tools", tuple(m), id=f"tools-{i}")
             for i, m in enumerate(agent_sessions((limit + 1) // 2, path=gsm8k))]
    edits = edit_specs(limit // 2, path=codegen)
    if len(tools) + len(edits) < limit:
        raise ValueError(f"the data holds {len(tools)} tools and {len(edits)} edit sessions, fewer than {limit}")
    mixed = [s for pair in zip(tools, edits) for s in pair] + tools[len(edits):]
    return mixed[:limit]

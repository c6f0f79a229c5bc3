"""`agent`: an agent-like workload, where a reply repeats the shapes of earlier turns.

Each session is a GSM8K problem (held-out split) solved by a calculator agent: the shared
system prompt defines the tools as JSON schemas; every step of the reference solution
("16 - 3 - 4 = 9") becomes an assistant turn calling the calculator in JSON and a turn with
the tool's result. A prompt holds the first half of a session's steps; the model writes the
next turn, as an agent framework without native tool roles would ask it to. The same
tool-call shape recurs in the prompt, across sessions and in the reply: suffix decoding's
case (SuffixDecoding's agentic workloads), which prompt lookup and a chat corpus see less of.
"""
from __future__ import annotations

import ast
import json
import operator
import re
from pathlib import Path

from bench.data import DATA

TOOLS = [
    {"name": "calculator", "description": "Evaluate an arithmetic expression and return the number.",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}},
    {"name": "final_answer", "description": "Give the final answer to the user and stop.",
     "parameters": {"type": "object", "properties": {"answer": {"type": "number"}}, "required": ["answer"]}},
]
SYSTEM = ("You are a careful math agent. Solve the user's problem one step at a time. Each turn, reply with "
          "exactly one JSON object that calls a tool: {\"name\": TOOL, \"arguments\": {...}}. The tool's result "
          "comes back as the next message. Tools:\n" + "\n".join(json.dumps(t) for t in TOOLS))
_STEP = re.compile(r"([\d][\d.,]*(?:\s*[-+*/x]\s*\(?[\d][\d.,]*\)?)+)\s*=\s*\$?([\d][\d.,]*)")


def steps(solution: str) -> list[tuple[str, str]]:
    """(expression, result) for every calculation in a GSM8K solution, in order."""
    return [(m.group(1).replace(",", ""), m.group(2).rstrip(".").replace(",", ""))
            for m in _STEP.finditer(solution)]


def session(question: str, solution_steps: list[tuple[str, str]], shown: int) -> list[dict]:
    """The conversation up to (not including) the agent's turn after `shown` steps."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for expr, result in solution_steps[:shown]:
        call = {"name": "calculator", "arguments": {"expression": expr}}
        messages += [{"role": "assistant", "content": json.dumps(call)},
                     {"role": "user", "content": json.dumps({"tool": "calculator", "result": result})}]
    return messages


def agent_sessions(limit: int | None = None, min_steps: int = 2, path: Path | None = None) -> list[list[dict]]:
    """Message lists from the held-out GSM8K problems (or the conversations in `path`) with at
    least `min_steps` calculations, in file order, at most `limit`; each shows the first half of its steps."""
    out = []
    with open(path or DATA / "heldout" / "gsm8k_test.jsonl") as f:
        for line in f:
            conv = json.loads(line)["conversations"]
            found = steps(conv[1]["content"])
            if len(found) >= min_steps:
                out.append(session(conv[0]["content"], found, max(1, len(found) // 2)))
            if limit is not None and len(out) == limit:
                break
    return out


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The calculator tool: numbers, + - * / (or x) and parentheses; ValueError for anything else."""
    try:
        tree = ast.parse(expression.replace("x", "*").replace(",", ""), mode="eval")
        value = _evaluate(tree.body)
    except (SyntaxError, ZeroDivisionError, RecursionError) as e:
        raise ValueError(f"cannot evaluate {expression!r}: {e}") from None
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"the calculator takes numbers and + - * / only, not {ast.dump(node)[:40]}")


def tool_reply(reply: str) -> str | None:
    """The agent's next user turn after the model's `reply`: the calculator's result, or an error
    the model can correct; None when the reply calls final_answer (the session ends)."""
    start = reply.find("{")
    try:
        call, _ = json.JSONDecoder().raw_decode(reply[start:]) if start >= 0 else (None, 0)
    except json.JSONDecodeError:
        call = None
    if not isinstance(call, dict):
        return json.dumps({"error": "reply with one JSON object that calls a tool"})
    name, args = call.get("name"), call.get("arguments")
    if name == "final_answer":
        return None
    expression = args.get("expression") if isinstance(args, dict) else None
    if name != "calculator" or not isinstance(expression, str):
        return json.dumps({"error": f"unknown tool or arguments: {json.dumps(call)[:120]}"})
    try:
        return json.dumps({"tool": "calculator", "result": calculate(expression)})
    except ValueError as e:
        return json.dumps({"tool": "calculator", "error": str(e)})

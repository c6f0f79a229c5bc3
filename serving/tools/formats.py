"""How a model family writes a tool call: the strings around the function's name and its
JSON arguments. The constraint (`constraint.py`), the parser (`parser.py`) and the fallback
prompt (`prompt.py`) all read them from here, so what is constrained is what is parsed.

`--tool-call-parser` picks one, as in vLLM:
    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Hermes, Qwen2.5/3)
    llama3_json  {"name": "f", "parameters": {...}}                            (Llama 3.1-3.3)
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    trigger: str        # what opens a call inside free text
    begin: str          # a call's text before the function's name (starts with `trigger`)
    between: str        # between the name and the arguments
    end: str            # after the arguments
    separator: str      # between two calls an assistant turn replays (prompt.py)
    tool_role: str      # the role a tool's result is rendered as, where the template knows no tools
    instructions: str   # the tools' preamble, where the template knows no tools; {tools}: one JSON per line
    in_system: bool     # the preamble goes in the system turn (else before the first user turn)

    def call_text(self, name: str, arguments: str) -> str:
        return f"{self.begin}{name}{self.between}{arguments}{self.end}"

    def preamble(self, tools: list[dict]) -> str:
        return self.instructions.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


# Qwen2.5's template text (the Hermes convention), which SmolLM2-style ChatML models follow.
HERMES = ToolFormat(
    name="hermes", trigger="<tool_call>", begin='<tool_call>\n{"name": "', between='", "arguments": ',
    end="}\n</tool_call>", separator="\n", tool_role="user", in_system=True,
    instructions=(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'))

# vLLM's tool_chat_template_llama3.1_json.jinja: the tools before the first user message.
LLAMA3_JSON = ToolFormat(
    name="llama3_json", trigger='{"name": ', begin='{"name": "', between='", "parameters": ', end="}",
    separator="; ", tool_role="ipython", in_system=False,
    instructions=(
        "Given the following functions, please respond with a JSON for a function call with its proper "
        "arguments that best answers the given prompt.\n\nRespond in the format "
        '{{"name": function name, "parameters": dictionary of argument name and its value}}. '
        "Do not use variables.\n\n{tools}"))

FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}

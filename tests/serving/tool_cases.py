"""Tools the tool-calling tests offer SmolLM2, and conversations that ask for them."""
from __future__ import annotations

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "system", "content": "You are a helpful assistant that calls tools when they help."},
       {"role": "user", "content": "What is the weather like in Paris right now? Use the get_weather tool."}]
# SmolLM2-135M seldom opens a call by itself under `auto`; this one does (greedy), and stops after it
# with `parallel_tool_calls: false`.
AUTO_ASK = [{"role": "user", "content": "<tool_call> please: get_weather for Paris"}]
USERS = ["Weather in Oslo?", "Add 17 and 25.", "Is it raining in Lima?", "What is 3 plus 4?",
         "Tell me the weather in Tokyo in fahrenheit.", "Sum 100 and 23 for me."]

"""Tool calls without a model: the parser (whole and streamed agree, at every split), the
fallback prompt, and the constraint the tools make (its language checked with xgrammar)."""
from __future__ import annotations

import json

import pytest

from serving.tools.constraint import ToolChoice, tool_constraint
from serving.tools.formats import HERMES, LLAMA3_JSON
from serving.tools.parser import Arguments, CallStart, Content, ToolCallParser, parse_reply
from serving.tools.prompt import template_messages
from verifier.sampling.structured import StructuredOutputs

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def call(fmt, name, args):
    return fmt.call_text(name, json.dumps(args))


def streamed(fmt, text: str, cuts: list[int]):
    """parse_reply's result, rebuilt from the events of `text` fed in pieces cut at `cuts`."""
    parser, events, start = ToolCallParser(fmt), [], 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[start:cut])
        start = cut
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content)) or None
    calls = [[e.name, ""] for e in events if isinstance(e, CallStart)]
    for e in events:
        if isinstance(e, Arguments):
            calls[e.index][1] += e.text
    return content, [tuple(c) for c in calls]


def whole(fmt, text):
    r = parse_reply(fmt, text)
    return r.content, [(c.name, c.arguments) for c in r.calls]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
def test_calls_and_content_come_apart(fmt):
    a = call(fmt, "get_weather", {"city": "Paris"})
    b = call(fmt, "get_time", {})
    assert whole(fmt, f"Let me check.\n{a}\n{b}\n") == ("Let me check.", [("get_weather", '{"city": "Paris"}'),
                                                                         ("get_time", "{}")])
    assert whole(fmt, a) == (None, [("get_weather", '{"city": "Paris"}')])
    assert whole(fmt, "no call here") == ("no call here", [])


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
def test_a_stream_cut_anywhere_parses_as_the_whole_text(fmt):
    odd = call(fmt, "get_weather", {"city": 'a}b"c', "days": 12})
    text = f"Sure {{braces}} <tool and {odd}\n{call(fmt, 'get_time', {})} done "
    expected = whole(fmt, text)
    assert len(expected[1]) == 2 and expected[1][0][1] == '{"city": "a}b\\"c", "days": 12}'
    for cut in range(len(text) + 1):
        assert streamed(fmt, text, [cut]) == expected, cut
    assert streamed(fmt, text, list(range(1, len(text)))) == expected       # a character at a time


def test_a_reply_cut_inside_a_call_keeps_the_arguments_written():
    text = call(HERMES, "get_weather", {"city": "Paris"})
    assert whole(HERMES, text[:len(HERMES.begin) + 4]) == (None, [])                  # the name unfinished
    cut = text.index("Paris")
    assert whole(HERMES, text[:cut]) == (None, [("get_weather", '{"city": "')])


def test_the_parser_announces_a_call_then_streams_its_arguments():
    parser = ToolCallParser(HERMES)
    text = call(HERMES, "get_weather", {"city": "Paris"})
    first = parser.feed(text[:text.index("Par")])
    assert isinstance(first[0], CallStart) and first[0].name == "get_weather" and first[0].id.startswith("call_")
    assert [e.text for e in first[1:]] == ['{"city": "']
    assert [e.text for e in parser.feed(text[text.index("Par"):])] == ['Paris"}']
    assert parser.calls == 1


def test_templates_without_tools_get_the_hermes_preamble_calls_and_results():
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]
    turns, tools = template_messages(messages, [WEATHER], HERMES, template_knows_tools=False)
    assert tools is None
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in turns[0]["content"]
    assert turns[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert turns[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"


def test_templates_with_tools_get_them_as_transformers_passes_them():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
    turns, tools = template_messages(messages, [TIME], HERMES, template_knows_tools=True)
    assert tools == [TIME] and turns[1]["tool_calls"][0]["function"]["arguments"] == {}
    assert turns[1]["content"] == ""


def test_llama3_json_offers_the_tools_before_the_first_user_turn():
    turns, _ = template_messages([{"role": "user", "content": "hi"}], [TIME], LLAMA3_JSON, False)
    assert turns[0]["content"].startswith("Given the following functions") and turns[0]["content"].endswith("\n\nhi")


def language(constraint: StructuredOutputs):
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string
    from verifier.sampling.grammar_worker import compact_json_contents
    grammar = xgr.Grammar.from_structural_tag(compact_json_contents(constraint.structural_tag))
    return lambda s: _is_grammar_accept_string(grammar, s)


def test_the_constraint_follows_tool_choice():
    paris, tick = call(HERMES, "get_weather", {"city": "Paris"}), call(HERMES, "get_time", {})
    tools = [WEATHER, TIME]
    auto = language(tool_constraint(HERMES, tools, ToolChoice("auto")))
    assert auto("just text") and auto(f"text {paris}") and auto(f"{paris}\n{tick}")
    assert not auto(f"{paris} and more text")                                   # nothing after the calls
    assert not auto("text <tool_call> no call")                                 # the trigger opens a call
    assert not auto(call(HERMES, "get_weather", {"town": "Paris"}))             # not the schema
    assert not auto(call(HERMES, "get_wether", {"city": "Paris"}))              # not a tool
    assert not auto(paris.replace('{"city": "Paris"}', '{"city":"Paris"}'))     # JSON written one way
    required = language(tool_constraint(HERMES, tools, ToolChoice("required")))
    assert required(paris) and required(f"{paris}\n{tick}") and not required("text")
    assert not required(f"text {paris}") and not required(f"{paris}\nmore")
    one = language(tool_constraint(HERMES, tools, ToolChoice("required", parallel=False)))
    assert one(paris) and not one(f"{paris}\n{tick}")
    named = language(tool_constraint(HERMES, tools, ToolChoice("named", "get_time")))
    assert named(tick) and not named(paris)
    llama = language(tool_constraint(LLAMA3_JSON, tools, ToolChoice("auto")))
    assert llama(call(LLAMA3_JSON, "get_time", {}) + "; " + call(LLAMA3_JSON, "get_weather", {"city": "Oslo"}))
    assert tool_constraint(HERMES, tools, ToolChoice("none")) is None


def test_auto_with_a_text_constraint_is_that_text_or_calls():
    paris = call(HERMES, "get_weather", {"city": "Paris"})
    either = language(tool_constraint(HERMES, [WEATHER], ToolChoice("auto"), StructuredOutputs(choice=["yes", "no"])))
    assert either("yes") and either(paris) and not either("maybe") and not either(f"yes{paris}")

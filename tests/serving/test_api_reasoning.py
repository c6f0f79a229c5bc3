"""Reasoning output through `tercel serve --reasoning-parser` and the official openai client, on
the default model under stated chat templates that think (a conversation whose earlier answers
show the `<think>` block leads the model to write one): `reasoning_content` apart from
`content`, whole and streamed alike, its tokens in the usage; a constraint held only after the
block; a thinking budget closing it early; the same replies with speculation on and off;
`enable_thinking: false` honoured; the
Messages and Responses routes' own shapes of it; and a tiny random Qwen3 whose replies are full of
the markers' pieces, split the same streamed and whole at its real token boundaries."""
from __future__ import annotations

import json

import jsonschema
import pytest

from serving.reasoning import DEEPSEEK_R1, QWEN3
from pinned import untuned_dense_linears
from server_util import LiveServer, ngram_server
from spec.adaptive import AdaptiveConfig
from spec.config import EngineConfig

TURNS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n")
# deepseek_r1: the template opens the block; qwen3: the model does, or with enable_thinking false
# the template writes an empty one (as Qwen3's own template does).
TEMPLATES = {
    "deepseek_r1": TURNS + "<think>\n{% endif %}",
    "qwen3": TURNS + "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                     "{% endif %}",
}
SHOTS = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is 1+1?"},
         {"role": "assistant", "content": "<think>\nOne plus one is two.\n</think>\n\n2"},
         {"role": "user", "content": "What is 4+4?"},
         {"role": "assistant", "content": "<think>\nFour plus four is eight.\n</think>\n\n8"}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}
BRIEF = {**ANSWER, "properties": {"answer": {"type": "string", "maxLength": 12}}}    # an answer cut short of a loop


def ask(question: str) -> list[dict]:
    return [*SHOTS, {"role": "user", "content": question}]


# `make test` serves qwen3's template (an optional block); deepseek_r1's (opened by the template)
# under `make test-slow`: its split and its grammar are checked in make test by the split tests and
# the every-drafter exactness test.
@pytest.fixture(scope="module", params=[QWEN3, pytest.param(DEEPSEEK_R1, marks=pytest.mark.slow)],
                ids=lambda f: f.name)
def fmt(request):
    return request.param


@pytest.fixture(scope="module")
def server(fmt):
    # Dense weights on their untuned matmul split: the tests below need the model to write and close
    # a block, which its text must not owe to the int4 kernel or matmul library a load's timings picked.
    with untuned_dense_linears():
        s = ngram_server(quantization="none", chat_template=TEMPLATES[fmt.name], reasoning=fmt)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def chat(client, question: str, **kw):
    kw = {"max_tokens": 40, **kw}
    return client.chat.completions.create(model="smol", messages=ask(question), temperature=0, **kw)


def streamed(client, question: str, **kw) -> tuple[str, str, dict]:
    reasoning, content, usage = [], [], None
    for chunk in chat(client, question, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    return "".join(reasoning), "".join(content), usage


def test_the_reasoning_comes_apart_from_the_answer_whole_and_streamed_alike(server, client):
    for question in ("What is 2+3?", "What is 3+5?"):
        reply = chat(client, question)
        message = reply.choices[0].message
        assert message.reasoning_content and message.content, message
        assert "<think>" not in message.content + message.reasoning_content
        assert "</think>" not in message.content + message.reasoning_content
        details = reply.usage.completion_tokens_details
        assert 0 < details.reasoning_tokens < reply.usage.completion_tokens
        assert streamed(client, question)[:2] == (message.reasoning_content, message.content)
        assert streamed(client, question)[2].completion_tokens_details.reasoning_tokens == details.reasoning_tokens
    server.wait_idle()


def test_a_constraint_holds_only_what_follows_the_reasoning(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    reply = chat(client, "What is 10-4?", response_format=fmt, max_tokens=60)
    message = reply.choices[0].message
    assert message.reasoning_content, message         # free text, before the JSON
    jsonschema.validate(json.loads(message.content), ANSWER)
    assert reply.choices[0].finish_reason == "stop"
    server.wait_idle()


@pytest.mark.parametrize("constrained", [False, True])
def test_speculation_on_and_off_give_the_same_reply(client, constrained):
    kw = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
          "max_tokens": 60} if constrained else {}
    on = chat(client, "What is 3+5?", **kw).choices[0].message
    off = chat(client, "What is 3+5?", extra_body={"speculation": "off"}, **kw).choices[0].message
    assert (on.reasoning_content, on.content) == (off.reasoning_content, off.content)


def test_enable_thinking_false_is_the_template_s_to_honour(fmt, client):
    """Qwen3's template writes an empty block into the prompt: the reply is all answer. The
    deepseek_r1 template here takes no such switch: the reply still starts inside its block."""
    reply = chat(client, "What is 2+3?", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    if fmt is QWEN3:
        assert message.reasoning_content is None and message.content and "<think>" not in message.content
        assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    else:
        assert message.reasoning_content


def test_the_messages_api_returns_the_block_as_a_thinking_block(server, client):
    """/v1/messages: the chat reply's reasoning as a `thinking` block first, its content as the
    text block, whole and through the SDK's stream alike."""
    api = server.anthropic_client()
    system, turns = SHOTS[0]["content"], ask("What is 3+5?")[1:]
    chat_message = chat(client, "What is 3+5?").choices[0].message
    kw = dict(model="smol", max_tokens=40, system=system, messages=turns, extra_body={"temperature": 0})
    whole = api.messages.create(**kw)
    with api.messages.stream(**kw) as stream:
        streamed_message = stream.get_final_message()
    for message in (whole, streamed_message):
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == chat_message.reasoning_content
        assert message.content[1].text == chat_message.content
    server.wait_idle()


def test_a_thinking_budget_closes_the_block_and_the_answer_follows(fmt, server, client):
    """thinking_token_budget: the block's first BUDGET tokens, then `</think>` forced, then the answer
    in its schema; the reasoning tokens count the markers, as the usage does. /v1/messages holds
    thinking.budget_tokens to the same reply."""
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": BRIEF}}
    free = chat(client, "What is 10-4?", max_tokens=60).choices[0].message
    reply = chat(client, "What is 10-4?", response_format=schema, max_tokens=60, extra_body={"thinking_token_budget": 3})
    message = reply.choices[0].message
    markers = len(server.engine.tokenizer.encode("</think>", add_special_tokens=False))
    opening = 0 if fmt.opened_by_template else len(server.engine.tokenizer.encode("<think>", add_special_tokens=False))
    assert reply.usage.completion_tokens_details.reasoning_tokens == opening + 3 + markers
    assert message.reasoning_content and free.reasoning_content.startswith(message.reasoning_content)
    assert len(message.reasoning_content) < len(free.reasoning_content)
    jsonschema.validate(json.loads(message.content), BRIEF)
    budgeted = chat(client, "What is 10-4?", max_tokens=60, extra_body={"thinking_token_budget": 3}).choices[0].message
    api = server.anthropic_client()
    anthropic = api.messages.create(model="smol", max_tokens=60, system=SHOTS[0]["content"],
                                    messages=ask("What is 10-4?")[1:], thinking={"type": "enabled", "budget_tokens": 3},
                                    extra_body={"temperature": 0})
    assert [b.type for b in anthropic.content] == ["thinking", "text"]
    assert (anthropic.content[0].thinking, anthropic.content[1].text) == (budgeted.reasoning_content, budgeted.content)
    server.wait_idle()


def test_the_responses_api_returns_the_block_as_a_reasoning_item(server, client):
    """/v1/responses: the chat reply's reasoning as a `reasoning` item before the message, its
    tokens counted as the chat route counts them, whole and streamed alike."""
    chat_reply = chat(client, "What is 3+5?")
    kw = dict(model="smol", instructions=SHOTS[0]["content"], input=ask("What is 3+5?")[1:], max_output_tokens=40,
              temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        streamed_response = stream.get_final_response()
    for response in (whole, streamed_response):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == chat_reply.choices[0].message.reasoning_content
        assert response.output_text == chat_reply.choices[0].message.content
        assert response.usage.output_tokens_details.reasoning_tokens == \
            chat_reply.usage.completion_tokens_details.reasoning_tokens
    server.wait_idle()


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, smollm2_dir):
    """A tiny random Qwen3 (the SmolLM2 tokenizer) under a template that opens its block, the
    deepseek_r1 parser: replies full of the markers' pieces, cut wherever its tokens fall."""
    from conftest import make_tiny_model
    model = make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), smollm2_dir, model_type="qwen3", head_dim=32)
    s = LiveServer(EngineConfig(model=str(model), max_num_seqs=8, drafter="ngram",
                                adaptive=AdaptiveConfig(enabled=False)),
                   model_name="tiny", chat_template=TEMPLATES["deepseek_r1"], reasoning=DEEPSEEK_R1)
    yield s
    s.close()


# "<", "</", "think", ">" pushed up: markers whole, cut and broken, in random places
MARKER_PIECES = {"44": 9, "9617": 11, "17400": 11, "46": 11}


def test_a_tiny_random_qwen3_s_replies_split_the_same_streamed_and_whole(tiny_qwen3):
    client = tiny_qwen3.openai_client()
    seen = set()
    for seed in range(6):
        kw = dict(model="tiny", messages=[{"role": "user", "content": "think"}], max_tokens=48, temperature=1.0,
                  seed=seed, logit_bias=MARKER_PIECES)
        whole = client.chat.completions.create(**kw)
        message = whole.choices[0].message
        reasoning, content = [], []
        for chunk in client.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
                content.append(choice.delta.content or "")
        assert ("".join(reasoning), "".join(content)) == (message.reasoning_content or "", message.content or "")
        assert "</think>" not in message.reasoning_content
        seen.add(message.content is not None)
    assert seen == {True, False}, seen      # some replies closed their block, some did not
    tiny_qwen3.wait_idle()


ADD = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"], "additionalProperties": False}}}]


def test_tool_calls_are_held_only_after_the_reasoning(server, client):
    """`tool_choice: required` under a reasoning parser: the block first, free; then the call."""
    reply = chat(client, "What is 7+8?", tools=ADD, tool_choice="required", max_tokens=80)
    message = reply.choices[0].message
    assert message.reasoning_content, message
    assert message.tool_calls, message
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), ADD[0]["function"]["parameters"])
    assert reply.choices[0].finish_reason == "tool_calls"
    server.wait_idle()


def test_the_responses_api_holds_text_format_only_after_the_reasoning(server, client):
    """/v1/responses goes through the chat route's parse: `text.format` is held after the block too."""
    response = client.responses.create(
        model="smol", instructions=SHOTS[0]["content"], input=ask("What is 10-4?")[1:], max_output_tokens=60,
        temperature=0, text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}})
    assert [item.type for item in response.output] == ["reasoning", "message"]
    jsonschema.validate(json.loads(response.output_text), ANSWER)

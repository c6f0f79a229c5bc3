"""The rest of the OpenAI surface over HTTP: vLLM's output controls (logit_bias, stop_token_ids,
min_tokens, include_stop_str_in_output, skip_special_tokens, chat_template_kwargs), the field
policy (refused, accepted, ignored and logged), /tokenize, /detokenize, /version,
/v1/models/{id}, the server's names, chat template and sampling defaults, and /openapi.json."""
from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from server_util import LiveServer
from serving.defaults import SamplingDefaults, load_sampling_defaults
from spec.adaptive import AdaptiveConfig
from spec.config import EngineConfig

EOS, IM_START, FORCED = 2, 1, 5000      # SmolLM2's <|im_end|> (the tiny model's EOS), <|im_start|>, a word
# SmolLM2's template without its default system turn, and a variable of the client's own.
TEMPLATE = ("{% if greeting %}{{ greeting }}\n{% endif %}{% for m in messages %}"
            "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Requests that leave them out sample greedily: the defaults a generation_config.json would give.
DEFAULTS = SamplingDefaults((("temperature", 0.0), ("top_k", 5)), "a test")


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = LiveServer(EngineConfig(model=str(tiny_llama_dir), drafter="ngram", adaptive=AdaptiveConfig(),
                                max_model_len=256, num_kv_blocks=128), model_name="tiny",
                   model_names=("tiny", "tiny-alias"), chat_template=TEMPLATE, sampling_defaults=DEFAULTS)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    server.wait_idle()
    return r


def complete(server, **fields) -> httpx.Response:
    return post(server, "/v1/completions", {"model": "tiny", "prompt": "The weather today", "max_tokens": 4,
                                             "temperature": 0, **fields})


def chat_body(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


# ---- output controls ---------------------------------------------------------------------------
def test_logit_bias_through_the_openai_client(client, server):
    """+100 all but forces a token; the SDK sends OpenAI's shape (ids as string keys)."""
    r = client.completions.create(model="tiny", prompt="The weather today", max_tokens=4, temperature=0,
                                  logit_bias={str(FORCED): 100})
    assert r.choices[0].text == server.engine.tokenizer.decode([FORCED] * 4)
    server.wait_idle()


def test_a_banned_token_never_comes(server):
    first = complete(server).json()["choices"][0]["text"]
    token = server.engine.tokenizer.encode(first, add_special_tokens=False)[0]
    banned = complete(server, logit_bias={str(token): -100}).json()["choices"][0]["text"]
    assert banned != first and server.engine.tokenizer.encode(banned, add_special_tokens=False)[0] != token


def test_a_stop_token_ends_the_output_its_text_left_out_unless_asked(server):
    forced = {"logit_bias": {str(FORCED): 100}, "stop_token_ids": [FORCED]}
    plain, kept = complete(server, **forced).json(), complete(server, include_stop_str_in_output=True, **forced).json()
    assert plain["choices"][0]["finish_reason"] == kept["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] == 1
    assert plain["choices"][0]["text"] == "" and kept["choices"][0]["text"] == server.engine.tokenizer.decode([FORCED])


def test_min_tokens_holds_eos_back(server):
    """EOS forced by the bias ends the output at once, or after min_tokens tokens with it."""
    eos = {"logit_bias": {str(EOS): 100}, "max_tokens": 12}
    assert complete(server, **eos).json()["usage"]["completion_tokens"] == 1
    held = complete(server, min_tokens=5, **eos).json()
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"


def test_include_stop_str_in_output_keeps_the_stop_string(server):
    full = complete(server, max_tokens=12, ignore_eos=True).json()["choices"][0]["text"]
    stop = full[5:8]
    cut = complete(server, max_tokens=12, ignore_eos=True, stop=[stop]).json()["choices"][0]["text"]
    kept = complete(server, max_tokens=12, ignore_eos=True, stop=[stop],
                    include_stop_str_in_output=True).json()["choices"][0]["text"]
    assert kept == cut + stop and full.startswith(kept)


def test_skip_special_tokens_false_shows_them(server):
    forced = {"logit_bias": {str(IM_START): 100}, "max_tokens": 2, "ignore_eos": True}
    assert complete(server, **forced).json()["choices"][0]["text"] == ""
    assert complete(server, skip_special_tokens=False, **forced).json()["choices"][0]["text"] == "<|im_start|>" * 2


def test_streamed_deltas_keep_the_stop_string_too(server):
    full = complete(server, max_tokens=12, ignore_eos=True).json()["choices"][0]["text"]
    stop = full[5:8]
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "The weather today", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop": [stop], "include_stop_str_in_output": True, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text.endswith(stop) and full.startswith(text)
    server.wait_idle()


@pytest.mark.parametrize("fields, param", [
    (dict(logit_bias={"49152": 1}), "logit_bias"),
    (dict(logit_bias={"7": 101}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(stop_token_ids=[3, 10**6]), "stop_token_ids[1]"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(min_tokens=300), "min_tokens"),                     # above what the context leaves
    (dict(min_tokens=1, guided_regex="a+"), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(skip_special_tokens="no"), "skip_special_tokens"),
])
def test_bad_output_controls_are_a_400_naming_the_field(server, fields, param):
    r = complete(server, **{"max_tokens": None, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("budget", [8, 0])
def test_a_thinking_budget_without_a_reasoning_parser_is_a_400_naming_it(server, budget):
    """The budget needs the block's markers, which --reasoning-parser names; 0 is no budget at all."""
    r = post(server, "/v1/chat/completions", chat_body(thinking_token_budget=budget))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "thinking_token_budget"
    assert budget == 0 or "--reasoning-parser" in r.json()["error"]["message"]


# ---- chat template, its variables, the names, the defaults ---------------------------------------
def test_the_servers_chat_template_and_its_variables(server):
    """--chat-template's template renders the chat; chat_template_kwargs reach it; /tokenize
    counts what the chat route sends."""
    plain = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    greeted = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                         "chat_template_kwargs": {"greeting": "Good morning"}}).json()
    decoded = post(server, "/detokenize", {"tokens": greeted["tokens"]}).json()["prompt"]
    assert decoded.startswith("Good morning\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert "SmolLM" not in decoded and greeted["count"] > plain["count"]
    r = post(server, "/v1/chat/completions", chat_body(chat_template_kwargs={"greeting": "Good morning"}))
    assert r.json()["usage"]["prompt_tokens"] == greeted["count"]


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "eos_token", "raise_exception"])
def test_template_variables_that_would_replace_the_servers_are_refused(server, name):
    for path, body in (("/v1/chat/completions", chat_body(chat_template_kwargs={name: "x"})),
                       ("/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                      "chat_template_kwargs": {name: "x"}})):
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{name}"


def test_special_tokens_in_template_variables_are_text(server):
    """A variable is the client's text: `<|im_start|>` in it cannot forge a turn."""
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                   "chat_template_kwargs": {"greeting": "<|im_start|>system"}}).json()
    assert r["tokens"].count(IM_START) == 2      # the user's turn and the assistant's, not the greeting


def test_every_served_name_is_accepted_and_the_first_reported(server, client):
    r = post(server, "/v1/chat/completions", chat_body(model="tiny-alias"))
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    assert [m.id for m in client.models.list()] == ["tiny", "tiny-alias"]
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"


def test_an_unknown_model_id_is_a_404_in_openais_shape(server, client):
    r = httpx.get(f"{server.url}/v1/models/gpt-4")
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "model 'gpt-4' does not exist; this server serves 'tiny'",
                                 "type": "not_found_error", "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/gpt-4")       # an id with a slash reaches the route too


def test_fields_left_out_get_the_models_defaults(server):
    """temperature 0 from the defaults: two seeds give one text; an explicit temperature wins."""
    texts = {s: complete(server, temperature=None, seed=s, max_tokens=8).json()["choices"][0]["text"] for s in (1, 2)}
    sampled = {s: complete(server, temperature=1.0, top_k=0, seed=s, max_tokens=8).json()["choices"][0]["text"]
               for s in (1, 2)}
    assert texts[1] == texts[2] == complete(server, max_tokens=8).json()["choices"][0]["text"]
    assert sampled[1] != sampled[2]


def test_generation_config_values_are_read_checked_and_optional(tmp_path, tiny_llama_dir):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 50.0, "do_sample": True, "max_new_tokens": 10}))
    loaded = load_sampling_defaults(str(tmp_path), "unused")
    assert loaded.values == (("temperature", 0.6), ("top_p", 0.9), ("top_k", 50))
    assert "temperature=0.6" in loaded.describe()
    assert load_sampling_defaults("none", str(tiny_llama_dir)).values == ()
    assert load_sampling_defaults("auto", str(tiny_llama_dir)).values == ()     # bos/eos ids only
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        load_sampling_defaults(str(tmp_path), "unused")
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_sampling_defaults(str(tmp_path / "missing"), "unused")


def test_the_serve_flags_build_the_apps_settings(tmp_path, tiny_llama_dir, caplog):
    from serving.limits import ServerLimits
    from serving.server import parse_serve_args, server_config
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    (tiny_model := tmp_path / "m").mkdir()
    for f in tiny_llama_dir.iterdir():
        (tiny_model / f.name).symlink_to(f)
    (tiny_model / "generation_config.json").unlink()
    (tiny_model / "generation_config.json").write_text(json.dumps({"top_p": 0.8}))
    args = parse_serve_args(["--model", str(tiny_model), "--served-model-name", "a", "b",
                             "--chat-template", str(tmp_path / "t.jinja")])
    with caplog.at_level(logging.INFO, logger="tercel.serve"):
        config = server_config(args, ServerLimits())
    assert config.model_names == ("a", "b") and config.chat_template == TEMPLATE
    assert config.sampling_defaults.values == (("top_p", 0.8),)
    assert any("top_p=0.8" in r.getMessage() for r in caplog.records)
    off = server_config(parse_serve_args(["--model", str(tiny_model), "--generation-config", "none"]), ServerLimits())
    assert off.sampling_defaults.values == () and off.model_names == (str(tiny_model), "m")
    with pytest.raises(ValueError, match="--chat-template"):
        server_config(parse_serve_args(["--chat-template", str(tmp_path / "none.jinja")]), ServerLimits())


def test_kv_memory_fraction_takes_a_share_of_the_memory_available(monkeypatch):
    """On a CPU the share is of `verifier.memory.available_bytes`: in a container, what its cgroup's
    limit leaves, not the host's free pages."""
    import torch

    from serving import server
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(server, "available_bytes", lambda: 4 << 30)
    config = server.engine_config(server.parse_serve_args(["--kv-memory-fraction", "0.25"]))
    assert config.kv_cache_bytes == 1 << 30


# ---- field policy --------------------------------------------------------------------------------
@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", dict(best_of=2), "best_of"),
    ("/v1/completions", dict(suffix="end"), "suffix"),
    ("/v1/chat/completions", dict(best_of=3, n=2), "best_of"),
    ("/v1/chat/completions", dict(functions=[{"name": "f"}]), "functions"),
    ("/v1/chat/completions", dict(use_beam_search=True), "use_beam_search"),
    ("/v1/chat/completions", dict(modalities=["text", "audio"]), "modalities"),
    ("/v1/chat/completions", dict(chat_template="{{ messages }}"), "chat_template"),
    ("/v1/chat/completions", dict(continue_final_message=True), "continue_final_message"),
    ("/v1/completions", dict(add_special_tokens=False), "add_special_tokens"),
])
def test_fields_that_would_change_the_output_are_refused_by_name(server, path, fields, param):
    body = chat_body(**fields) if "chat" in path else {"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_harmless_values_and_bookkeeping_fields_are_accepted_quietly(server, caplog):
    fields = dict(best_of=2, n=2, use_beam_search=False, modalities=["text"], add_generation_prompt=True,
                  user="u", metadata={"k": "v"}, store=False, service_tier="auto", suffix="")
    with caplog.at_level(logging.WARNING, logger="tercel.serve"):
        chat = post(server, "/v1/chat/completions", chat_body(**{k: v for k, v in fields.items() if k != "suffix"}))
        text = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "suffix": "",
                                                "best_of": 1})
    assert chat.status_code == text.status_code == 200, chat.text + text.text
    assert not [r for r in caplog.records if "unknown request field" in r.getMessage()]


def test_an_unknown_field_is_ignored_and_logged_once(server, caplog):
    with caplog.at_level(logging.WARNING, logger="tercel.serve"):
        for _ in range(2):
            assert post(server, "/v1/chat/completions", chat_body(frobnicate_xyz=1)).status_code == 200
    assert sum("'frobnicate_xyz'" in r.getMessage() for r in caplog.records) == 1


# ---- tokenize, detokenize, version ---------------------------------------------------------------
def test_tokenize_and_detokenize_in_vllms_shapes(server):
    tok = server.engine.tokenizer
    r = post(server, "/tokenize", {"model": "tiny", "prompt": "The weather today"}).json()
    assert r == {"count": len(r["tokens"]), "max_model_len": 256, "tokens": tok.encode("The weather today")}
    back = post(server, "/detokenize", {"model": "tiny", "tokens": r["tokens"]}).json()
    assert back == {"prompt": "The weather today"}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                      "add_generation_prompt": False}).json()
    assert tok.decode(chat["tokens"]) == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "tiny"}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "b"}]}, 400, "messages[0].tool_call_id"),
    ("/detokenize", {"tokens": [5, 49152]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]"),
])
def test_tokenize_and_detokenize_refuse_by_name(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_version(server):
    import importlib.metadata
    assert httpx.get(f"{server.url}/version").json() == {"version": importlib.metadata.version("tercel")}


# ---- the published schema ------------------------------------------------------------------------
NEW_FIELDS = {"logit_bias", "stop_token_ids", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
              "best_of", "metadata", "store", "service_tier"}


def test_openapi_documents_every_new_field_and_route(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    chat, text = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    assert NEW_FIELDS | {"chat_template_kwargs"} <= set(chat) and NEW_FIELDS | {"suffix"} <= set(text)
    assert all(chat[f].get("description") for f in NEW_FIELDS | {"chat_template_kwargs", "temperature"})
    bias = chat["logit_bias"]["anyOf"][0]
    assert bias["additionalProperties"] is False and bias["maxProperties"] == 1024
    assert list(bias["patternProperties"].values()) == [{"type": "number", "minimum": -100.0, "maximum": 100.0}]
    for path, method, response in (("/tokenize", "post", "TokenizeResponse"),
                                   ("/detokenize", "post", "DetokenizeResponse"),
                                   ("/version", "get", "VersionResponse"),
                                   ("/v1/models/{model_id}", "get", "ModelCard"),
                                   ("/v1/models", "get", "ModelList")):
        op = doc["paths"][path][method]
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(response)
        assert "422" not in op["responses"]
    assert {"prompt", "messages", "add_generation_prompt", "chat_template_kwargs"} <= set(
        schemas["TokenizeRequest"]["properties"])
    assert doc["paths"]["/tokenize"]["post"]["responses"]["400"]

"""LoRA adapters through the server, in vLLM's shapes (serving/lora_routes.py): an adapter is a
model name, listed with its parent; runtime loading only from under --lora-root; unloading fails
the adapter's own requests alone; refusals are 4xx naming the field."""
from __future__ import annotations

import json
import os

import httpx
import pytest

from lora_cases import ATTN_MLP, make_adapter
from server_util import LiveServer
from serving.flags import LoraServing
from spec import LLM
from spec.config import EngineConfig
from verifier.sampling.sampling_params import SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_llama_dir):
    """The adapters' folder: `a` served from the start, `b` loaded at runtime."""
    out = tmp_path_factory.mktemp("lora_root")
    make_adapter(tiny_llama_dir, out / "a", ATTN_MLP, seed=1)
    make_adapter(tiny_llama_dir, out / "b", ["q_proj", "v_proj"], r=4, seed=2)
    return out


@pytest.fixture(scope="module")
def server(tiny_llama_dir, root):
    modules = (("a", str(root / "a")),)
    s = LiveServer(EngineConfig(model=str(tiny_llama_dir), quantization="int4", drafter="suffix",
                                lora_modules=modules, max_model_len=1024, num_kv_blocks=128),
                   model_name="tiny", lora=LoraServing(modules, allow_runtime=True, root=root))
    yield s
    s.close()


def complete(server, model: str, max_tokens: int = 8) -> httpx.Response:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                          "temperature": 0}, timeout=120)
    server.wait_idle()
    return r


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_an_adapter_is_a_model_listed_with_its_parent(server, root):
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["a"]["parent"] == "tiny" and cards["a"]["root"] == str(root / "a")
    assert cards["tiny"].get("parent") is None
    assert httpx.get(f"{server.url}/v1/models/a").json()["parent"] == "tiny"


def test_a_request_naming_an_adapter_gets_the_adapted_models_text(server, tiny_llama_dir, root):
    """The server's greedy text under `a` is the offline API's under `a`, and not the base's."""
    adapted, base = complete(server, "a").json(), complete(server, "tiny").json()
    assert adapted["model"] == "a" and base["model"] == "tiny"
    llm = LLM(model=str(tiny_llama_dir), quantization="int4", lora_modules={"a": str(root / "a")}, num_kv_blocks=64)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), lora="a")[0].text
    assert adapted["choices"][0]["text"] == want != base["choices"][0]["text"]


def test_adapters_load_and_unload_at_runtime(server):
    assert complete(server, "b").status_code == 404
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "b"})
    assert r.status_code == 200 and "added" in r.text
    assert complete(server, "b").status_code == 200
    assert server.metric('tercel_lora_adapter_changes_total{change="load"}') == 1
    assert server.metric('tercel_lora_requests_info{max_lora="4"}') == 1
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 200 and "removed" in r.text
    assert complete(server, "b").status_code == 404
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 404


@pytest.mark.parametrize("path", ["../outside", "/etc", "escape", "missing", "b/adapter_config.json"])
def test_runtime_paths_outside_the_root_or_not_adapters_are_400s(server, root, tmp_path, path):
    """`..`, an absolute path elsewhere and a link leading out are refused as outside the root;
    a folder under it that is no adapter is refused naming what is missing; nothing is loaded."""
    outside = tmp_path / "outside"
    outside.mkdir()
    if path == "escape" and not (root / "escape").exists():
        os.symlink(outside, root / "escape")
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": path})
    body = r.json()["error"]
    assert r.status_code == 400 and body["param"] == "lora_path"
    assert ("outside the server's --lora-root" in body["message"]) == (path in ("../outside", "/etc", "escape"))
    assert "c" not in {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}


def test_a_name_already_served_is_refused(server, root):
    for name in ("a", "tiny"):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": "b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"


def test_unloading_fails_the_adapters_running_requests_alone(server):
    """A stream under the adapter ends with an error event when it is unloaded mid-reply; a base
    request beside it finishes; the pool is whole after."""
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "b"}).status_code == 200
    body = {"model": "b", "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "choices" in json.loads(first[6:])
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    assert "adapter 'b' was unloaded" in rest[-1]["error"]["message"]
    assert complete(server, "tiny").status_code == 200
    server.wait_idle()


def test_runtime_loading_is_off_unless_asked(tiny_llama_dir):
    s = LiveServer(EngineConfig(model=str(tiny_llama_dir), quantization="int4", num_kv_blocks=32), model_name="tiny")
    try:
        assert post(s, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "x"}).status_code == 404
    finally:
        s.close()


def test_bad_lora_flags_stop_the_server_before_it_loads(tiny_llama_dir, tmp_path):
    """Each a ValueError naming the flag, from the flags alone (no model loaded)."""
    from serving.limits import ServerLimits
    from serving.server import engine_config, parse_serve_args, server_config

    def refused(*flags: str) -> str:
        args = parse_serve_args(["--model", str(tiny_llama_dir), *flags])
        with pytest.raises(ValueError) as e:
            server_config(args, ServerLimits())
            engine_config(args)
        return str(e.value)
    assert "NAME=PATH" in refused("--lora-modules", "nameless")
    assert "twice" in refused("--lora-modules", "a=x", "a=y")
    assert "--lora-root" in refused("--allow-runtime-lora")
    assert "not a folder" in refused("--allow-runtime-lora", "--lora-root", str(tmp_path / "none"))
    assert "served model's name" in refused("--served-model-name", "tiny", "--lora-modules", "tiny=x")
    assert "--draft-lora-modules takes NAME=PATH" in refused("--draft-lora-modules", "x")
    assert "'b', an adapter lora_modules does not serve" in refused("--drafter", f"small:{tiny_llama_dir}",
                                                                      "--lora-modules", "a=x",
                                                                      "--draft-lora-modules", "b=y")
    args = parse_serve_args(["--model", str(tiny_llama_dir), "--lora-modules", "a=x", "--lora-dtype", "bfloat16",
                             "--drafter", f"small:{tiny_llama_dir}", "--draft-lora-modules", "a=y"])
    config = engine_config(args)
    assert config.lora_modules == (("a", "x"),) and config.lora_dtype == "bfloat16"
    assert config.draft_lora_modules == (("a", "y"),)

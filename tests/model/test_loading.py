"""Model resolution and loading errors, hidden-state taps, and the `tercel` command line."""
from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import make_tiny_model
from verifier.batch import ForwardBatch, SeqInput
from verifier.model.loader import resolve_model_dir
from verifier.target import TargetModel


def test_missing_path_names_what_was_looked_for(tmp_path):
    """A path that does not exist lists the forms that were tried."""
    with pytest.raises(ValueError, match="unknown model .*not an alias .*smollm2-135m-instruct.*gguf.*config.json"):
        resolve_model_dir(str(tmp_path / "nope"))


def test_directory_without_config_is_refused(tmp_path):
    """An existing directory with neither config.json nor a .gguf is named in the error."""
    with pytest.raises(ValueError, match=f"{tmp_path}.*has no config.json"):
        resolve_model_dir(str(tmp_path))


def test_malformed_config_and_missing_weights(tmp_path):
    """Malformed config.json, then a config without weights: each error names the file or tensor."""
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed .*config.json"):
        TargetModel(str(tmp_path), device="cpu")
    cfg = dict(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
               num_hidden_layers=1, num_attention_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        TargetModel(str(tmp_path), device="cpu")


def test_garbage_gguf_is_a_clear_error(tmp_path, monkeypatch):
    """A file named .gguf that is not a GGUF fails with the file's path in the message."""
    monkeypatch.setenv("TERCEL_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="could not convert GGUF .*broken.gguf"):
        resolve_model_dir(str(bad))
    assert not list((tmp_path / "cache" / "models").glob("*")), "no half-written cache entry is left"


def test_wrong_tensor_shape_names_the_tensor(tmp_path):
    """A checkpoint whose tensor does not fit the config names that tensor."""
    d = make_tiny_model(tmp_path, None)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mlp.*_proj.weight.*has shape"):
        TargetModel(str(d), device="cpu")


def test_hidden_state_taps_match_hf_hidden_states(tmp_path):
    """capture_layers=(0, 1, 2) returns HF's hidden_states[0..2] (index 0 = embeddings)."""
    from transformers import AutoModelForCausalLM
    d = make_tiny_model(tmp_path, None)
    ids = random.Random(0).choices(range(256), k=11)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)(
            torch.tensor([ids]), output_hidden_states=True).hidden_states
    target = TargetModel(str(d), device="cpu")
    target.allocate_kv(4, 16)
    out = target.forward(ForwardBatch([SeqInput(ids, 0, [2])], capture_layers=(0, 1, 2)))
    for layer in (0, 1):
        assert torch.allclose(out.hidden[layer], ref[layer][0], atol=1e-5)
    # HF's last entry has the final norm applied; ours is the raw residual stream before it.
    normed = target.net.model.norm(out.hidden[2])
    assert torch.allclose(normed, ref[2][0], atol=1e-5)


def test_cli_bad_argument_exits_2(capsys):
    """`tercel chat --max-tokens 0` prints the allowed range and exits with code 2."""
    from serving.cli import main
    assert main(["chat", "--max-tokens", "0", "hi"]) == 2
    assert "max_tokens must be an int >= 1" in capsys.readouterr().err


def test_cli_chat_streams_and_reports_speed(tiny_llama_dir, capsys):
    """`tercel chat PROMPT` streams a reply to stdout and tokens/s to stderr."""
    from serving.cli import main
    assert main(["chat", "--model", str(tiny_llama_dir), "--max-tokens", "8", "Hello"]) == 0
    captured = capsys.readouterr()
    assert "tokens/s" in captured.err and "8 tokens" in captured.err
    assert captured.out.strip()

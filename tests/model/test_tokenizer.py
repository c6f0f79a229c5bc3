"""The thin serving tokenizer against transformers' tokenizer on the same files."""
from __future__ import annotations

import pytest

from verifier.model.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Zürich 東京 🦅?"}],
]


@pytest.fixture(scope="module")
def both(smollm2_dir):
    from transformers import AutoTokenizer
    return Tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_chat_template_matches_transformers(both, conv):
    """Rendered text and token ids of the chat template equal transformers' for each conversation."""
    ours, ref = both
    assert ours.apply_chat_template(conv, tokenize=False) == ref.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(conv) == list(ref.apply_chat_template(
        conv, tokenize=True, add_generation_prompt=True, return_dict=False))


def test_encode_decode_match_transformers(both):
    """Plain encode and decode (with and without special tokens) agree with transformers."""
    ours, ref = both
    text = "Hello <|im_start|>world\n  naïve 🦅 code:\tdef f(x): return x**2"
    assert ours.encode(text) == ref(text)["input_ids"]
    ids = ours.encode(text)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.eos_token_id == ref.eos_token_id == 2


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    """A directory without tokenizer.json is refused with its path in the message."""
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer(tmp_path)

"""`tercel serve` on a CUDA GPU answering the official openai client (`make test-gpu`)."""

import pytest
import torch

import openai

from server_util import LiveServer
from spec.adaptive import AdaptiveConfig
from spec.config import EngineConfig


@pytest.fixture(scope="module")
def server():
    s = LiveServer(EngineConfig(device="cuda", drafter="ngram", adaptive=AdaptiveConfig(), max_num_seqs=16),
                   model_name="smollm2")
    yield s
    s.close()


def test_chat_streaming_and_not_agree_and_the_pool_is_whole(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=32, temperature=0)
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=32, temperature=0,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert full.choices[0].message.content and streamed == full.choices[0].message.content
    assert full.usage.completion_tokens > 0
    sampled = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0.9,
                                             seed=5, n=2)
    assert len(sampled.choices) == 2
    server.wait_idle()

"""Schemathesis against the server's own /openapi.json on loopback: bodies that fit the
published request models (positive) and bodies that break them (negative), plus lone
surrogates and NUL characters spliced into the text fields. Every answer must be documented
for its route, carry the documented body, and never be a 5xx; a negative body must be refused."""
from __future__ import annotations

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)
from schemathesis.generation.modes import GenerationMode

from server_util import LiveServer
from spec.adaptive import AdaptiveConfig
from spec.config import EngineConfig

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
EXAMPLES = 35                  # per route and mode in `make test`: 280 requests
SLOW_EXAMPLES = 500            # per route and mode under `make test-slow`, fresh cases each run
MAX_TOKENS, MAX_N = 4, 2       # caps on in-range values, so that a fuzzed request stays short
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
# positive_data_acceptance is left out on purpose: a body that fits the schema can still be
# refused for what only the server knows (an unknown model, a tree above its caps, a token id
# past the vocabulary, a prompt past the context length), always with a documented 4xx.
SPLICES = ("\ud800", "\udfff", "\x00")


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = LiveServer(EngineConfig(model=str(tiny_llama_dir), drafter="ngram", adaptive=AdaptiveConfig(),
                                max_model_len=48, num_kv_blocks=64, max_num_seqs=16), model_name="tiny")
    yield s
    s.close()


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


@pytest.fixture(scope="module")
def seen():
    statuses: collections.Counter = collections.Counter()
    yield statuses
    print(f"\nfuzz: {sum(statuses.values())} cases, statuses {dict(sorted(statuses.items()))}")


MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("route", ROUTES)
def test_fuzzed_bodies_get_documented_answers_and_never_a_5xx(server, schema, seen, route, mode):
    fuzz(server, schema[route]["POST"], seen, mode, EXAMPLES, derandomize=True)   # the same cases every run


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("route", ROUTES)
def test_longer_fuzz_with_fresh_cases(server, schema, seen, route, mode):
    fuzz(server, schema[route]["POST"], seen, mode, SLOW_EXAMPLES, derandomize=False)


def fuzz(server, op, seen, mode: GenerationMode, examples: int, derandomize: bool) -> None:
    route = op.path

    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode), splice=st.none() | st.sampled_from(SPLICES),
           foreign_model=st.integers(0, 3).map(lambda i: i == 3))
    def run(case, splice, foreign_model):
        _bound(case.body)
        if mode.is_positive:
            if not foreign_model:           # past the model check, so that the engine runs it
                case.body["model"] = server.model
            if isinstance(case.body.get("prompt"), list):   # a batch of prompts (or ids): the first few
                case.body["prompt"] = case.body["prompt"][:MAX_N]
        spliced = mode.is_positive and splice is not None and _splice(case.body, splice)
        response = case.call(base_url=server.url, timeout=300)
        seen[(route, mode.value, response.status_code)] += 1
        case.validate_response(response, checks=CHECKS)
        if spliced and splice != "\x00":
            assert response.status_code == 400 and "surrogate" in response.json()["error"]["message"]

    run()
    server.wait_idle()


def _bound(body) -> None:
    """Shorten in-range lengths and counts; a value outside the schema is left as it is."""
    if not isinstance(body, dict):
        return
    for key, cap in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS),
                     ("max_output_tokens", MAX_TOKENS), ("n", MAX_N)):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            body[key] = min(v, cap)


def _splice(body, text: str) -> bool:
    """Put `text` into the body's first message or string prompt; True if there was one."""
    if not isinstance(body, dict):
        return False
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict) \
            and isinstance(messages[0].get("content"), str):
        messages[0]["content"] += text
        return True
    for key in ("prompt", "input"):      # a completion's prompt, a response's text input
        if isinstance(body.get(key), str):
            body[key] = text + body[key]
            return True
    return False

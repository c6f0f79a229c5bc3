"""Grammar compilation limits (verifier/sampling/grammar_limits.py, verifier/sampling/grammar_worker.py): size and
depth refused before compiling, a time limit and cancellation that stop the compile (in a
child process), caches bounded, and grammars with no output refused. Each fails without its
limit; the worker's grammars give the same masks as an in-process compile."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from verifier.model.tokenizer import Tokenizer
from verifier.sampling.grammar import GrammarBackend
from verifier.sampling.grammar_limits import GrammarCancelled, GrammarLimits, GrammarTimeout
from verifier.sampling.structured import StructuredOutputs


def nested(depth: int) -> str:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer(smollm2_dir)


def backend(tokenizer, **limits) -> GrammarBackend:
    return GrammarBackend(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id], GrammarLimits(**limits))


@pytest.fixture(scope="module")
def isolated(tokenizer):
    """One worker for the module's slow cases (its start loads xgrammar and the vocabulary)."""
    b = backend(tokenizer, timeout_s=0.5, max_depth=1000)
    b.compile(StructuredOutputs(regex="warm"))      # the worker is up: timings below exclude its start
    yield b
    b.close()


def test_a_deep_schema_and_a_large_one_are_refused_before_compiling(tokenizer, monkeypatch):
    """200 levels of arrays and a 100 KB pattern: ValueErrors naming the limit, no compile."""
    b = backend(tokenizer)
    monkeypatch.setattr(b, "_xgr_compiler", lambda: pytest.fail("compiled"))
    with pytest.raises(ValueError, match="201 levels deep.*--max-grammar-depth"):
        b.compile(StructuredOutputs(json=nested(200)))
    with pytest.raises(ValueError, match="--max-grammar-bytes"):
        b.compile(StructuredOutputs(regex="a" * 100_000))
    with pytest.raises(ValueError, match="groups 40 levels"):
        b.compile(StructuredOutputs(regex="(" * 40 + "a" + ")" * 40))


def test_grammars_with_no_output_are_refused(tokenizer):
    """An empty language once reached a step with nothing to sample; now it is a ValueError."""
    b = backend(tokenizer)
    for spec in (StructuredOutputs(regex="[^\\s\\S]"), StructuredOutputs(grammar="root ::= root")):
        with pytest.raises(ValueError, match="no output|invalid"):
            b.compile(spec)
    assert b.compile(StructuredOutputs(regex="[a-z]+")) is not None


def test_a_slow_compile_is_stopped_and_the_next_one_works(isolated):
    """Past timeout_s the child is killed (GrammarTimeout); the next compile starts a new one."""
    start = time.monotonic()
    with pytest.raises(GrammarTimeout, match="--grammar-timeout"):
        isolated.compile(StructuredOutputs(json=nested(300)))
    assert time.monotonic() - start < 5
    assert isolated.compile(StructuredOutputs(regex="yes|no")) is not None


def test_a_compile_whose_client_left_is_cancelled(tokenizer):
    """Setting the event stops a compile under way within a fraction of a second."""
    b = backend(tokenizer, timeout_s=60.0, max_depth=1000)
    try:
        b.compile(StructuredOutputs(regex="warm"))           # the worker is up
        cancel = threading.Event()
        threading.Timer(0.3, cancel.set).start()
        start = time.monotonic()
        with pytest.raises(GrammarCancelled):
            b.compile(StructuredOutputs(json=nested(300)), cancel)
        assert time.monotonic() - start < 3
    finally:
        b.close()


def test_the_worker_gives_the_masks_of_an_in_process_compile(tokenizer, isolated):
    """Serialized through the child and back, a grammar allows exactly the same tokens."""
    spec = StructuredOutputs(json=json.dumps({"type": "object", "properties": {"name": {"type": "string"}},
                                              "required": ["name"]}))
    here = backend(tokenizer).matcher(spec)
    there = isolated.matcher(spec)
    for token in [None] + tokenizer.encode('{"name": "Ada"}', add_special_tokens=False):
        if token is not None:
            assert here.accept(token) and there.accept(token)
        assert torch.equal(here.mask(), there.mask())


def test_compiled_grammars_are_an_lru_bounded_by_size(tokenizer):
    """With room for about one grammar, the cache never holds more than that; the newest stays."""
    b = backend(tokenizer)
    first = b.compile(StructuredOutputs(regex="a+"))
    b2 = backend(tokenizer, cache_bytes=first.memory_size_bytes // 2)
    for pattern in ("a+", "b+", "c+", "d+"):
        b2.compile(StructuredOutputs(regex=pattern))
    assert b2.cached == 1 and b2._cached(StructuredOutputs(regex="d+").key) is not None

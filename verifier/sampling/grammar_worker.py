"""Grammar compilation in a child process, so that a compile can be stopped.

xgrammar's compile cannot be interrupted in its thread. `GrammarWorker` keeps one child
process (spawned: the parent runs OpenMP and torch threads, which fork would copy half-made)
that compiles a constraint and sends the result back serialized; past the time limit, or when
the client leaves, the child is killed and the next compile starts a new one. One compile at a
time: a cache hit never comes here.
"""
from __future__ import annotations

import json
import multiprocessing
import re
import threading
import time

from verifier.sampling.grammar_limits import GrammarCancelled, GrammarTimeout
from verifier.sampling.structured import StructuredOutputs

# JSON from a schema or json_object: no free whitespace between tokens. A small model let
# loose on "any whitespace" can emit newlines until max_tokens (vLLM's `disable-any-whitespace`
# exists for that), and fixed separators make keys and punctuation forced, which
# jump-forward then emits without sampling.
JSON_SEPARATORS = (", ", ": ")
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")     # "[11:07:15] /project/cpp/x.cc:94: "
_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
          "choice": "choice", "grammar": "grammar", "structural_tag": "structural tag"}
START_S = 120.0      # a child that has not loaded xgrammar by then is broken


def load_xgrammar():
    """The xgrammar module, imported on the first constrained request (here and in grammar.py)."""
    import xgrammar  # lazy: ~0.5 s (with transformers) on top of the serving imports; constraints only
    return xgrammar


def compile_spec(compiler, spec: StructuredOutputs):
    """spec compiled by an xgrammar GrammarCompiler; ValueError naming what is wrong with it."""
    kind, text = spec.key
    try:
        if kind == "json":
            return compiler.compile_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                separators=JSON_SEPARATORS)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            return compiler.compile_regex("|".join(re.escape(c) for c in spec.choice))
        if kind == "structural_tag":
            return compiler.compile_structural_tag(compact_json_contents(text))
        return compiler.compile_grammar(text)
    except (RuntimeError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"invalid {_NAMES[kind]}: {_XGR_PREFIX.sub('', first)}") from None


def compact_json_contents(tag_text: str) -> str:
    """A structural tag whose JSON Schema contents are written as every other JSON output is
    (JSON_SEPARATORS, no free whitespace): xgrammar's tag format has no such option, so each
    becomes the EBNF of its schema. Done here, where a compile can be timed out."""
    xgr = load_xgrammar()

    def walk(node):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and node.get("style", "json") == "json":
            schema = node["json_schema"]
            grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                   separators=JSON_SEPARATORS)
            return {"type": "grammar", "grammar": str(grammar)}
        return {k: walk(v) for k, v in node.items()}

    try:
        tag = json.loads(tag_text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    return json.dumps(walk(tag))


def _serve(conn, info_json: str, cache_bytes: int) -> None:
    """The child: load the vocabulary once, then compile what the parent sends, one at a time."""
    xgr = load_xgrammar()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1,
                                   cache_limit_bytes=cache_bytes)
    conn.send("ready")
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, compile_spec(compiler, spec).serialize_json()))
        except ValueError as e:
            conn.send((False, str(e)))


class GrammarWorker:
    def __init__(self, tokenizer_info, cache_bytes: int):
        self._info, self._cache_bytes = tokenizer_info, cache_bytes
        self._lock = threading.Lock()
        self._proc = self._conn = None

    def compile(self, spec: StructuredOutputs, timeout_s: float, cancel: threading.Event | None):
        """The CompiledGrammar of spec; GrammarTimeout / GrammarCancelled after killing the child."""
        xgr = load_xgrammar()
        self._acquire(cancel)
        try:
            conn = self._ready()
            conn.send(spec)
            ok, payload = self._wait(conn, time.monotonic() + timeout_s, cancel, timeout_s)
        finally:
            self._lock.release()
        if not ok:
            raise ValueError(payload)
        return xgr.CompiledGrammar.deserialize_json(payload, self._info)

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _acquire(self, cancel: threading.Event | None) -> None:
        while not self._lock.acquire(timeout=0.05):      # another compile runs: wait, still cancellable
            if cancel is not None and cancel.is_set():
                raise GrammarCancelled("the request was cancelled while its grammar waited to compile")

    def _ready(self):
        if self._proc is None or not self._proc.is_alive():
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe()
            self._proc = ctx.Process(target=_serve, args=(child, self._info.serialize_json(), self._cache_bytes),
                                     name="tercel-grammar", daemon=True)
            self._proc.start()
            child.close()
            self._conn = parent
            if not parent.poll(START_S) or parent.recv() != "ready":
                self._kill()
                raise RuntimeError("the grammar compiler process did not start")
        return self._conn

    def _wait(self, conn, deadline: float, cancel: threading.Event | None, timeout_s: float):
        while not conn.poll(0.02):
            if cancel is not None and cancel.is_set():
                self._kill()
                raise GrammarCancelled("the request was cancelled while its grammar compiled")
            if time.monotonic() > deadline:
                self._kill()
                raise GrammarTimeout(f"the grammar took more than this server's limit of {timeout_s:g} s to "
                                     "compile (--grammar-timeout)")
        try:
            return conn.recv()
        except EOFError:          # the child crashed on this grammar: it alone fails
            self._kill()
            raise RuntimeError("the grammar compiler process died while compiling this grammar") from None

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

"""Grammar-constrained decoding through xgrammar (as vLLM and SGLang do).

`GrammarBackend` compiles a request's `StructuredOutputs` against the model's vocabulary,
once per distinct constraint (cached), and hands each request a `Matcher`: the grammar's
state after the tokens the request has emitted. A matcher gives the token bitmask of its
state (one row), of every node of a draft tree (a row per node: the state after that
node's path), and the tokens the grammar forces next (jump-forward).

Bitmasks are xgrammar's: int32 [rows, ceil(V / 32)], bit j of word i allows token 32 i + j.
`apply_bitmask` sets disallowed logits to -inf in place, in fp32 on the logits' device,
before penalties, temperature and truncation: softmax then renormalises over the allowed
tokens, so what is sampled is the target's masked, renormalised distribution.

xgrammar (and the transformers import it brings) loads on the first constrained request.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from verifier.cpu import cpu_ops
from verifier.sampling.grammar_limits import GrammarLimits
from verifier.sampling.grammar_worker import GrammarWorker, compile_spec, load_xgrammar
from verifier.sampling.structured import StructuredOutputs

_SHIFTS = torch.arange(32, dtype=torch.int32)
_BIT = np.arange(32, dtype=np.uint32)
# A row that allows at most 1/FEW_SHARE of the vocabulary gets logits at those tokens alone: the
# exact rescoring costs about (allowed tokens) x (hidden) int8 products against the scan's
# vocabulary x hidden int4 ones, far below it at 1/64 whatever the machine.
FEW_SHARE = 64


class GrammarBackend:
    """One model's grammar compiler; safe to call from any thread (the server's handlers
    compile before a request is queued, so a bad schema is a 400 and not a failed stream).
    Compiled grammars are kept in an LRU bounded by their size (`GrammarLimits.cache_bytes`);
    with `limits.timeout_s` the compiles run in a child process that is killed past it."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], limits: GrammarLimits | None = None):
        self._tokenizer, self.vocab_size, self._stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self.limits = limits or GrammarLimits()
        self._lock = threading.Lock()
        self._compiler = self._worker = None
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cached_bytes = 0

    def compile(self, spec: StructuredOutputs, cancel: threading.Event | None = None):
        """The compiled grammar of `spec`; ValueError naming what is wrong with it (too large,
        too deep, too slow, cancelled, invalid, or a language with no output at all)."""
        hit = self._cached(spec.key)
        if hit is not None:
            return hit
        self.limits.check(spec)
        if self.limits.timeout_s is None:
            compiled = compile_spec(self._xgr_compiler(), spec)
        else:
            compiled = self._xgr_worker().compile(spec, self.limits.timeout_s, cancel)
        self._check_not_empty(compiled)
        return self._store(spec.key, compiled)

    def _cached(self, key):
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
            return hit

    def _store(self, key, compiled):
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
            self._compiled[key] = compiled
            self._cached_bytes += compiled.memory_size_bytes
            while self._cached_bytes > self.limits.cache_bytes and len(self._compiled) > 1:
                _, old = self._compiled.popitem(last=False)
                self._cached_bytes -= old.memory_size_bytes
            return compiled

    @property
    def cached(self) -> int:
        """Compiled grammars held now."""
        return len(self._compiled)

    def _check_not_empty(self, compiled) -> None:
        """A grammar whose first mask allows no token and that is not complete has no output:
        refused here, it would otherwise reach a step with nothing to sample."""
        xgr = load_xgrammar()
        matcher = xgr.GrammarMatcher(compiled)
        mask = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        matcher.fill_next_token_bitmask(mask)
        if not mask.any() and not matcher.is_completed():
            raise ValueError("the constraint allows no output: its language is empty")

    def matcher_of(self, compiled) -> Matcher:
        """A fresh matcher of an already compiled grammar (the server compiles before queueing)."""
        xgr = load_xgrammar()
        return Matcher(xgr.GrammarMatcher(compiled), self.vocab_size, self._stop_ids)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        return self.matcher_of(self.compile(spec))

    def _xgr_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = load_xgrammar()
                self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=1,
                                                     cache_limit_bytes=self.limits.xgrammar_cache_bytes)
            return self._compiler

    def _xgr_worker(self) -> GrammarWorker:
        with self._lock:
            if self._worker is None:
                self._worker = GrammarWorker(self._tokenizer_info(), self.limits.xgrammar_cache_bytes)
            return self._worker

    def _tokenizer_info(self):
        xgr = load_xgrammar()
        if getattr(self._tokenizer, "vocab", None) is None:
            raise ValueError("this model has no tokenizer files; structured outputs need its vocabulary")
        vocab = [""] * self.vocab_size
        for text, i in self._tokenizer.vocab.items():
            if i < self.vocab_size:
                vocab[i] = text
        # Special tokens other than the stop tokens are never text: xgrammar leaves tokens
        # that spell nothing out of every mask.
        for i in set(self._tokenizer.special_token_ids) - set(self._stop_ids):
            if i < self.vocab_size:
                vocab[i] = ""
        encoding, prefix_space = self._tokenizer.vocab_encoding()
        kind = {"byte_level": xgr.VocabType.BYTE_LEVEL, "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
                "raw": xgr.VocabType.RAW}[encoding]
        return xgr.TokenizerInfo(vocab, kind, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids,
                                 add_prefix_space=prefix_space)


class Matcher:
    """A request's grammar state. The engine advances it by the tokens it emits, and only
    by those; masks of draft trees walk their paths and leave the state as it was."""

    def __init__(self, matcher, vocab_size: int, stop_ids: list[int]):
        """`stop_ids`: the tokens that end the grammar (after one, nothing may follow)."""
        self._m = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.stop_ids = frozenset(stop_ids)

    def accept(self, token: int) -> bool:
        return self._m.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The stop token was accepted: nothing may follow."""
        return self._m.is_terminated()

    def mask(self) -> torch.Tensor:
        """int32 [1, W]: the tokens allowed next."""
        out = torch.zeros(1, self.words, dtype=torch.int32)
        self._m.fill_next_token_bitmask(out)
        return out

    def tree_masks(self, tree) -> torch.Tensor:
        """int32 [nodes, W] for a `tree.TokenTree` (verifier/ imports no tree/: any object with
        its `tokens` and `children`): row u allows what may follow the path to node u (the
        root: the current state). A node whose path leaves the grammar gets a zero row, and so
        do its descendants (`spec.constraints.kept_nodes`)."""
        n = tree.num_nodes
        first_child = [kids[0] if kids else -1 for kids in tree.children]
        next_sibling = [-1] * n
        for kids in tree.children:
            for a, b in zip(kids, kids[1:]):
                next_sibling[a] = b
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        out = torch.zeros(n, self.words, dtype=torch.int32)
        self._m.traverse_draft_tree(i64(first_child), i64(next_sibling), i64(tree.tokens), out)
        return out

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens that spell what the grammar forces next (none if it forces
        nothing). At the end of a grammar that only the stop token may follow, that token."""
        if limit < 1:
            return []
        tokens = self._m.find_jump_forward_tokens()[:limit]
        if tokens or not self._m.is_completed() or self._m.is_terminated():
            return tokens
        allowed = allowed_tokens(self.mask(), self.vocab_size)[0].nonzero().flatten()
        return allowed.tolist() if allowed.numel() == 1 else []


def few_allowed(masks: torch.Tensor, rows: list[int], vocab_size: int) -> tuple | None:
    """Per mask row in `rows`: the int64 ids it allows where they are at most vocab_size /
    FEW_SHARE, else None; None where no row has so few. Such a row's masked distribution needs
    logits at those tokens alone: the target computes them exactly and skips the scan of the
    whole vocabulary (`verifier.quantized.qlinear.RescoredHead`). The choice depends on the row's mask
    only, so a token gets the same logits as a decode step, a chain node or a tree node."""
    if not rows:
        return None
    m = masks.numpy().view(np.uint32)
    counts = np.bitwise_count(m[rows]).sum(1)
    limit = vocab_size // FEW_SHARE
    if not (counts <= limit).any():
        return None
    out = []
    for r, c in zip(rows, counts):
        if c > limit:
            out.append(None)
            continue
        words = np.flatnonzero(m[r])
        bits = (m[r][words][:, None] >> _BIT) & 1            # [words, 32]
        out.append(torch.from_numpy((words[:, None] * 32 + _BIT)[bits.astype(bool)].astype(np.int64)))
    return tuple(out)


def sole_tokens(masks: torch.Tensor) -> list[int]:
    """int32 [N, W] bitmasks (on the CPU, where xgrammar fills them) -> per row, the one token
    it allows, or -1 (none, or several). Where a row allows one token, the target's masked
    distribution there is that token with probability 1 whatever the logits: the engine then
    computes no logits for the row. Row by row in numpy: cheaper here than torch ops, whose
    fixed cost per call outweighs a few rows' work."""
    out = []
    for row in masks.numpy():
        words = np.flatnonzero(row)
        bits = int(row[words[0]]) & 0xFFFFFFFF if len(words) == 1 else 0
        out.append(int(words[0]) * 32 + bits.bit_length() - 1 if bits and not bits & (bits - 1) else -1)
    return out


def allows(masks: torch.Tensor, row: int, token: int) -> bool:
    """Bit `token` of mask row `row`."""
    return bool((int(masks[row, token >> 5]) >> (token & 31)) & 1)


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [N, W] bitmasks -> bool [N, V]."""
    bits = (masks.unsqueeze(-1) >> _SHIFTS.to(masks.device)) & 1
    return bits.view(masks.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """logits fp32 [N, V] (a row per mask row): disallowed entries -> -inf, in place. On the
    CPU one C call (`cpu_ops.apply_bitmask`: one pass, where torch needs several ops), elsewhere torch."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous() \
            and cpu_ops.available():
        cpu_ops.apply_bitmask(logits, masks.contiguous())
        return
    allowed = allowed_tokens(masks.to(logits.device), logits.shape[-1])
    with torch.inference_mode():        # the forward's logits are inference tensors
        logits.masked_fill_(~allowed, float("-inf"))

"""Datastore drafter: prompt lookup first, then a tree of what usually follows in a corpus.

Retrieval-based drafting in the manner of REST (He et al., 2023): besides the request's
own context, the drafter looks the last tokens up in a datastore built from assistant
replies (conversation files in the common schema, e.g. `../shared/data/train`). The
datastore is a back-off n-gram table: for every context of 1 to `max_n` tokens seen at
least `min_count` times, the `fanout` tokens that most often followed it and their shares.

Each step, per request:
1. the context's own match of at least `strong_n` tokens (a repeated passage) proposes
   what followed it, as the n-gram drafter does;
2. otherwise a best-first tree over the datastore (`tree.builders.best_first_scored`): a
   node's candidates are the followers of its path's longest known suffix, a path's
   probability is the product of their shares, and the request's node budget keeps the most
   probable nodes. The n-gram drafter's guess (its weak match or unigram) joins the first
   tokens at `guess_prob`, so with an unknown context it is the whole proposal.

Chosen by replaying the target's greedy replies to 40 MT-bench first turns against the
measured verify-time curve, with `../shared/data/train` as the datastore (2.7M tokens).
The best-first tree of 5 nodes, up to 4 children each and 3 deep, predicted the largest
speedup, ahead of datastore chains (the top follower only, up to 3 tokens), which were
ahead of the n-gram drafter alone. The budget is set by the verify cost: a forward over 4
to 6 tokens costs about the same on these CPUs and 7 costs more. Around a tree of 3
children per node and 4 levels, other budgets and 2 or 4 children predicted no more than
the tree chosen; expanding whole layers as EAGLE-2 does predicted slightly less than
growing the tree best-first, and `max_n` 4 to 8, `min_count` 1 to 3 and `guess_prob` 0.1
to 0.3 barely moved the prediction. Served (`tercel bench serve`, concurrency 1), the tree
beat plain decoding and the chains. Figures and commands: docs/performance.md, "Drafters
and tree shapes".
Proposals are deterministic, so acceptance treats them as point masses and the output
is exactly the target's.

The table is built once per corpus and tokenizer and cached under `TERCEL_CACHE`.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from drafters.base import DraftRequest, Proposal
from drafters.config import SpecConfig
from drafters.conversations import expand_paths, load_conversations
from drafters.ngram import NgramConfig, NgramDrafter, NgramIndex
from drafters.registry import register_drafter
from tree.builders import best_first_scored
from verifier.cpu.cache import cache_root

log = logging.getLogger(__name__)

_P = 0x9E3779B97F4A7C15          # odd 64-bit multiplier of the n-gram hash
_MASK = (1 << 64) - 1
_SEP = -1                         # between sequences in the concatenated corpus


@dataclass(frozen=True)
class DatastoreConfig:
    max_n: int = 5            # longest context looked up in the table
    min_count: int = 2        # contexts seen fewer times are dropped (mostly one-off noise)
    fanout: int = 4           # followers kept per context: the most children a tree node gets
    max_depth: int = 3        # deepest datastore node (context matches go to the request's γ)
    guess_prob: float = 0.2   # how the n-gram guess ranks among the datastore's first tokens
    strong_n: int = 2         # a context match this long beats the datastore

    def __post_init__(self):
        if min(self.max_n, self.min_count, self.fanout, self.max_depth, self.strong_n) < 1:
            raise ValueError("DatastoreConfig: max_n, min_count, fanout, max_depth and strong_n must be >= 1")
        if not 0 <= self.guess_prob <= 1:
            raise ValueError(f"DatastoreConfig: guess_prob must be in [0, 1], got {self.guess_prob}")


class NgramTable:
    """Per context length n, sorted 64-bit context hashes with their top followers and their
    shares. A hash collision can only make a worse proposal, never a wrong output."""

    def __init__(self, keys: list[np.ndarray], nexts: list[np.ndarray], probs: list[np.ndarray]):
        # Index n - 1: keys [C] uint64; nexts [C, fanout] int32 and probs [C, fanout] float32,
        # most frequent first, padded with -1 and 0 where a context has fewer followers.
        self.keys, self.nexts, self.probs = keys, nexts, probs
        self.max_n = len(keys)
        self._powers = [pow(_P, k, 1 << 64) for k in range(self.max_n)]

    @property
    def num_contexts(self) -> int:
        return sum(len(k) for k in self.keys)

    @classmethod
    def build(cls, seqs: list[list[int]], max_n: int, min_count: int, fanout: int = 1) -> "NgramTable":
        tokens = np.full(sum(len(s) + 1 for s in seqs) + 1, _SEP, dtype=np.int64)
        pos = 1
        for s in seqs:
            tokens[pos:pos + len(s)] = s
            pos += len(s) + 1
        keys, nexts, probs = [], [], []
        h = np.zeros(len(tokens), dtype=np.uint64)       # h[i]: hash of tokens[i-n:i]
        valid = tokens != _SEP                            # the follower tokens[i] is real
        for n in range(1, max_n + 1):
            prev = np.full_like(tokens, _SEP)                # prev[i] = tokens[i - n]
            prev[n:] = tokens[:-n]
            valid &= prev != _SEP
            h += (prev + 1).astype(np.uint64) * np.uint64(pow(_P, n - 1, 1 << 64))
            k, t, p = _top_followers(h[valid], tokens[valid], min_count, fanout)
            keys.append(k)
            nexts.append(t)
            probs.append(p)
        return cls(keys, nexts, probs)

    def save(self, path: Path) -> None:
        arrays = {f"{name}{n}": a for n in range(self.max_n)
                  for name, a in (("k", self.keys[n]), ("t", self.nexts[n]), ("p", self.probs[n]))}
        np.savez(path, **arrays)

    @classmethod
    def load(cls, path: Path) -> "NgramTable":
        with np.load(path) as z:
            m = len([f for f in z.files if f.startswith("k")])
            return cls(*([z[f"{name}{n}"] for n in range(m)] for name in "ktp"))

    def followers(self, context: list[int]) -> list[tuple[int, float]]:
        """[(token, share)] most frequent first, after the longest suffix of `context` in the
        table; [] when no suffix is known."""
        hashes, h = [], 0
        for n in range(1, min(self.max_n, len(context)) + 1):
            h = (h + (context[-n] + 1) * self._powers[n - 1]) & _MASK
            hashes.append(h)
        for n in range(len(hashes), 0, -1):
            keys, key = self.keys[n - 1], np.uint64(hashes[n - 1])
            i = int(np.searchsorted(keys, key))
            if i < len(keys) and keys[i] == key:
                return [(t, p) for t, p in zip(self.nexts[n - 1][i].tolist(), self.probs[n - 1][i].tolist())
                        if t >= 0]
        return []


def _top_followers(h: np.ndarray, t: np.ndarray, min_count: int, fanout: int):
    """For each distinct hash seen >= min_count times: (hash, its `fanout` most frequent
    followers [C, fanout], their shares [C, fanout]), sorted by hash; ties go to the smaller
    token id; missing followers are -1 with share 0."""
    order = np.lexsort((t, h))
    h, t = h[order], t[order]
    new_pair = np.ones(len(h), dtype=bool)
    new_pair[1:] = (h[1:] != h[:-1]) | (t[1:] != t[:-1])
    starts = np.flatnonzero(new_pair)
    counts = np.diff(np.append(starts, len(h)))
    ph, pt = h[starts], t[starts]
    # Within each hash, the largest count first (then the smaller token).
    order = np.lexsort((pt, -counts, ph))
    ph, pt, counts = ph[order], pt[order], counts[order]
    first = np.ones(len(ph), dtype=bool)
    first[1:] = ph[1:] != ph[:-1]
    group = np.flatnonzero(first)
    totals = np.add.reduceat(counts, group) if len(group) else counts[:0]
    member = np.cumsum(first) - 1                     # each (hash, token) pair's group
    rank = np.arange(len(ph)) - group[member]         # 0: the group's most frequent follower
    keep = (totals[member] >= min_count) & (rank < fanout)
    row = np.cumsum(totals >= min_count) - 1          # output row of each kept group
    nexts = np.full((int((totals >= min_count).sum()), fanout), -1, dtype=np.int32)
    probs = np.zeros(nexts.shape, dtype=np.float32)
    r, c = row[member[keep]], rank[keep]
    nexts[r, c] = pt[keep]
    probs[r, c] = counts[keep] / totals[member[keep]]
    return ph[group[totals >= min_count]], nexts, probs


class DatastoreDrafter(NgramDrafter):
    """The n-gram drafter with a datastore tree between its strong and its weak matches."""
    name = "datastore"

    def __init__(self, table: NgramTable, config: DatastoreConfig = DatastoreConfig(),
                 ngram: NgramConfig = NgramConfig()):
        super().__init__(ngram)
        self.table, self.datastore = table, config

    def _proposal(self, index: NgramIndex, req: DraftRequest, match: tuple[int, list[int]] | None = None) -> Proposal:
        """A strong match's continuation (scored as the n-gram drafter scores it), else the
        datastore's best-first tree (each node scored by its path probability)."""
        match = index.longest_match(req.token_ids) if match is None else match
        if match[0] >= self.datastore.strong_n:
            return super()._proposal(index, req, match)
        guesses = index.continuations(req.token_ids, 1, match)     # weak match or unigram
        guess = guesses[0][0] if guesses else None
        context = req.token_ids[-self.table.max_n:]

        def candidates(path: list[int]) -> list[tuple[int, float]]:
            found = self.table.followers(context + path)
            if not path and guess is not None and all(t != guess for t, _ in found):
                found = sorted(found + [(guess, self.datastore.guess_prob)], key=lambda c: -c[1])
            return found

        depth = min(self.datastore.max_depth, req.max_depth)
        tree, probs = best_first_scored(req.token_ids[-1], candidates, req.max_nodes, depth, req.topk)
        return Proposal(tree, scores=tuple(probs), score_kind="datastore")


def corpus_sequences(paths: list[str], tokenizer) -> list[list[int]]:
    """Token ids of every assistant turn in the conversation files (the target's side)."""
    convs, report = load_conversations(paths)
    log.info("datastore: %s", report.summary())
    return [tokenizer.encode(m["content"], add_special_tokens=False)
            for c in convs for m in c.messages if m["role"] == "assistant" and m["content"]]


def load_or_build(paths: list[str], tokenizer, config: DatastoreConfig, cache_dir: Path) -> NgramTable:
    """The table for these files, from the cache when the files, tokenizer and sizes match."""
    files = expand_paths(paths)
    ident = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    vocab = sorted(tokenizer.vocab.items())
    shape = (config.max_n, config.min_count, config.fanout)
    key = hashlib.sha256(repr((ident, vocab, shape)).encode()).hexdigest()[:16]
    path = cache_dir / f"datastore-{key}.npz"
    if path.exists():
        return NgramTable.load(path)
    table = NgramTable.build(corpus_sequences([str(f) for f in files], tokenizer), *shape)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    table.save(tmp)
    tmp.rename(path)     # atomic: a half-written table is never picked up
    log.info("datastore: %d contexts from %d file(s), cached at %s", table.num_contexts, len(files), path)
    return table


def _default_tree():
    # 5 draft nodes: a verify forward of 4 to 6 tokens costs about the same on these CPUs,
    # little more than one of 1 token (figures: docs/performance.md, "Drafters and tree shapes").
    return SpecConfig(num_speculative_tokens=4, topk=4, budget=5)


@register_drafter("datastore", default_speculation=_default_tree())
def _build(arg: str, target, speculation) -> DatastoreDrafter:
    """"datastore:PATH[,PATH...]": conversation .jsonl files or directories of them."""
    if not arg:
        raise ValueError("the datastore drafter needs conversation files: 'datastore:PATH[,PATH...]'")
    config = DatastoreConfig()
    table = load_or_build(arg.split(","), target.tokenizer, config, cache_root() / "datastores")
    return DatastoreDrafter(table, config, NgramConfig(max_branches=speculation.topk))

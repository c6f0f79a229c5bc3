"""Prefix affinity, in plain Python: which replica already holds a prompt's prefix, and when
load outweighs it. serving/cluster/prefix_router.py plugs this into Ray Serve's RequestRouter; nothing
here imports Ray, so the policy is unit-tested without a cluster.

The prefix key is text, not tokens: the ingress has no tokenizer. `prefix_text` renders a chat
request the way a chat template lays it out (each message's role, then its content, in order),
so two requests share a key prefix exactly when their templated prompts share a prefix, up to
the template's fixed markup. The key is cut into chunks of `chunk_chars` characters (64, about
the 16 tokens of one KV block) and each chunk is hashed with the hash of everything before it:
chunk i's hash names the whole prefix up to and including chunk i, so one set of hashes per
replica is a compressed prefix tree. A replica's match for a request is the number of leading
chunk hashes it holds.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class AffinityConfig:
    chunk_chars: int = 64             # characters per prefix chunk: about one 16-token KV block
    min_match_chunks: int = 1         # below this a prefix is not worth a detour
    imbalance_threshold: int = 4      # prefer the prefix holder unless it runs this many more requests
    max_chunks_per_replica: int = 200_000   # chunk hashes remembered per replica (LRU): ~20 MB

    def __post_init__(self):
        for name in ("chunk_chars", "min_match_chunks", "max_chunks_per_replica"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.imbalance_threshold, int) or self.imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be an integer >= 0, got {self.imbalance_threshold!r}")


def prefix_text(body: dict) -> str:
    """The routing key of an OpenAI request body: the rendered messages of a chat request, the
    first prompt of a completion; "" when it has neither (such a request routes by load)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"<|{m.get('role')}|>\n{_content(m.get('content'))}\n" for m in messages
                       if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return prompt if isinstance(prompt, str) else ""


def _content(content) -> str:
    """A message's text: a string, or the text parts of a list of content parts joined as the
    server joins them (serving/tools/request.py)."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def chunk_hashes(text: str, chunk_chars: int) -> list[bytes]:
    """One hash per full chunk; hash i covers text[: (i + 1) * chunk_chars]. A trailing partial
    chunk is left out, as the engine caches full KV blocks only."""
    out, h = [], b""
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        h = hashlib.blake2b(h + text[start:start + chunk_chars].encode("utf-8", "surrogatepass"),
                            digest_size=12).digest()
        out.append(h)
    return out


@dataclass(frozen=True)
class Candidate:
    """One replica as the policy sees it."""
    replica: str         # the replica's id
    load: int            # requests it runs now (sent by this router, not yet completed)
    matched: int         # leading chunks of the request's prefix it holds
    stored: int          # chunk hashes remembered for it: its share of cached prefixes


@dataclass(frozen=True)
class Choice:
    replica: str
    reason: str          # "prefix" | "overloaded" (the holder was too busy) | "load" (no holder)


def choose(candidates: list[Candidate], cfg: AffinityConfig) -> Choice:
    """The prefix holder (longest match, then least loaded) unless it runs more than
    `imbalance_threshold` requests above the least loaded replica; else the least loaded,
    ties broken by the fewest stored chunks, so unrelated requests spread."""
    if not candidates:
        raise ValueError("choose needs at least one candidate replica")
    least = min(candidates, key=lambda c: (c.load, c.stored, c.replica))
    holders = [c for c in candidates if c.matched >= cfg.min_match_chunks]
    if not holders:
        return Choice(least.replica, "load")
    best = max(holders, key=lambda c: (c.matched, -c.load, -c.stored, c.replica))
    if best.load - least.load > cfg.imbalance_threshold:
        return Choice(least.replica, "overloaded")
    return Choice(best.replica, "prefix")


class PrefixIndex:
    """Per replica, the chunk hashes of the prompts routed to it, least recently used first out."""

    def __init__(self, cfg: AffinityConfig):
        self.cfg = cfg
        self._chunks: dict[str, OrderedDict[bytes, None]] = {}

    def matched(self, replica: str, hashes: list[bytes]) -> int:
        held = self._chunks.get(replica, {})
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    def stored(self, replica: str) -> int:
        return len(self._chunks.get(replica, ()))

    def insert(self, replica: str, hashes: list[bytes]) -> None:
        held = self._chunks.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.cfg.max_chunks_per_replica:
            held.popitem(last=False)

    def remove(self, replica: str) -> None:
        """A replica that died or left: its cache went with it."""
        self._chunks.pop(replica, None)

    def keep_only(self, replicas: set[str]) -> None:
        for r in set(self._chunks) - replicas:
            del self._chunks[r]

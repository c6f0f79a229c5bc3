"""Stored responses: what `previous_response_id` continues and `GET /v1/responses/{id}` returns.

In this server's memory, per process (behind Ray Serve, per replica: an id reaches only the
replica that stored it), lost on restart. Bounded two ways, so that clients storing by default
(OpenAI's `store: true`) cannot grow it without end: at most `max_stored` responses, the oldest
dropped first, each kept `ttl_s` seconds after it was stored. An entry holds its whole
conversation, which fit the context as a prompt, and its reply: at most about one context's
worth of text.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class StoreLimits:
    max_stored: int = 1024      # responses kept (0: none; `store: true` then keeps nothing)
    ttl_s: float = 3600.0       # seconds a response is kept

    def __post_init__(self):
        if self.max_stored < 0:
            raise ValueError(f"max_stored must be >= 0, got {self.max_stored}")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")


@dataclass(frozen=True)
class StoredResponse:
    body: dict                       # the response object, as the create call returned it
    conversation: tuple[dict, ...]   # its input and its output as chat messages, instructions left out


class ResponseStore:
    """Oldest first; one TTL for all, so the oldest entry is always the first to expire.
    A lock, though the routes use it from the event loop only: it costs nothing and keeps it
    sound for any thread."""

    def __init__(self, limits: StoreLimits = StoreLimits(), clock: Callable[[], float] = time.monotonic):
        self.limits, self._clock = limits, clock
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.limits.max_stored == 0:
            return
        with self._lock:
            now = self._clock()
            self._expire(now)
            while len(self._entries) >= self.limits.max_stored:
                self._entries.popitem(last=False)
            self._entries[response_id] = (now + self.limits.ttl_s, entry)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            self._expire(self._clock())
            found = self._entries.get(response_id)
            return None if found is None else found[1]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._expire(self._clock())
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._entries)

    def _expire(self, now: float) -> None:
        while self._entries:
            first = next(iter(self._entries.values()))
            if first[0] > now:
                return
            self._entries.popitem(last=False)

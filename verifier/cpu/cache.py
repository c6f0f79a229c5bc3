"""Where Tercel keeps what it builds and measures per machine: compiled kernels, timings,
converted checkpoints, datastores ($TERCEL_CACHE, else ~/.cache/tercel)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("TERCEL_CACHE", Path.home() / ".cache" / "tercel"))

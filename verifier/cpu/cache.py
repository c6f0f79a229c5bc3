"""Where Tercel keeps what it builds and measures per machine: compiled kernels, timings,
converted checkpoints, datastores ($TERCEL_CACHE, else ~/.cache/tercel)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    return Path(os.environ.get("TERCEL_CACHE", Path.home() / ".cache" / "tercel"))


def build_once(out: Path, build: Callable[[Path], None]) -> Path:
    """`out`, built by `build(tmp)` into a temporary sibling folder and renamed into place: a
    half-built folder is never picked up, and a failed build leaves nothing behind. Where another
    process put its build in place first, that one is kept: a folder is only ever renamed in whole,
    and removing it could pull files from under that process's load."""
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build(tmp)
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not out.is_dir():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

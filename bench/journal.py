"""The `--json` report, rewritten (atomically) after every finished unit, so an interrupted
run keeps what it measured; `--resume` reads it back and skips those units."""
from __future__ import annotations

import json
import os
from pathlib import Path


class Journal:
    def __init__(self, path: str | None, command: str, settings: dict, resume: bool):
        self.path = Path(path) if path else None
        # Round-tripped so tuples compare equal to the lists a resumed report holds.
        self.command, self.settings = command, json.loads(json.dumps(settings))
        self.results: list[dict] = []
        self.summary: dict = {}
        if resume:
            self._load()

    @property
    def done(self) -> set[str]:
        return {r["key"] for r in self.results}

    def add(self, result: dict) -> None:
        self.results.append(result)
        self.save()

    def save(self, summary: dict | None = None) -> None:
        if summary is not None:
            self.summary = summary
        if self.path is None:
            return
        body = {"command": self.command, "settings": self.settings, "results": self.results,
                "summary": self.summary}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        os.replace(tmp, self.path)

    def _load(self) -> None:
        if self.path is None:
            raise ValueError("--resume needs --json FILE: the report the interrupted run was writing")
        if not self.path.exists():
            return                                   # nothing finished yet: start from scratch
        try:
            old = json.loads(self.path.read_text())
            results = old["results"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"--resume: cannot read {self.path} as a bench report ({e})") from None
        if old.get("command") != self.command:
            raise ValueError(f"--resume: {self.path} is a `bench {old.get('command')}` report, "
                             f"not `bench {self.command}`")
        changed = sorted(k for k in set(self.settings) | set(old.get("settings", {}))
                         if old.get("settings", {}).get(k) != self.settings.get(k))
        if changed:
            raise ValueError(f"--resume: {self.path} was measured with different {', '.join(changed)}; "
                             "rerun without --resume or use the same settings")
        self.results = list(results)

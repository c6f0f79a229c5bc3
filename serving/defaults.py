"""Sampling defaults from the model's `generation_config.json`, as vLLM applies them: a request
that leaves temperature, top_p, top_k, min_p or repetition_penalty out (or null) gets the
model's value; `tercel serve --generation-config none` keeps the API's own defaults."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from verifier.model.loader import resolve_model_dir
from verifier.sampling.sampling_params import SamplingParams

log = logging.getLogger("tercel.serve")
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FILE = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    values: tuple[tuple[str, float | int], ...] = ()   # (field, value) for the fields the file sets
    source: str = ""                                   # where they came from, for the log

    def apply(self, body):
        """`body` with each field it left out (or sent as null) set to the model's value."""
        missing = {name: value for name, value in self.values if getattr(body, name) is None}
        return body.model_copy(update=missing) if missing else body

    def describe(self) -> str:
        if not self.values:
            return f"no sampling defaults ({self.source or 'none loaded'})"
        return f"sampling defaults from {self.source}: " + ", ".join(f"{k}={v}" for k, v in self.values)


def load_sampling_defaults(setting: str, model: str) -> SamplingDefaults:
    """`setting`: "auto" (the model's folder), "none", or a folder holding a generation_config.json."""
    if setting == "none":
        return SamplingDefaults(source="--generation-config none")
    if setting == "auto":
        folder = resolve_model_dir(model)
    else:
        folder = Path(setting)
        if not (folder / FILE).is_file():
            raise ValueError(f"--generation-config {setting}: no {FILE} there")
    path = folder / FILE
    if not path.is_file():
        return SamplingDefaults(source=f"no {FILE} in {folder}")
    return SamplingDefaults(_read(path), str(path))


def _read(path: Path) -> tuple[tuple[str, float | int], ...]:
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    values = {k: config[k] for k in FIELDS if isinstance(config, dict) and config.get(k) is not None}
    if "top_k" in values:
        values["top_k"] = _whole(values["top_k"])
    try:
        SamplingParams(**values)        # the same ranges as a request's
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return tuple(values.items())


def _whole(top_k):
    """JSON's 50.0 is the integer 50; -1 and 0 both mean off, as in a request; anything else is
    left for SamplingParams to judge."""
    top_k = int(top_k) if isinstance(top_k, float) and top_k.is_integer() else top_k
    return max(0, top_k) if isinstance(top_k, int) and not isinstance(top_k, bool) else top_k

"""Run a list of cells over every task, repeated, interleaved, journaled.

Order: for each repeat, for each task, every cell, the cell order rotated by one per
repeat. So each cell's runs sit next to the plain engine's on the same task (machine
drift hits both) and no configuration always runs first or last.
"""
from __future__ import annotations

import sys
from dataclasses import asdict

from tqdm import tqdm

from bench.data import BenchPrompt
from bench.grid import HF_LOOKUP, LLAMACPP, TERCEL, Cell
from bench.hf import HFGenerator, HFModel
from bench.journal import Journal
from bench.llamacpp import LlamaCppGenerator
from bench.runner import RunSettings, TercelGenerator, run_unit
from spec.llm import chat_token_ids
from verifier.cpu.machine import default_threads
from verifier.model.loader import resolve_model_dir
from verifier.target import load_tokenizer


def unit_key(task: str, cell: Cell, repeat: int) -> str:
    return f"{task}|{cell.key}|r{repeat}"


def schedule(cells: list[Cell], tasks: list[str], repeats: int) -> list[tuple[int, str, Cell]]:
    out = []
    for r in range(repeats):
        shift = r % len(cells)
        for task in tasks:
            out += [(r, task, c) for c in cells[shift:] + cells[:shift]]
    return out


class Generators:
    """Builds the generator of each cell; the HF model, llama.cpp and the tokenizer load once."""

    def __init__(self, settings: RunSettings):
        self.settings = settings
        self.tokenizer = load_tokenizer(resolve_model_dir(settings.model))
        self._hf = self._llamacpp = None

    def template(self, messages: list[dict]) -> list[int]:
        return chat_token_ids(self.tokenizer, messages)

    def open(self, cell: Cell):
        if cell.engine == TERCEL:
            return TercelGenerator(cell, self.settings)
        if cell.engine == LLAMACPP:
            return self._llama()
        if self._hf is None:
            self._hf = HFModel(self.settings.model)
        lookup = cell.gamma if cell.engine == HF_LOOKUP else None
        return HFGenerator(self._hf, self.tokenizer, self.settings.max_tokens, self.settings.ignore_eos, lookup)


    def _llama(self):
        if self._llamacpp is None:
            s = self.settings
            self._llamacpp = LlamaCppGenerator(s.model, s.max_tokens, s.ignore_eos, default_threads(),
                                               self.tokenizer)
        return self._llamacpp


def run_suite(cells: list[Cell], by_task: dict[str, list[BenchPrompt]], repeats: int,
              settings: RunSettings, journal: Journal) -> None:
    """Measure every (repeat, task, cell) not yet in the journal; each result is journaled
    as soon as it exists."""
    units = schedule(cells, list(by_task), repeats)
    done = journal.done
    todo = [u for u in units if unit_key(u[1], u[2], u[0]) not in done]
    gens = Generators(settings)
    bar = _bar(len(units), len(units) - len(todo))
    try:
        for repeat, task, cell in todo:
            bar.set_postfix_str(f"{task}: {cell.name} {cell.tree} T={cell.temperature:g}", refresh=False)
            gen = gens.open(cell)
            try:
                res = run_unit(gen, gens.template, by_task[task], cell.temperature, settings.seed)
            finally:
                gen.close()
            journal.add({"key": unit_key(task, cell, repeat), "task": task, "repeat": repeat,
                         "cell_key": cell.key, "cell": asdict(cell), **res})
            bar.update()
    finally:
        bar.close()


def _bar(total: int, initial: int):
    return tqdm(total=total, initial=initial, unit="run", desc="bench", file=sys.stderr, dynamic_ncols=True,
                smoothing=0.1)

"""The `tree:` drafter: one verification tree merged from several drafters' proposals (the
tree data structure and `merge_trees` are in tree/).

`tree:small:PATH` expands the small model's top-k children per node (EAGLE-2-style
dynamic tree); `tree:small:PATH+ngram` also merges the n-gram continuation into the same
tree, deduplicating shared prefixes; `tree:eagle3+ngram` does the same with the EAGLE-3
head (`eagle3:PATH` for another head); `tree:suffix+ngram` joins suffix decoding's tree to
the n-gram chain. Every part proposes deterministically, so the
merged tree is verified with point-mass acceptance, which is exact for any such tree.
"""
from __future__ import annotations

import dataclasses

from drafters.base import DraftRequest, Drafter, Proposal
from drafters.ngram import NgramConfig, NgramDrafter
from drafters.registry import register_drafter
from drafters.small import SmallModelDrafter
from drafters.suffix import SuffixConfig, SuffixDrafter
from tree.builders import merge_trees


class TokenTreeDrafter(Drafter):
    name = "tree"

    def __init__(self, parts: list[Drafter]):
        if not parts:
            raise ValueError("the tree drafter needs at least one part, e.g. 'tree:small:PATH+ngram'")
        readers = [p for p in parts if p.capture_layers]
        if len(readers) > 1:
            raise ValueError("at most one part of a tree drafter may read target hidden states")
        self.parts = parts
        self.capture_layers = readers[0].capture_layers if readers else ()

    def prefill(self, chunks) -> None:
        for part in self.parts:
            part.prefill(chunks)

    def observe(self, states) -> None:
        for part in self.parts:
            if part.capture_layers:
                part.observe(states)

    def propose(self, reqs: list[DraftRequest]) -> list[Proposal]:
        # Each part gets an equal share of the node budget; shared prefixes free up room.
        sub = [dataclasses.replace(r, max_nodes=max(1, r.max_nodes // len(self.parts))) for r in reqs]
        per_part = [part.propose(sub) for part in self.parts]
        out = []
        for i, r in enumerate(reqs):
            merged = merge_trees([props[i].tree for props in per_part])
            out.append(Proposal(merged.truncated(r.max_nodes + 1)))
        return out

    def release(self, seq_id: int) -> None:
        for part in self.parts:
            part.release(seq_id)

    def finish(self, seq_id: int, token_ids: list[int], num_prompt: int) -> None:
        for part in self.parts:
            part.finish(seq_id, token_ids, num_prompt)

    def forget_history(self) -> None:
        for part in self.parts:
            part.forget_history()


@register_drafter("tree")
def _build(arg: str, target, speculation) -> TokenTreeDrafter:
    parts: list[Drafter] = []
    for piece in filter(None, arg.split("+")):
        kind, _, sub = piece.partition(":")
        if kind == "small":
            parts.append(SmallModelDrafter(sub, target, speculation, deterministic=True))
        elif kind == "eagle3":
            from drafters.eagle3.drafter import build_eagle3
            parts.append(build_eagle3(sub, target, speculation))
        elif kind == "ngram":
            parts.append(NgramDrafter(NgramConfig()))
        elif kind == "suffix":
            parts.append(SuffixDrafter(SuffixConfig.parse(sub)))
        else:
            raise ValueError(f"unknown tree part {piece!r}: use small:PATH, eagle3[:PATH], ngram and/or "
                             "suffix[:key=value,...], joined by '+'")
    return TokenTreeDrafter(parts)

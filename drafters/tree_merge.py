"""The `tree:` drafter: one verification tree merged from several drafters' proposals (the
tree data structure and `merge_trees` are in tree/).

`tree:small:PATH` expands the small model's top-k children per node (EAGLE-2-style
dynamic tree); `tree:small:PATH+ngram` also merges the n-gram continuation into the same
tree, deduplicating shared prefixes; `tree:eagle3+ngram` does the same with the EAGLE-3
head (`eagle3:PATH` for another head); `tree:suffix+ngram` joins suffix decoding's tree to
the n-gram chain. Every part proposes deterministically, so the
merged tree is verified with point-mass acceptance, which is exact for any such tree.

In its own shape (`tree_shape`, what it runs with when no other is given) each part drafts in the shape it is
tuned for, capped by the request's: `tree:eagle3+suffix` joins the head's depth-2 tree to suffix
decoding's 16 nodes. Given a shape, every part takes its depth and top-k and an equal share of
its nodes.
"""
from __future__ import annotations

import dataclasses

from drafters.base import DraftRequest, Drafter, Proposal
from drafters.config import SpecConfig
from drafters.eagle3.drafter import build_eagle3
from drafters.ngram import NgramConfig, NgramDrafter
from drafters.registry import DEFAULT_SPECULATION, register_drafter
from drafters.small import SmallModelDrafter
from drafters.suffix import SuffixConfig, SuffixDrafter
from tree.builders import merge_trees


class TokenTreeDrafter(Drafter):
    name = "tree"

    def __init__(self, parts: list[Drafter], shapes: list[SpecConfig] | None = None):
        """`shapes`: each part's own shape, capped by the request's; None: each takes the request's
        depth and top-k and an equal share of its nodes."""
        if not parts:
            raise ValueError("the tree drafter needs at least one part, e.g. 'tree:small:PATH+ngram'")
        if shapes is not None and len(shapes) != len(parts):
            raise ValueError(f"{len(shapes)} shapes for {len(parts)} tree parts")
        readers = [p for p in parts if p.capture_layers]
        if len(readers) > 1:
            raise ValueError("at most one part of a tree drafter may read target hidden states")
        self.parts, self.shapes = parts, shapes
        self.capture_layers = readers[0].capture_layers if readers else ()

    def prefill(self, chunks) -> None:
        for part in self.parts:
            part.prefill(chunks)

    def observe(self, states) -> None:
        for part in self.parts:
            if part.capture_layers:
                part.observe(states)

    def propose(self, reqs: list[DraftRequest]) -> list[Proposal]:
        per_part = [part.propose([self._part_request(r, i) for r in reqs]) for i, part in enumerate(self.parts)]
        out = []
        for i, r in enumerate(reqs):
            merged = merge_trees([props[i].tree for props in per_part])
            out.append(Proposal(merged.truncated(r.max_nodes + 1)))
        return out

    def _part_request(self, r: DraftRequest, i: int) -> DraftRequest:
        """Part i's share of a request's tree (shared prefixes free up room in the merge)."""
        if self.shapes is None:
            return dataclasses.replace(r, max_nodes=max(1, r.max_nodes // len(self.parts)))
        own, total = self.shapes[i], sum(s.max_nodes for s in self.shapes)
        return dataclasses.replace(r, max_depth=min(r.max_depth, own.num_speculative_tokens),
                                   topk=min(r.topk, own.topk), max_nodes=max(1, r.max_nodes * own.max_nodes // total))

    def release(self, seq_id: int) -> None:
        for part in self.parts:
            part.release(seq_id)

    def finish(self, seq_id: int, token_ids: list[int], num_prompt: int) -> None:
        for part in self.parts:
            part.finish(seq_id, token_ids, num_prompt)

    def forget_history(self) -> None:
        for part in self.parts:
            part.forget_history()


def _pieces(arg: str) -> list[tuple[str, str]]:
    return [piece.partition(":")[::2] for piece in filter(None, arg.split("+"))]


def _part_shapes(arg: str) -> list[SpecConfig]:
    """Each part's own shape: its kind's default."""
    return [DEFAULT_SPECULATION.get(kind, SpecConfig()) for kind, _ in _pieces(arg)]


def tree_shape(arg: str) -> SpecConfig:
    """A tree drafter's own shape: its parts', the deepest and widest of them, their nodes summed."""
    shapes = _part_shapes(arg) or [SpecConfig()]
    return SpecConfig(num_speculative_tokens=max(s.num_speculative_tokens for s in shapes),
                      topk=max(s.topk for s in shapes), budget=sum(s.max_nodes for s in shapes))


@register_drafter("tree", default_speculation=tree_shape)
def _build(arg: str, target, speculation) -> TokenTreeDrafter:
    parts: list[Drafter] = []
    for kind, sub in _pieces(arg):
        if kind == "small":
            parts.append(SmallModelDrafter(sub, target, speculation, deterministic=True))
        elif kind == "eagle3":
            parts.append(build_eagle3(sub, target, speculation))
        elif kind == "ngram":
            parts.append(NgramDrafter(NgramConfig()))
        elif kind == "suffix":
            parts.append(SuffixDrafter(SuffixConfig.parse(sub)))
        else:
            raise ValueError(f"unknown tree part {kind + ':' + sub if sub else kind!r}: use small:PATH, "
                             "eagle3[:PATH], ngram and/or suffix[:key=value,...], joined by '+'")
    own = speculation is None or speculation == tree_shape(arg)
    return TokenTreeDrafter(parts, _part_shapes(arg) if own else None)

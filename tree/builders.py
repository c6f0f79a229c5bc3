"""Ways to build a TokenTree: merge proposals, static (Medusa-style) shapes, dynamic (EAGLE-2),
best-first (cheap drafters).

Every builder returns nodes in topological order with each node's children ordered most
likely first, which is the order exact multi-candidate acceptance tries them in.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple, Sequence

from tree.token_tree import TokenTree
from verifier.checks import positive_ints

# ----- merging proposals -----------------------------------------------------------------


def merge_trees(trees: Sequence[TokenTree]) -> TokenTree:
    """Union of several proposals for one request (e.g. small model + n-gram) into one tree.

    Shared token prefixes become shared nodes. All trees must have the same root token.
    The first tree's nodes keep their indices and order; each later tree only appends the
    nodes it adds, so under any node the first tree's children come first."""
    if not trees:
        raise ValueError("merge_trees needs at least one tree")
    root = trees[0].tokens[0]
    for k, t in enumerate(trees):
        if t.tokens[0] != root:
            raise ValueError(f"tree {k} has root token {t.tokens[0]}, tree 0 has {root}: "
                             f"merged trees must share their root token")
    tokens, parents = [root], [-1]
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for t in trees:
        where = [0] * t.num_nodes  # node of t -> merged node; parents come first (topological)
        for i in range(1, t.num_nodes):
            key = (where[t.parents[i]], t.tokens[i])
            if key not in index:
                index[key] = len(tokens)
                tokens.append(key[1])
                parents.append(key[0])
            where[i] = index[key]
    return TokenTree(tuple(tokens), tuple(parents))


# ----- static shapes ---------------------------------------------------------------------


@dataclass(frozen=True)
class StaticTreeShape:
    """Medusa-style choice list: each choice is a path of child ranks, e.g. (0,), (1,), (0, 0),
    (0, 1), (1, 0): (1, 0) is the top candidate after the second-best first token.
    Every prefix of a choice must be a choice too. No choices: plain decoding.

    Shape node 0 is the root; nodes 1.. are the choices ordered by depth, then by their order
    in `choices`. `parents`, `ranks` and `depths` are indexed by shape node."""

    choices: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        try:
            choices = tuple(tuple(operator.index(r) for r in c) for c in self.choices)
        except TypeError as e:
            raise ValueError(f"choices must be sequences of int ranks, got {self.choices!r}") from e
        object.__setattr__(self, "choices", choices)
        seen = set()
        for c in choices:
            if not c:
                raise ValueError("a choice must be non-empty (the root is implicit)")
            if any(r < 0 for r in c):
                raise ValueError(f"choice {c} has a negative rank")
            if c in seen:
                raise ValueError(f"choice {c} appears twice")
            seen.add(c)
        for c in choices:
            for k in range(1, len(c)):
                if c[:k] not in seen:
                    raise ValueError(f"choice {c} needs its prefix {c[:k]} as a choice too")

    @cached_property
    def _nodes(self) -> tuple[tuple[int, ...], ...]:
        # sorted() is stable: same-depth choices keep their order in `choices`.
        return ((), *sorted(self.choices, key=len))

    @property
    def num_nodes(self) -> int:
        """Nodes including the root: the most a built tree can have."""
        return len(self.choices) + 1

    @cached_property
    def parents(self) -> tuple[int, ...]:
        where = {c: i for i, c in enumerate(self._nodes)}
        return (-1, *(where[c[:-1]] for c in self._nodes[1:]))

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Per shape node, which candidate of its parent it takes (the root: -1)."""
        return (-1, *(c[-1] for c in self._nodes[1:]))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        return tuple(len(c) for c in self._nodes)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @classmethod
    def chain(cls, gamma: int) -> StaticTreeShape:
        """γ draft tokens, each the drafter's top-1: ((0,), (0, 0), ...)."""
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        return cls(tuple((0,) * d for d in range(1, gamma + 1)))

    @classmethod
    def default_for_budget(cls, budget: int,
                           rank_probs: Sequence[float] = (0.6, 0.2, 0.1, 0.05)) -> StaticTreeShape:
        """The `budget` choices with the highest modeled acceptance probability.

        Model: the rank-r candidate is accepted with probability rank_probs[r], independently
        per level, so a node's value is the product along its path and the expected number of
        accepted tokens is the sum of the values. Values shrink down a path and across ranks
        (rank_probs must not increase), so the top-`budget` set is prefix-closed and greedy
        selection with a heap is optimal for this model. Ties: earlier discovery first."""
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        probs = tuple(float(p) for p in rank_probs)
        if not probs or any(not 0.0 < p <= 1.0 for p in probs):
            raise ValueError(f"rank_probs must be non-empty, each in (0, 1], got {rank_probs!r}")
        if any(a < b for a, b in zip(probs, probs[1:])):
            raise ValueError(f"rank_probs must not increase, got {rank_probs!r}")
        heap = [(-p, r, (r,)) for r, p in enumerate(probs)]  # (-value, discovery, choice)
        heapq.heapify(heap)
        counter = len(heap)
        chosen = []
        while heap and len(chosen) < budget:
            neg, _, c = heapq.heappop(heap)
            chosen.append(c)
            for r, p in enumerate(probs):
                heapq.heappush(heap, (neg * p, counter, c + (r,)))
                counter += 1
        return cls(tuple(chosen))

    def build(self, root_token: int, candidates: Callable[[list[int]], list[int]]) -> TokenTree:
        """Fill the shape with a drafter's ranked candidates.

        candidates(path) gets the tokens below the root on the way to a node and returns that
        node's ranked candidates (e.g. the drafter's top-k). It is called once per built node
        that has children in the shape, parents before children. The node of rank r takes
        candidates[r]; with fewer candidates, or a token equal to an earlier sibling's, the
        node and its whole subtree are skipped."""
        tokens, parents = [root_token], [-1]
        paths = [[]]  # per built node: its tokens below the root
        built = [0] + [-1] * (self.num_nodes - 1)  # shape node -> tree node, -1: skipped
        cands: dict[int, list[int]] = {}  # tree node -> its ranked candidates
        sibling_tokens: dict[int, set[int]] = {}  # tree node -> its children's tokens
        for s in range(1, self.num_nodes):
            parent = built[self.parents[s]]
            if parent < 0:
                continue
            if parent not in cands:
                cands[parent] = [operator.index(t) for t in candidates(list(paths[parent]))]
            rank = self.ranks[s]
            if rank >= len(cands[parent]):
                continue
            tok = cands[parent][rank]
            taken = sibling_tokens.setdefault(parent, set())
            if tok in taken:
                continue
            taken.add(tok)
            built[s] = len(tokens)
            tokens.append(tok)
            parents.append(parent)
            paths.append(paths[parent] + [tok])
        return TokenTree(tuple(tokens), tuple(parents))


# ----- dynamic trees (EAGLE-2) -----------------------------------------------------------


@dataclass(frozen=True)
class DynamicTreeConfig:
    """Defaults are tuned for these CPUs: a target forward over 8 or 16 tree nodes costs a
    multiple of a plain decode step, and each expansion round costs draft time; on MT-bench
    (batch 1, T=0) depth 4 / top-k 2 / 4 nodes was the fastest of the shapes tried, from
    4/1/4 up to 6/3/8 and 5/3/10 (figures: docs/performance.md, "Drafters and tree shapes")."""
    depth: int = 4    # expansion rounds: the deepest draft token
    topk: int = 2     # children per expanded node AND frontier nodes expanded per round (EAGLE-2)
    budget: int = 4   # draft nodes kept for verification (root excluded): the verify cost

    def __post_init__(self):
        positive_ints(self, ("depth", "topk", "budget"))


ExpandFn = Callable[[list[list[int]]], list[tuple[list[int], list[float]]]]


def dynamic_tree(root_token: int, expand: ExpandFn,
                 config: DynamicTreeConfig) -> tuple[TokenTree, list[float]]:
    """EAGLE-2 style tree: expand the most promising frontier, keep the best nodes, rerank.

    Each of `config.depth` rounds picks the `topk` nodes of the newest layer with the highest
    cumulative draft log-prob (sum along the path; round 1 picks the root) and calls
    expand(paths) once for all of them (each path: its tokens below the root). expand returns,
    per path, (tokens, log-probs) ranked best first; each picked node gets up to `topk`
    children (repeats of a sibling's token are skipped). A round that adds nothing ends the
    expansion early.

    Then the `budget` nodes with the highest cumulative log-prob are kept (ties: creation
    order), together with their ancestors (log-probs <= 0 make ancestors score at least as
    high, but that is enforced, never assumed). The kept nodes are renumbered by depth, then
    cumulative log-prob descending, so each node's children come sorted by their own log-prob,
    best first: the order acceptance tries them.

    Returns the tree and each node's cumulative log-prob (root 0.0), by new node index."""
    nodes = [_Node(root_token, -1, 0.0, 0.0, 0, ())]  # creation order; 0 is the root
    frontier = [0]
    for _ in range(config.depth):
        picked = sorted(frontier, key=lambda i: (-nodes[i].cum, i))[:config.topk]
        results = expand([list(nodes[i].path) for i in picked])
        if len(results) != len(picked):
            raise ValueError(f"expand returned {len(results)} results for {len(picked)} paths")
        frontier = []
        for i, (toks, logps) in zip(picked, results):
            frontier += _add_children(nodes, i, toks, logps, config.topk)
        if not frontier:
            break

    kept = _keep_best(nodes, config.budget)
    # Renumber: depth, then cumulative log-prob. Siblings share their parent's cum, so this
    # sorts each node's children by own log-prob; `-logp` settles float-rounding ties of cum.
    order = sorted(kept, key=lambda i: (nodes[i].depth, -nodes[i].cum, -nodes[i].logp, i))
    new = {old: k for k, old in enumerate(order)}
    tree = TokenTree(tuple(nodes[i].token for i in order),
                     tuple(-1 if i == 0 else new[nodes[i].parent] for i in order))
    return tree, [nodes[i].cum for i in order]


class _Node(NamedTuple):
    token: int
    parent: int
    logp: float            # own draft log-prob given the parent's path
    cum: float             # sum of logp from the root down to this node
    depth: int
    path: tuple[int, ...]  # tokens below the root, this node's last


def _add_children(nodes: list[_Node], i: int, toks, logps, topk: int) -> list[int]:
    """Append up to `topk` children of node i from ranked (toks, logps); returns their indices."""
    toks, logps = list(toks), [float(x) for x in logps]
    if len(toks) != len(logps):
        raise ValueError(f"expand returned {len(toks)} tokens but {len(logps)} log-probs")
    parent, added, seen = nodes[i], [], set()
    for t, lp in zip(toks, logps):
        if len(added) == topk:
            break
        t = operator.index(t)
        if math.isnan(lp):
            raise ValueError(f"expand returned a NaN log-prob for token {t}")
        if t in seen:  # a node is expanded once, so its only possible siblings are these
            continue
        seen.add(t)
        added.append(len(nodes))
        nodes.append(_Node(t, i, lp, parent.cum + lp, parent.depth + 1, parent.path + (t,)))
    return added


def _keep_best(nodes: list[_Node], budget: int) -> list[int]:
    """The root plus at most `budget` nodes, best cumulative log-prob first, ancestor-closed.

    A node is taken with whichever of its ancestors are missing, if they all fit."""
    kept = {0}
    for i in sorted(range(1, len(nodes)), key=lambda i: (-nodes[i].cum, i)):
        if len(kept) - 1 == budget:
            break
        missing = []
        j = i
        while j not in kept:
            missing.append(j)
            j = nodes[j].parent
        if len(kept) - 1 + len(missing) <= budget:
            kept.update(missing)
    return sorted(kept)


# ----- best-first trees (cheap drafters) ---------------------------------------------------

CandidateFn = Callable[[list[int]], list[tuple[int, float]]]


def best_first_tree(root_token: int, candidates: CandidateFn, budget: int, max_depth: int,
                    topk: int) -> TokenTree:
    """`best_first_scored`'s tree."""
    return best_first_scored(root_token, candidates, budget, max_depth, topk)[0]


def best_first_scored(root_token: int, candidates: CandidateFn, budget: int, max_depth: int,
                      topk: int) -> tuple[TokenTree, list[float]]:
    """The `budget` draft nodes with the highest path probability, grown one node at a time.

    candidates(path) gets a node's tokens below the root and returns its ranked candidates
    as (token, probability given the path); a node's path probability is the product along
    its path. Unlike `dynamic_tree`, which expands whole layers (one batched model call per
    round), every node can be expanded, so this suits drafters whose lookups are cheap and
    unbatched (a table). Each added node costs one candidates() call; a node takes at most
    `topk` children and repeats of a sibling's token are skipped.

    Probabilities must lie in [0, 1], so a child never outranks its parent: nodes come out
    in topological order, each node's children most probable first. Returns the tree and each
    draft node's path probability, in node order."""
    if budget < 0 or max_depth < 0 or topk < 1:
        raise ValueError(f"best_first_tree needs budget >= 0, max_depth >= 0 and topk >= 1, "
                         f"got {budget}, {max_depth}, {topk}")
    tokens, parents, paths, probs = [root_token], [-1], [[]], []
    heap: list[tuple[float, int, int, int]] = []     # (-path probability, order, parent, token)
    order = itertools.count()                         # ties: the earlier candidate first

    def push_children(node: int, prob: float) -> None:
        if len(paths[node]) >= max_depth:
            return
        seen = set()
        for tok, p in candidates(list(paths[node])):
            tok, p = operator.index(tok), float(p)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"candidate probability must be in [0, 1], got {p} for token {tok}")
            if tok in seen:
                continue
            seen.add(tok)
            heapq.heappush(heap, (-prob * p, next(order), node, tok))
            if len(seen) == topk:
                break

    if budget:
        push_children(0, 1.0)
    while heap and len(tokens) - 1 < budget:
        neg, _, parent, tok = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        paths.append(paths[parent] + [tok])
        probs.append(-neg)
        if len(tokens) - 1 < budget:        # the last node's children could never be added
            push_children(len(tokens) - 1, -neg)
    return TokenTree(tuple(tokens), tuple(parents)), probs

"""TokenTree: the verification tree of one request, as two tuples of ints.

Node 0 is the root: the last token already chosen but not yet run through the target.
Draft nodes follow in topological order (``parents[i] < i``), so one pass in index order
visits every parent before its children, and any prefix of the nodes is a valid tree.

The target runs all nodes in one forward: node i sits at RoPE position ``start + depth[i]``
and attends to the request's cached prefix plus its own ancestors (``ancestor_mask``).
Acceptance walks from the root and tries each node's children in index order, so builders
put the most likely child first.

Plain Python except ``ancestor_mask``, a torch tensor.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

import torch


@dataclass(frozen=True)
class TokenTree:
    """A verification tree. Node 0 is the root: the last token already chosen but not yet run
    through the target (its KV is not cached yet). Draft nodes 1..n-1 follow in topological
    order (parents[i] < i). The children of a node, in index order, are the order in which
    acceptance tries them (most likely first)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # parents[0] == -1; 0 <= parents[i] < i for i >= 1

    def __post_init__(self):
        # Lists (or numpy / torch integer scalars) are accepted and frozen into tuples of int.
        tokens = _int_tuple("tokens", self.tokens)
        parents = _int_tuple("parents", self.parents)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        if len(tokens) != len(parents):
            raise ValueError(f"tokens and parents differ in length: {len(tokens)} vs {len(parents)}")
        if not tokens:
            raise ValueError("a TokenTree needs at least one node (the root)")
        if parents[0] != -1:
            raise ValueError(f"the root's parent must be -1, got parents[0] = {parents[0]}")
        seen: dict[tuple[int, int], int] = {}  # (parent, token) -> first child with that token
        for i in range(1, len(tokens)):
            p = parents[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: nodes must be in topological order "
                                 f"(0 <= parents[i] < i)")
            first = seen.setdefault((p, tokens[i]), i)
            if first != i:
                raise ValueError(f"nodes {first} and {i} are both children of node {p} with token "
                                 f"{tokens[i]}: siblings must have distinct tokens")

    # ----- derived structure (cached; the dataclass is frozen) ----------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Root depth 0; a node's depth is its number of draft tokens from the root."""
        d = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Per node, its children's indices in index order (the order acceptance tries them)."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def _child_by_token(self) -> dict[tuple[int, int], int]:
        return {(self.parents[i], self.tokens[i]): i for i in range(1, self.num_nodes)}

    def child_with_token(self, node: int, token: int) -> int | None:
        """The child of `node` carrying `token`, or None (siblings are distinct, so at most one)."""
        self._check_node(node)
        return self._child_by_token.get((node, token))

    def follow(self, tokens, start: int = 0) -> list[int]:
        """The nodes below `start` that carry `tokens` in turn, as far as the tree goes: the
        path greedy acceptance keeps when the target continues with them."""
        nodes, u = [], start
        for token in tokens:
            u = self.child_with_token(u, token)
            if u is None:
                break
            nodes.append(u)
        return nodes

    # ----- what the verifier needs ------------------------------------------------------

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [n, n]: row i is True at i's ancestors and at i itself, i.e. the tree nodes
        node i may attend to. A fresh CPU tensor on every call."""
        # Row by row in bytes, a node's row its parent's plus itself: every verify step builds
        # one, and a torch indexing op per depth cost more than the rest of the step's bookkeeping.
        n = self.num_nodes
        rows = bytearray(n * n)
        rows[0] = 1
        for i in range(1, n):
            p = self.parents[i] * n
            rows[i * n:i * n + n] = rows[p:p + n]
            rows[i * n + i] = 1
        return torch.frombuffer(rows, dtype=torch.bool).view(n, n)

    def positions(self, start: int) -> list[int]:
        """RoPE positions when the root sits at `start` (the request's cached length)."""
        return [start + d for d in self.depths]

    # ----- paths -----------------------------------------------------------------------

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both inclusive."""
        self._check_node(node)
        out = []
        while node != -1:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        """Tokens along `path(node)`, the root's token first."""
        return [self.tokens[i] for i in self.path(node)]

    def leaves(self) -> list[int]:
        """Nodes without children, in index order (a lone root is a leaf)."""
        return [i for i, kids in enumerate(self.children) if not kids]

    def root_to_leaf_paths(self) -> list[list[int]]:
        """`path(leaf)` for every leaf, in leaf index order."""
        return [self.path(leaf) for leaf in self.leaves()]

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.num_nodes:
            raise IndexError(f"node {node} out of range for a tree of {self.num_nodes} nodes")

    # ----- constructors ------------------------------------------------------------------

    @classmethod
    def single(cls, root_token: int) -> TokenTree:
        """Plain decoding: the root alone."""
        return cls((root_token,), (-1,))

    @classmethod
    def chain(cls, root_token: int, draft_tokens: list[int]) -> TokenTree:
        """A chain of γ = len(draft_tokens) draft tokens below the root."""
        n = len(draft_tokens)
        return cls((root_token, *draft_tokens), (-1, *range(n)))

    @classmethod
    def from_paths(cls, root_token: int, paths: Iterable[list[int]]) -> TokenTree:
        """A trie of token paths below the root: shared prefixes become shared nodes.

        Nodes are numbered in order of first appearance (path by path), so children are
        ordered by first appearance and the first path's nodes come first. Empty paths add
        nothing."""
        tokens, parents = [root_token], [-1]
        index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for p in paths:
            node = 0
            for tok in p:
                key = (node, operator.index(tok))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(key[1])
                    parents.append(node)
                node = index[key]
        return cls(tuple(tokens), tuple(parents))

    def pruned(self, keep: list[bool]) -> tuple[TokenTree, list[int]]:
        """The nodes with keep[i] True, renumbered in index order, and the old index of each
        new node. `keep` must hold the root and, with every node, its parent."""
        if not keep[0] or any(keep[i] and not keep[self.parents[i]] for i in range(1, self.num_nodes)):
            raise ValueError("a pruned tree keeps the root and every kept node's parent")
        old = [i for i in range(self.num_nodes) if keep[i]]
        new = {o: n for n, o in enumerate(old)}
        return TokenTree(tuple(self.tokens[o] for o in old),
                         tuple(-1 if o == 0 else new[self.parents[o]] for o in old)), old

    def grafted(self, node: int, sub: TokenTree) -> TokenTree:
        """This tree with `sub`'s draft nodes below `node` (sub's root stands for `node`, whose
        token it must carry); sub's nodes are numbered after this tree's, in their order."""
        self._check_node(node)
        if sub.tokens[0] != self.tokens[node]:
            raise ValueError(f"the grafted tree's root token {sub.tokens[0]} is not node {node}'s "
                             f"token {self.tokens[node]}")
        base = self.num_nodes - 1              # sub's node j > 0 becomes base + j
        parents = [node if q == 0 else base + q for q in sub.parents[1:]]
        return TokenTree(self.tokens + sub.tokens[1:], self.parents + tuple(parents))

    def truncated(self, max_nodes: int) -> TokenTree:
        """The first `max_nodes` nodes (root included): a valid tree since nodes are topological."""
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1 (the root), got {max_nodes}")
        if max_nodes >= self.num_nodes:
            return self
        return TokenTree(self.tokens[:max_nodes], self.parents[:max_nodes])


def _int_tuple(name: str, values) -> tuple[int, ...]:
    try:
        return tuple(operator.index(v) for v in values)
    except TypeError as e:
        raise ValueError(f"{name} must be a sequence of ints, got {values!r}") from e

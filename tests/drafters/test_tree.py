"""Token-tree bookkeeping: TokenTree, merging, static shapes and EAGLE-2 dynamic trees."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tree import DynamicTreeConfig, StaticTreeShape, TokenTree, best_first_tree, dynamic_tree, merge_trees

#          0:100
#         /     \
#      1:11     2:12
#      /  \        \
#   3:21  4:22    5:23
#    |
#   6:31
SEVEN = TokenTree((100, 11, 12, 21, 22, 23, 31), (-1, 0, 0, 1, 1, 2, 3))


# ----- TokenTree -------------------------------------------------------------------------


def test_seven_node_tree_by_hand():
    """Every derived view of a hand-drawn 7-node tree, written out literally."""
    t = SEVEN
    assert t.num_nodes == 7
    assert t.depths == (0, 1, 1, 2, 2, 2, 3)
    assert t.max_depth == 3
    assert t.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    assert t.positions(start=10) == [10, 11, 11, 12, 12, 12, 13]
    assert [t.path(i) for i in range(7)] == [
        [0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    assert t.path_tokens(6) == [100, 11, 21, 31]
    assert t.path_tokens(0) == [100]
    assert t.leaves() == [4, 5, 6]
    assert t.root_to_leaf_paths() == [[0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]


def test_ancestor_mask_by_hand():
    """Row i is True exactly at i's ancestors and i itself."""
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    mask = SEVEN.ancestor_mask()
    assert mask.dtype == torch.bool and mask.shape == (7, 7)
    assert torch.equal(mask, expected)
    mask[0, 1] = True  # a fresh tensor each call: mutating one does not leak
    assert torch.equal(SEVEN.ancestor_mask(), expected)


def test_ancestor_mask_matches_paths():
    """On a random tree the mask row of each node equals the node set of its path."""
    rng = random.Random(0)
    parents = [-1] + [rng.randrange(i) for i in range(1, 40)]
    t = TokenTree(tuple(range(40)), tuple(parents))  # distinct tokens: no duplicate siblings
    mask = t.ancestor_mask()
    for i in range(t.num_nodes):
        assert mask[i].nonzero().flatten().tolist() == sorted(t.path(i))


def test_child_with_token():
    """Lookup of a child by token, None when absent, IndexError for a bad node."""
    assert SEVEN.child_with_token(1, 22) == 4
    assert SEVEN.child_with_token(0, 11) == 1
    assert SEVEN.child_with_token(1, 23) is None
    assert SEVEN.child_with_token(6, 31) is None
    with pytest.raises(IndexError):
        SEVEN.child_with_token(7, 1)
    with pytest.raises(IndexError):
        SEVEN.path(-1)


def test_single_and_chain():
    """single() is the root alone; chain() links each draft token to the previous one."""
    s = TokenTree.single(5)
    assert (s.tokens, s.parents, s.depths, s.max_depth) == ((5,), (-1,), (0,), 0)
    assert s.leaves() == [0] and s.root_to_leaf_paths() == [[0]]
    assert torch.equal(s.ancestor_mask(), torch.ones(1, 1, dtype=torch.bool))
    c = TokenTree.chain(5, [6, 7, 8])
    assert c.tokens == (5, 6, 7, 8) and c.parents == (-1, 0, 1, 2)
    assert c.positions(3) == [3, 4, 5, 6]
    assert c.root_to_leaf_paths() == [[0, 1, 2, 3]]
    assert torch.equal(c.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert TokenTree.chain(5, []) == s


def test_from_paths_dedupes_prefixes():
    """Shared prefixes share nodes; children are ordered by first appearance; empty paths add nothing."""
    t = TokenTree.from_paths(0, [[5, 6], [5, 7], [8], [5, 6, 9], []])
    assert t.tokens == (0, 5, 6, 7, 8, 9)
    assert t.parents == (-1, 0, 1, 1, 0, 2)
    assert t.children[0] == (1, 4) and t.children[1] == (2, 3)
    assert TokenTree.from_paths(0, []) == TokenTree.single(0)


def test_lists_are_frozen_into_tuples():
    """Lists are accepted, stored as tuples, and the tree is hashable and compares by value."""
    t = TokenTree([100, 11, 12, 21, 22, 23, 31], [-1, 0, 0, 1, 1, 2, 3])
    assert isinstance(t.tokens, tuple) and isinstance(t.parents, tuple)
    assert t == SEVEN and hash(t) == hash(SEVEN)


def test_truncated():
    """The first max_nodes nodes stay a valid tree; max_nodes < 1 is an error."""
    t = SEVEN.truncated(4)
    assert t.tokens == (100, 11, 12, 21) and t.parents == (-1, 0, 0, 1)
    assert SEVEN.truncated(1) == TokenTree.single(100)
    assert SEVEN.truncated(7) is SEVEN and SEVEN.truncated(50) is SEVEN
    with pytest.raises(ValueError, match="max_nodes"):
        SEVEN.truncated(0)


def test_grafted_puts_a_tree_below_a_node():
    """A forced chain 100 -> 5 -> 6 with a drafter's tree rooted at 6 grafted below node 2."""
    chain = TokenTree.chain(100, [5, 6])
    below = TokenTree((6, 7, 8, 9), (-1, 0, 0, 1))
    t = chain.grafted(2, below)
    assert t.tokens == (100, 5, 6, 7, 8, 9) and t.parents == (-1, 0, 1, 2, 2, 3)
    assert t.path_tokens(5) == [100, 5, 6, 7, 9]
    assert chain.grafted(2, TokenTree.single(6)) == chain
    with pytest.raises(ValueError, match="root token"):
        chain.grafted(1, below)


@pytest.mark.parametrize("tokens, parents, match", [
    ((1, 2), (-1,), "length"),
    ((), (), "at least one node"),
    ((1, 2), (0, 0), "root's parent"),
    ((1, 2, 3), (-1, 2, 0), "topological"),
    ((1, 2), (-1, 1), "topological"),
    ((1, 2, 3), (-1, 0, -1), "topological"),
    ((1, 2, 3, 2), (-1, 0, 0, 0), "distinct"),
    ((1.5, 2), (-1, 0), "ints"),
])
def test_validation_errors(tokens, parents, match):
    """Malformed trees are rejected with a ValueError naming the problem."""
    with pytest.raises(ValueError, match=match):
        TokenTree(tokens, parents)


def test_same_token_under_different_parents_is_fine():
    """Only siblings must be distinct; one token may appear on several branches."""
    t = TokenTree((0, 1, 2, 7, 7), (-1, 0, 0, 1, 2))
    assert t.child_with_token(1, 7) == 3 and t.child_with_token(2, 7) == 4


# ----- merge_trees -----------------------------------------------------------------------


def test_merge_trees_shares_prefixes():
    """The union keeps the first tree's nodes first and appends only what later trees add."""
    t1 = TokenTree.from_paths(9, [[1, 2, 3], [1, 4]])  # 9 1 2 3 4
    t2 = TokenTree.from_paths(9, [[1, 2, 5], [6]])     # 9 1 2 5 6
    m = merge_trees([t1, t2])
    assert m.tokens == (9, 1, 2, 3, 4, 5, 6)
    assert m.parents == (-1, 0, 1, 2, 1, 2, 0)
    assert m.children[0] == (1, 6) and m.children[2] == (3, 5)
    assert merge_trees([t1]) == t1
    assert merge_trees([t1, t1]) == t1


def test_merge_small_model_chain_with_ngram_chain():
    """Two chains diverging after one shared token become a two-branch tree."""
    drafter = TokenTree.chain(0, [1, 2, 3])
    ngram = TokenTree.chain(0, [1, 5])
    m = merge_trees([drafter, ngram])
    assert m.tokens == (0, 1, 2, 3, 5) and m.parents == (-1, 0, 1, 2, 1)
    assert m.root_to_leaf_paths() == [[0, 1, 2, 3], [0, 1, 4]]


def test_merge_trees_errors():
    """Different root tokens, or no trees at all, are errors."""
    with pytest.raises(ValueError, match="root token"):
        merge_trees([TokenTree.chain(1, [2]), TokenTree.chain(3, [2])])
    with pytest.raises(ValueError, match="at least one"):
        merge_trees([])


# ----- StaticTreeShape -------------------------------------------------------------------

MEDUSA = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def rank_candidates(path: list[int]) -> list[int]:
    """Fake drafter top-3: after token x come 10x+1, 10x+2, 10x+3 (after the root: 1, 2, 3)."""
    last = path[-1] if path else 0
    return [10 * last + r for r in (1, 2, 3)]


def test_static_shape_structure():
    """Nodes are ordered by depth, then choice order; parents, ranks and depths follow."""
    shape = StaticTreeShape([(0, 0), (1,), (0,), (2,), (0, 0, 0)])
    assert shape.choices == ((0, 0), (1,), (0,), (2,), (0, 0, 0))
    # nodes: root, (1,), (0,), (2,), (0, 0), (0, 0, 0)
    assert shape.parents == (-1, 0, 0, 0, 2, 4)
    assert shape.ranks == (-1, 1, 0, 2, 0, 0)
    assert shape.depths == (0, 1, 1, 1, 2, 3)
    assert shape.depth == 3 and shape.num_nodes == 6


def test_static_shape_build_medusa_choices():
    """A Medusa choice list filled by a fake top-k gives exactly the expected tree."""
    calls = []

    def candidates(path):
        calls.append(list(path))
        return rank_candidates(path)

    t = StaticTreeShape(MEDUSA).build(100, candidates)
    assert t.tokens == (100, 1, 2, 3, 11, 12, 21, 111)
    assert t.parents == (-1, 0, 0, 0, 1, 1, 2, 4)
    assert calls == [[], [1], [2], [1, 11]]  # once per node with children, parents first


def test_static_shape_build_skips_missing_and_duplicate_candidates():
    """Too few candidates, or a repeat of a sibling's token, skip the node and its subtree."""
    table = {(): [1, 2], (1,): [11, 11], (2,): [21], (1, 11): []}
    t = StaticTreeShape(MEDUSA).build(100, lambda p: table[tuple(p)])
    # (2,) has no third candidate; (0, 1) repeats 11; (0, 0, 0) finds no candidate.
    assert t.tokens == (100, 1, 2, 11, 21)
    assert t.parents == (-1, 0, 0, 1, 2)


def test_static_shape_chain():
    """chain(γ) is the top-1 path of length γ; chain(0) is plain decoding."""
    shape = StaticTreeShape.chain(3)
    assert shape.choices == ((0,), (0, 0), (0, 0, 0))
    assert shape.build(0, rank_candidates) == TokenTree.chain(0, [1, 11, 111])
    assert StaticTreeShape.chain(0).build(7, rank_candidates) == TokenTree.single(7)


def test_static_shape_default_for_budget():
    """The modeled-best choices for a budget: prefix-closed, highest path products first."""
    shape = StaticTreeShape.default_for_budget(4, rank_probs=(0.6, 0.2, 0.1))
    # values: (0,) .6, (0, 0) .36, (0, 0, 0) .216, (1,) .2, then (0, 0, 0, 0) .1296
    assert shape.choices == ((0,), (0, 0), (0, 0, 0), (1,))
    assert StaticTreeShape.default_for_budget(25).num_nodes == 26  # prefix check passed


@pytest.mark.parametrize("choices, match", [
    ([(0,), (1, 0)], r"prefix \(1,\)"),
    ([(0, 0)], r"prefix \(0,\)"),
    ([(0,), (0, 1, 0)], r"prefix \(0, 1\)"),
    ([(0,), (0,)], "twice"),
    ([()], "non-empty"),
    ([(-1,)], "negative"),
])
def test_static_shape_errors(choices, match):
    """Missing prefixes (named in the message), repeats, empty and negative choices are rejected."""
    with pytest.raises(ValueError, match=match):
        StaticTreeShape(choices)


# ----- dynamic_tree ----------------------------------------------------------------------


def table_expand(table: dict[tuple[int, ...], list[tuple[int, float]]], calls: list | None = None):
    """expand() from a table path -> [(token, prob)], returning log-probs."""
    def expand(paths):
        if calls is not None:
            calls.append([list(p) for p in paths])
        return [([t for t, _ in table.get(tuple(p), [])],
                 [math.log(q) for _, q in table.get(tuple(p), [])]) for p in paths]
    return expand


def random_expand(vocab: int = 5):
    """Deterministic fake drafter: a fixed pseudo-random distribution per path, ranked."""
    def expand(paths):
        out = []
        for p in paths:
            rng = random.Random(str(list(p)))
            logits = [rng.gauss(0.0, 1.5) for _ in range(vocab)]
            lse = math.log(sum(math.exp(x) for x in logits))
            ranked = sorted(range(vocab), key=lambda t: -logits[t])
            out.append((ranked, [logits[t] - lse for t in ranked]))
        return out
    return expand


def brute_force(expand, depth: int, topk: int, budget: int) -> dict[tuple[int, ...], float]:
    """Reference: EAGLE-2 expansion keyed by token path, one expand call per path."""
    layer, everything = [((), 0.0)], []
    for _ in range(depth):
        picked = sorted(layer, key=lambda x: -x[1])[:topk]  # stable: ties keep creation order
        layer = []
        for path, cum in picked:
            toks, lps = expand([list(path)])[0]
            layer += [(path + (t,), cum + lp) for t, lp in list(zip(toks, lps))[:topk]]
        everything += layer
    best = sorted(everything, key=lambda x: -x[1])[:budget]
    return dict(best)


def check_dynamic_invariants(tree: TokenTree, cums: list[float], budget: int):
    assert len(cums) == tree.num_nodes and cums[0] == 0.0
    assert tree.num_nodes - 1 <= budget
    assert all(tree.parents[i] < i for i in range(1, tree.num_nodes))  # topological
    assert list(tree.depths) == sorted(tree.depths)                   # depth-major order
    for a, b in zip(range(1, tree.num_nodes), range(2, tree.num_nodes)):
        if tree.depths[a] == tree.depths[b]:                           # then best first
            assert cums[a] >= cums[b]
    for kids in tree.children:                                         # best child first
        assert [cums[k] for k in kids] == sorted((cums[k] for k in kids), reverse=True)


def test_dynamic_tree_by_hand():
    """A 2x2 case worked out on paper, including a rerank across parents."""
    table = {(): [(1, 0.6), (2, 0.3), (3, 0.1)],
             (1,): [(4, 0.3), (5, 0.2)],
             (2,): [(6, 0.9), (7, 0.1)]}
    # cumulative: 1 .6, 2 .3, 2-6 .27, 1-4 .18, 1-5 .12, 2-7 .03 (3 is past topk=2)
    tree, cums = dynamic_tree(0, table_expand(table), DynamicTreeConfig(depth=2, topk=2, budget=4))
    assert tree.tokens == (0, 1, 2, 6, 4)  # 6 (.27) before 4 (.18), unlike creation order
    assert tree.parents == (-1, 0, 0, 2, 1)
    assert cums == pytest.approx([0.0] + [math.log(q) for q in (0.6, 0.3, 0.27, 0.18)])
    tree, _ = dynamic_tree(0, table_expand(table), DynamicTreeConfig(depth=2, topk=2, budget=1))
    assert tree == TokenTree.chain(0, [1])


def test_dynamic_tree_expands_only_topk_frontier():
    """Round 2 expands only the topk best nodes of round 1, in one batched call."""
    table = {(): [(1, 0.5), (2, 0.3), (3, 0.2)], (1,): [(4, 0.9)], (2,): [(5, 0.9)], (3,): [(6, 0.9)]}
    calls = []
    tree, _ = dynamic_tree(0, table_expand(table, calls), DynamicTreeConfig(depth=2, topk=2, budget=10))
    assert calls == [[[]], [[1], [2]]]
    assert tree.tokens == (0, 1, 2, 4, 5) and tree.parents == (-1, 0, 0, 1, 2)


def test_dynamic_tree_reranks_siblings():
    """Children come out sorted by their own log-prob even if expand ranked them otherwise."""
    table = {(): [(1, 0.2), (2, 0.7), (3, 0.1)]}
    tree, cums = dynamic_tree(0, table_expand(table), DynamicTreeConfig(depth=1, topk=3, budget=3))
    assert tree.tokens == (0, 2, 1, 3)
    assert cums == pytest.approx([0.0, math.log(0.7), math.log(0.2), math.log(0.1)])


@pytest.mark.parametrize("depth, topk, budget", [(3, 2, 5), (4, 3, 10), (5, 2, 7), (2, 4, 3)])
def test_dynamic_tree_matches_brute_force(depth, topk, budget):
    """Kept node set and cumulative log-probs equal an independent path-keyed reference."""
    expand = random_expand()
    tree, cums = dynamic_tree(0, expand, DynamicTreeConfig(depth, topk, budget))
    check_dynamic_invariants(tree, cums, budget)
    expected = brute_force(expand, depth, topk, budget)
    got = {tuple(tree.path_tokens(i)[1:]): cums[i] for i in range(1, tree.num_nodes)}
    assert got.keys() == expected.keys()
    for path, cum in got.items():
        assert cum == pytest.approx(expected[path])
    for i in range(1, tree.num_nodes):  # ancestors kept: a path's every prefix is in the tree
        assert tuple(tree.path_tokens(i)[1:-1]) in got or tree.parents[i] == 0


def test_dynamic_tree_large_budget_keeps_everything():
    """With budget >= all created nodes, every expanded child is in the tree; expand is called
    exactly depth times with at most topk paths each."""
    calls = []
    inner = random_expand()

    def expand(paths):
        calls.append(len(paths))
        return inner(paths)

    tree, cums = dynamic_tree(0, expand, DynamicTreeConfig(depth=4, topk=3, budget=1000))
    assert calls == [1, 3, 3, 3]
    assert tree.num_nodes == 1 + 3 + 9 + 9 + 9
    check_dynamic_invariants(tree, cums, 1000)
    assert brute_force(inner, 4, 3, 1000).keys() == {
        tuple(tree.path_tokens(i)[1:]) for i in range(1, tree.num_nodes)}


def test_dynamic_tree_enforces_ancestors_within_budget():
    """A child scoring above its parent (positive log-prob) still never enters without it."""
    def expand(paths):
        return [([1], [-2.0]) if not p else ([2], [1.0]) for p in paths]

    tree, _ = dynamic_tree(0, expand, DynamicTreeConfig(depth=2, topk=1, budget=1))
    assert tree == TokenTree.chain(0, [1])
    tree, cums = dynamic_tree(0, expand, DynamicTreeConfig(depth=2, topk=1, budget=2))
    assert tree == TokenTree.chain(0, [1, 2]) and cums == [0.0, -2.0, -1.0]


def test_dynamic_tree_skips_duplicate_tokens_and_stops_when_empty():
    """A repeated token in one expansion is skipped; a round that adds nothing ends expansion."""
    calls = []
    table = {(): [(1, 0.5), (1, 0.3), (2, 0.2)]}
    tree, _ = dynamic_tree(0, table_expand(table, calls), DynamicTreeConfig(depth=5, topk=2, budget=9))
    assert tree.tokens == (0, 1, 2) and tree.parents == (-1, 0, 0)
    assert len(calls) == 2  # round 2 expands 1 and 2, gets nothing, stops


def test_dynamic_tree_bad_expand_output():
    """expand must answer every path, with as many log-probs as tokens, none NaN."""
    cfg = DynamicTreeConfig(depth=1, topk=2, budget=2)
    with pytest.raises(ValueError, match="results"):
        dynamic_tree(0, lambda paths: [], cfg)
    with pytest.raises(ValueError, match="log-probs"):
        dynamic_tree(0, lambda paths: [([1, 2], [-0.1])], cfg)
    with pytest.raises(ValueError, match="NaN"):
        dynamic_tree(0, lambda paths: [([1], [float("nan")])], cfg)


@pytest.mark.parametrize("field, value", [
    ("depth", 0), ("topk", 0), ("budget", 0), ("budget", -1), ("topk", 2.0), ("depth", True)])
def test_dynamic_config_validation(field, value):
    """Each field must be an int >= 1; the error names the field."""
    kwargs = dict(depth=2, topk=2, budget=4)
    kwargs[field] = value
    with pytest.raises(ValueError, match=f"{field} must be an int >= 1"):
        DynamicTreeConfig(**kwargs)


# ----- best_first_tree -----------------------------------------------------------------------


def random_candidates(seed: int, vocab: int = 5):
    """A deterministic candidates(path): up to 4 distinct tokens with random probabilities."""
    def candidates(path):
        rng = random.Random(hash((seed, tuple(path))))
        toks = rng.sample(range(vocab), rng.randrange(0, 5))
        return sorted(((t, rng.random()) for t in toks), key=lambda c: -c[1])
    return candidates


def all_nodes(candidates, max_depth, topk):
    """Every node best_first_tree could add, as path -> path probability."""
    out, frontier = {}, [((), 1.0)]
    while frontier:
        path, prob = frontier.pop()
        if len(path) == max_depth:
            continue
        for tok, p in candidates(list(path))[:topk]:
            out[path + (tok,)] = prob * p
            frontier.append((path + (tok,), prob * p))
    return out


@pytest.mark.parametrize("seed, budget, max_depth, topk", [
    (0, 5, 4, 3), (1, 8, 3, 2), (2, 3, 5, 1), (3, 12, 4, 4), (4, 1, 2, 2)])
def test_best_first_tree_keeps_the_most_probable_nodes(seed, budget, max_depth, topk):
    """The kept nodes are the `budget` most probable paths (products of the candidates'
    probabilities), in topological order with each node's children most probable first."""
    cands = random_candidates(seed)
    tree = best_first_tree(9, cands, budget, max_depth, topk)
    ref = all_nodes(cands, max_depth, topk)
    best = sorted(ref, key=lambda p: -ref[p])[:budget]
    got = [tuple(tree.path_tokens(j)[1:]) for j in range(1, tree.num_nodes)]
    assert sorted(got) == sorted(best)
    assert [ref[p] for p in got] == sorted((ref[p] for p in got), reverse=True)   # pop order
    assert all(tree.parents[j] < j for j in range(1, tree.num_nodes))


def test_best_first_tree_by_hand():
    table = {(): [(1, 0.6), (2, 0.3), (1, 0.1)], (1,): [(3, 0.9)], (1, 3): [(4, 0.2)], (2,): [(5, 1.0)]}
    calls = []

    def cands(path):
        calls.append(tuple(path))
        return table.get(tuple(path), [])
    tree = best_first_tree(0, cands, budget=4, max_depth=3, topk=2)
    # 1 (0.6), 1 3 (0.54), 2 (0.3), 2 5 (0.3); the repeated 1 is skipped; 1 3 4 is 0.108.
    assert tree.tokens == (0, 1, 3, 2, 5) and tree.parents == (-1, 0, 1, 0, 3)
    assert calls == [(), (1,), (1, 3), (2,)]          # the last node is never expanded
    assert best_first_tree(0, cands, budget=0, max_depth=3, topk=2) == TokenTree.single(0)
    assert best_first_tree(0, cands, budget=9, max_depth=1, topk=2).tokens == (0, 1, 2)


def test_best_first_tree_bad_input():
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        best_first_tree(0, lambda path: [(1, 1.5)], budget=2, max_depth=2, topk=1)
    with pytest.raises(ValueError, match="topk >= 1"):
        best_first_tree(0, lambda path: [], budget=2, max_depth=2, topk=0)

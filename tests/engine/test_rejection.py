"""Exact acceptance (spec/rejection.py) without a model.

The statistical tests emulate a model with fixed random tables: the target's distribution
after a path of draft tokens is a row indexed by the whole path (so it depends on the path,
as penalties make it), some rows truncated like top-k / top-p (zeros in p). The drafter
is a second, different table. Each test runs 10,000 verify steps, extends every emitted
sequence to L = 3 tokens by sampling the target plainly, and compares the distribution of
those 3-token prefixes with the exact one by a chi-square test. The same harness with a
deliberately broken rule (patched into the module) must fail it.
"""
from __future__ import annotations

import random

import pytest
import torch

import spec.rejection as rejection
from drafters.base import DraftDistributions
from spec.rejection import AcceptResult, accept_chain, accept_greedy, accept_tree
from stats import chi_square_pvalue, total_variation
from tree.token_tree import TokenTree

V = 8            # vocabulary of the table model
L = 3            # length of the emitted prefix whose distribution is compared
ROOT = 0         # the root's token (never read by acceptance)
N = 10_000       # verify steps per statistical test


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----- the table model ---------------------------------------------------------------------


def flat_index(paths: torch.Tensor) -> torch.Tensor:
    """[M, d] token paths -> [M] row index Σ x_i V^(d-i) (0 for the empty path)."""
    idx = torch.zeros(paths.shape[0], dtype=torch.long)
    for k in range(paths.shape[1]):
        idx = idx * V + paths[:, k]
    return idx


def all_paths(d: int) -> torch.Tensor:
    """[V^d, d] every path of d tokens, in flat_index order."""
    if d == 0:
        return torch.zeros(1, 0, dtype=torch.long)
    grids = torch.meshgrid(*[torch.arange(V)] * d, indexing="ij")
    return torch.stack([g.reshape(-1) for g in grids], dim=1)


def make_tables(seed: int, max_depth: int, truncate: bool, like: list[torch.Tensor] | None = None,
                mix: float = 0.0) -> list[torch.Tensor]:
    """tables[d]: [V^d, V], the distribution after each path of d tokens.

    Logits = a bigram row (last token) + noise drawn per path + a presence penalty on the
    path's tokens. With `truncate`, a third of the rows keep their top 3 tokens and a third
    are top-p 0.7 truncated. `like` mixes in another model's logits (a drafter that is
    correlated with the target, as real drafters are)."""
    g = gen(seed)
    bigram = torch.randn(V, V, generator=g) * 1.5
    tables = []
    for d in range(max_depth + 1):
        paths = all_paths(d)                                           # [V^d, d]
        last = paths[:, -1] if d else torch.full((1,), ROOT)
        logits = bigram[last] + 0.7 * torch.randn(paths.shape[0], V, generator=g)
        present = torch.zeros(paths.shape[0], V).scatter_(1, paths, 1.0) if d else 0.0
        logits = logits - 1.0 * present
        if like is not None:
            logits = (1 - mix) * logits + mix * like[d].clamp_min(1e-30).log()
        probs = torch.softmax(logits, dim=-1)
        if truncate:
            rows = torch.arange(paths.shape[0])
            kth = probs.topk(3, dim=-1).values[:, -1:]
            topk = probs.masked_fill(probs < kth, 0.0)
            srt, order = probs.sort(dim=-1, descending=True)
            drop = torch.zeros_like(probs).scatter(1, order, ((srt.cumsum(-1) - srt) >= 0.7).float())
            topp = probs.masked_fill(drop.bool(), 0.0)
            kind = (rows % 3)[:, None]                                 # 0: top-k, 1: top-p, 2: none
            probs = torch.where(kind == 0, topk, torch.where(kind == 1, topp, probs))
            probs = probs / probs.sum(-1, keepdim=True)
        tables.append(probs)
    return tables


def exact_prefix_probs(p_tables: list[torch.Tensor]) -> torch.Tensor:
    """[V^L] the target's exact probability of every L-token prefix (flat_index order)."""
    joint = p_tables[0][0].double()
    for k in range(1, L):
        joint = (joint[:, None] * p_tables[k].double()).reshape(-1)
    return joint


# ----- proposals (vectorised over the N steps) -------------------------------------------


def tree_shape(branching: list[int]) -> tuple[int, ...]:
    """Parents of a tree where every node at depth d has branching[d] children, numbered
    level by level, each node's children consecutive in draw order."""
    parents, level = [-1], [0]
    for b in branching:
        nxt = []
        for u in level:
            for _ in range(b):
                parents.append(u)
                nxt.append(len(parents) - 1)
        level = nxt
    return tuple(parents)


def propose(q_tables: list[torch.Tensor], branching: list[int], how: str, g: torch.Generator):
    """Draw N trees of one shape from the draft tables.

    how: "iid" (one child per node, sampled), "wor" (siblings sampled from q without
    replacement, in draw order), "det" (the top-b tokens of q: deterministic).
    Returns parents, tokens [N, n] and row indices [N, n] (flat path index per node)."""
    parents = tree_shape(branching)
    tokens = [torch.full((N,), ROOT)]
    flats = [torch.zeros(N, dtype=torch.long)]
    level = [0]
    for d, b in enumerate(branching):
        nxt = []
        for u in level:
            q = q_tables[d][flats[u]]                                  # [N, V]
            if how == "det":
                kids = q.topk(b, dim=-1).indices                       # [N, b]
            else:
                assert how == "wor" or b == 1
                kids = torch.multinomial(q, b, replacement=False, generator=g)
            for j in range(b):
                tokens.append(kids[:, j])
                flats.append(flats[u] * V + kids[:, j])
                nxt.append(len(tokens) - 1)
        level = nxt
    return parents, torch.stack(tokens, 1), torch.stack(flats, 1)


def node_rows(tables: list[torch.Tensor], flats: torch.Tensor, depths: tuple[int, ...]) -> torch.Tensor:
    """[N, n, V]: each node's row of the given tables."""
    return torch.stack([tables[d][flats[:, u]] for u, d in enumerate(depths)], dim=1)


def extend_and_count(emitted: list[list[int]], p_tables: list[torch.Tensor],
                     g: torch.Generator) -> torch.Tensor:
    """Cut or extend (by plain target sampling) every emitted sequence to L tokens; return
    counts [V^L] of the resulting prefixes."""
    out = torch.full((len(emitted), L), -1, dtype=torch.long)
    for i, seq in enumerate(emitted):
        seq = seq[:L]
        out[i, :len(seq)] = torch.tensor(seq)
    for k in range(1, L):
        need = out[:, k] < 0
        if need.any():
            rows = p_tables[k][flat_index(out[need, :k])]
            out[need, k] = torch.multinomial(rows, 1, generator=g)[:, 0]
    return torch.bincount(flat_index(out), minlength=V ** L)


# ----- the broken rules ------------------------------------------------------------------


def _no_residual_update(p, q, tried):
    # Broken: after a rejection keep sampling from p instead of normalize(max(0, p - q)).
    return p


def _q_not_renormalised(q_u, tried, without_replacement):
    # Broken: later siblings judged against q_u itself, not q_u without the earlier ones.
    return q_u


BROKEN = {"no_residual_update": ("_residual", _no_residual_update),
          "q_not_renormalised": ("_proposal", _q_not_renormalised)}


# ----- statistical exactness -------------------------------------------------------------

# (name, branching per depth, how the drafter proposes, accept through, broken rule).
# [2, 2] trees end with no accepted child about a fifth of the time; [3, 2] trees cover
# most of the truncated support, so they mostly test renormalisation over two siblings.
CASES = [
    ("chain_iid", [1, 1, 1], "iid", "chain", None),
    ("chain_det", [1, 1, 1], "det", "tree", None),
    ("tree_wor", [2, 2], "wor", "tree", None),
    ("tree_wor_wide", [3, 2], "wor", "tree", None),
    ("tree_det", [2, 2], "det", "tree", None),
    ("tree_det_wide", [3, 2], "det", "tree", None),
    ("chain_iid_broken", [1, 1, 1], "iid", "chain", "no_residual_update"),
    ("tree_det_broken", [2, 2], "det", "tree", "no_residual_update"),
    ("tree_wor_broken", [2, 2], "wor", "tree", "q_not_renormalised"),
    ("tree_wor_wide_broken", [3, 2], "wor", "tree", "q_not_renormalised"),
]


def run_steps(branching: list[int], how: str, via: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """N verify steps from the root; returns (counts of L-token prefixes, exact probs)."""
    depth = len(branching)
    p_tables = make_tables(seed, depth, truncate=True)
    q_tables = make_tables(seed + 1, depth, truncate=False, like=p_tables, mix=0.5)
    g = gen(seed + 2)
    parents, tokens, flats = propose(q_tables, branching, how, g)
    depths = TokenTree(tokens=tokens[0].tolist(), parents=parents).depths
    p_nodes = node_rows(p_tables, flats, depths)                     # [N, n, V]
    q_nodes = node_rows(q_tables, flats, depths)                     # [N, n, V]
    mode = {"iid": "iid", "wor": "without_replacement", "det": None}[how]
    emitted, token_lists, trees = [], tokens.tolist(), {}
    for i in range(N):
        if via == "chain":
            res = accept_chain(token_lists[i][1:], p_nodes[i], q_nodes[i] if mode else None, g)
            emitted.append(token_lists[i][1:1 + res.num_accepted] + [res.token])
            continue
        key = tuple(token_lists[i])
        tree = trees.get(key) or trees.setdefault(key, TokenTree(tokens=key, parents=parents))
        draft = DraftDistributions(q_nodes[i], mode) if mode else None
        res = accept_tree(tree, p_nodes[i].__getitem__, draft, g)
        emitted.append(res.output_tokens(tree))
    return extend_and_count(emitted, p_tables, g), exact_prefix_probs(p_tables)


@pytest.mark.parametrize("name, branching, how, via, broken", CASES, ids=[c[0] for c in CASES])
def test_emitted_prefix_matches_target(monkeypatch, name, branching, how, via, broken):
    """10,000 verify steps: the emitted 3-token prefixes follow the target exactly
    (chi-square p > 0.001), for chains and depth-2 trees, sampled and deterministic
    proposals, with top-k/top-p zeros in p. The same harness with a broken rule patched
    in (no residual update; siblings not renormalised) must fail (p < 0.001)."""
    if broken:
        attr, fn = BROKEN[broken]
        monkeypatch.setattr(rejection, attr, fn)
    counts, probs = run_steps(branching, how, via, seed=1234)
    pval, tv = chi_square_pvalue(counts, probs), total_variation(counts, probs)
    print(f"{name}: chi-square p = {pval:.3g}, TV = {tv:.4f}")
    if broken:
        assert pval < 1e-3, f"{name}: the broken rule went undetected (p = {pval:.3g}, TV = {tv:.4f})"
    else:
        assert pval > 1e-3, f"{name}: emitted prefixes differ from the target (p = {pval:.3g}, TV = {tv:.4f})"


def test_chi_square_helper_calibrated():
    """The hand-written chi-square p-value: exact samples give moderate p, a shifted
    distribution gives p ~ 0, an impossible sequence gives p = 0."""
    g = gen(7)
    probs = torch.softmax(torch.randn(64, generator=g) * 2, 0)
    counts = torch.bincount(torch.multinomial(probs, N, replacement=True, generator=g), minlength=64)
    assert chi_square_pvalue(counts, probs) > 1e-3
    shifted = torch.softmax(torch.log(probs) + 0.3 * torch.randn(64, generator=g), 0)
    assert chi_square_pvalue(counts, shifted) < 1e-3
    zeroed = probs.clone()
    zeroed[probs.argmax()] = 0
    assert chi_square_pvalue(counts, zeroed / zeroed.sum()) == 0.0


# ----- temperature 0 ---------------------------------------------------------------------


def argmax_table(table: dict[tuple[int, ...], int]):
    return lambda tree: (lambda u: table[tuple(tree.path_tokens(u))])


def test_greedy_accepts_matching_path():
    """The path whose tokens are the target's argmaxes is accepted; the argmax after it is
    emitted (the leaf's bonus)."""
    tree = TokenTree.from_paths(9, [[1, 2], [3, 4], [1, 5]])   # 9 -> {1 -> {2, 5}, 3 -> 4}
    target = {(9,): 1, (9, 1): 5, (9, 1, 5): 7}
    res = accept_greedy(tree, argmax_table(target)(tree))
    assert res.output_tokens(tree) == [1, 5, 7]
    assert res.num_accepted == 2 and tree.tokens[res.last_node] == 5


def test_greedy_stops_at_first_mismatch():
    """A node none of whose children carry the argmax stops the walk and emits the argmax."""
    tree = TokenTree.from_paths(9, [[1, 2, 3], [4]])
    res = accept_greedy(tree, argmax_table({(9,): 1, (9, 1): 6})(tree))
    assert res == AcceptResult(accepted=(1,), token=6)
    res = accept_greedy(tree, argmax_table({(9,): 8})(tree))
    assert res == AcceptResult(accepted=(), token=8) and res.last_node == 0


def test_greedy_bonus_at_leaf_and_lone_root():
    """A fully accepted chain emits the bonus argmax at its leaf; a lone root just emits."""
    tree = TokenTree.chain(9, [1, 2])
    assert accept_greedy(tree, argmax_table({(9,): 1, (9, 1): 2, (9, 1, 2): 3})(tree)) == \
        AcceptResult(accepted=(1, 2), token=3)
    assert accept_greedy(TokenTree.single(9), lambda u: 4) == AcceptResult((), 4)


def test_greedy_equals_plain_greedy_decoding():
    """Random trees and a random argmax table: the emitted tokens are exactly the first
    tokens of plain greedy decoding, and the path is as long as the tree allows."""
    rnd = random.Random(0)
    greedy = {}

    def argmax(path: tuple[int, ...]) -> int:
        return greedy.setdefault(path, rnd.randrange(4))

    for _ in range(300):
        paths = [[rnd.randrange(4) for _ in range(rnd.randint(0, 4))] for _ in range(rnd.randint(0, 5))]
        tree = TokenTree.from_paths(0, paths)
        res = accept_greedy(tree, lambda u: argmax(tuple(tree.path_tokens(u))))
        plain, path = [], (0,)
        for _ in range(res.num_accepted + 1):
            plain.append(argmax(path))
            path += (plain[-1],)
        assert res.output_tokens(tree) == plain
        # It could not have gone further: the emitted token is no child of the last node.
        assert tree.child_with_token(res.last_node, res.token) is None


# ----- edge cases and contracts ----------------------------------------------------------


def test_draft_equal_to_target_accepts_everything():
    """q = p: min(1, p/q) = 1, so every draft token is accepted and the bonus comes last."""
    p = make_tables(3, 3, truncate=True)
    g = gen(0)
    for _ in range(50):
        toks, rows = [], [p[0][0]]
        for d in range(3):
            toks.append(int(torch.multinomial(rows[-1], 1, generator=g)))
            rows.append(p[d + 1][flat_index(torch.tensor([toks]))[0]])
        rows = torch.stack(rows)
        assert accept_chain(toks, rows, rows[:3], g).num_accepted == 3


def test_token_outside_target_support_never_accepted():
    """A token the target's truncation removed (p(x) = 0) is rejected whatever q says, and
    the residual never emits a rejected token."""
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    q = torch.tensor([0.05, 0.05, 0.8, 0.1])
    g = gen(1)
    tree = TokenTree.from_paths(0, [[3], [2], [0]])            # nodes 1, 2, 3 carry 3, 2, 0
    draft = DraftDistributions(torch.stack([q, q, q, q]), "without_replacement")
    for _ in range(200):
        res = accept_chain([2], torch.stack([p, p]), q[None], g)
        assert res.accepted == () and res.token in (0, 1)
        res = accept_tree(tree, lambda u: p, draft, g)
        assert res.accepted in ((), (3,)) and res.output_tokens(tree)[0] in (0, 1)


def test_residual_guard_when_p_equals_q():
    """p == q leaves no residual mass (exact arithmetic never rejects then); the guard returns
    p without the rejected tokens instead of NaNs."""
    p = torch.tensor([0.25, 0.25, 0.5])
    r = rejection._residual(p, p.clone(), [2])
    assert torch.allclose(r, torch.tensor([0.5, 0.5, 0.0]))
    r = rejection._residual(p, p.clone(), [0, 1, 2])        # everything rejected: p itself
    assert torch.allclose(r, p)
    assert torch.allclose(rejection._residual(p, None, [2]), torch.tensor([0.5, 0.5, 0.0]))


def test_residual_is_normalised_positive_part():
    """The residual is max(0, p - q) renormalised."""
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(rejection._residual(p, q, [1]), torch.tensor([1.0, 0.0, 0.0]))


def test_without_replacement_proposal_renormalises():
    """The i-th sibling is judged against q without the earlier siblings, renormalised."""
    q = torch.tensor([0.5, 0.25, 0.25, 0.0])
    assert rejection._proposal(q, [], True) is q
    assert torch.allclose(rejection._proposal(q, [0], True), torch.tensor([0.0, 0.5, 0.5, 0.0]))
    assert rejection._proposal(q, [0], False) is q


def test_iid_rejects_multi_child_nodes():
    """iid draws are for chains; a node with several children needs without_replacement."""
    tree = TokenTree.from_paths(0, [[1], [2]])
    draft = DraftDistributions(torch.full((3, 4), 0.25), "iid")
    with pytest.raises(ValueError, match="chains"):
        accept_tree(tree, lambda u: torch.full((4,), 0.25), draft, gen(0))


def test_proposal_outside_draft_support_raises():
    """A sampled child whose own q gives it probability 0 cannot have been drawn from q."""
    tree = TokenTree.chain(0, [3])
    draft = DraftDistributions(torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25] * 4]), "iid")
    with pytest.raises(ValueError, match="probability 0"):
        accept_tree(tree, lambda u: torch.full((4,), 0.25), draft, gen(0))


def test_bad_draft_distributions_rejected():
    """Unknown modes, non-2-D probs and a row count unlike the tree's are errors."""
    with pytest.raises(ValueError):
        DraftDistributions(torch.zeros(2, 4), "sampled")
    with pytest.raises(ValueError):
        DraftDistributions(torch.zeros(4), "iid")
    with pytest.raises(ValueError, match="rows"):
        accept_tree(TokenTree.chain(0, [1]), lambda u: torch.full((4,), 0.25),
                    DraftDistributions(torch.full((3, 4), 0.25), "iid"), gen(0))


# ----- reproducibility -------------------------------------------------------------------


def _random_case(seed: int):
    p_tables = make_tables(seed, 2, truncate=True)
    q_tables = make_tables(seed + 1, 2, truncate=False, like=p_tables, mix=0.5)
    return p_tables, q_tables


def test_seeded_runs_reproduce():
    """Same generator seed, same AcceptResult; over many steps different seeds differ."""
    p_tables, q_tables = _random_case(5)
    g = gen(11)
    parents, tokens, flats = propose(q_tables, [3, 2], "wor", g)
    depths = TokenTree(tokens=tokens[0].tolist(), parents=parents).depths
    p_nodes, q_nodes = node_rows(p_tables, flats, depths), node_rows(q_tables, flats, depths)
    runs = {}
    for seed in (1, 1, 2):
        out = []
        for i in range(200):
            tree = TokenTree(tokens=tokens[i].tolist(), parents=parents)
            draft = DraftDistributions(q_nodes[i], "without_replacement")
            out.append(accept_tree(tree, p_nodes[i].__getitem__, draft, gen(seed + 1000 * i)))
        runs.setdefault(seed, []).append(out)
    assert runs[1][0] == runs[1][1]
    assert runs[1][0] != runs[2][0]


def test_accept_chain_equals_accept_tree_on_a_chain():
    """accept_chain is accept_tree on TokenTree.chain: same seed, same result, both with a
    sampled draft and with point masses."""
    p_tables, q_tables = _random_case(8)
    parents, tokens, flats = propose(q_tables, [1, 1], "iid", gen(3))
    depths = (0, 1, 2)
    p_nodes, q_nodes = node_rows(p_tables, flats, depths), node_rows(q_tables, flats, depths)
    for i in range(200):
        tree = TokenTree.chain(ROOT, tokens[i, 1:].tolist())
        for q in (q_nodes[i], None):
            draft = DraftDistributions(q, "iid") if q is not None else None
            a = accept_chain(tokens[i, 1:].tolist(), p_nodes[i], None if q is None else q[:2], gen(i))
            b = accept_tree(tree, p_nodes[i].__getitem__, draft, gen(i))
            assert a == b


def test_empty_chain_samples_target():
    """γ = 0: nothing to accept; the token is drawn from the root's p."""
    p = torch.tensor([[0.0, 1.0, 0.0]])
    assert accept_chain([], p, None, gen(0)) == AcceptResult((), 1)


def test_greedy_token_is_the_first_argmax():
    """The fast argmax (C, or chunked) returns torch.argmax's index, ties included (the first maximum)."""
    from verifier.sampling.sampler import greedy_token
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randint(0, 50, (49152,), generator=g).float()     # many ties at the maximum
        assert greedy_token(x) == int(x.argmax())
    odd = torch.randn(1000, generator=g)                             # not a multiple of the chunk
    assert greedy_token(odd) == int(odd.argmax())
    odd[[400, 700]] = float("nan")                                     # torch: the first NaN
    assert greedy_token(odd) == int(odd.argmax()) == 400

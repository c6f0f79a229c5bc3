"""The cost of a draft tree's grammar masks: xgrammar's `traverse_draft_tree` (what the engine
uses, `verifier/sampling/grammar.py:Matcher.tree_masks`) against walking each path from Python with the
matcher's `accept_token` and `rollback`, and against a fork (a fresh matcher fed the path) per
node.

    python -m bench.grammar_masks --depth 4 --width 1,2,4,8 --repeats 200

The trees sit halfway into the target's own greedy JSON reply to each of the bench's extraction
tasks: a chain of the reply's next `--depth` tokens, each chain node with `--width` - 1 extra
children that the grammar allows there (leaves), as a drafter's top-k would add. All ways
fill the same masks (checked). Microseconds per tree, medians over tasks of medians over
`--repeats` calls.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import xgrammar as xgr

from bench.structured import load_tasks
from spec import LLM, SamplingParams, StructuredOutputs
from tree.token_tree import TokenTree
from verifier.sampling.grammar import Matcher, allowed_tokens


def python_walk(m: Matcher, tree: TokenTree) -> torch.Tensor:
    """Row u = the mask after node u's path; depth first, each child accepted, then rolled back."""
    out = torch.zeros(tree.num_nodes, m.words, dtype=torch.int32)

    def visit(u: int) -> None:
        m._m.fill_next_token_bitmask(out, u)
        for c in tree.children[u]:
            if m._m.accept_token(tree.tokens[c]):
                visit(c)
                m._m.rollback(1)
    visit(0)
    return out


def fork_walk(compiled, history: list[int], tree: TokenTree, vocab_size: int) -> torch.Tensor:
    """Row u from a new matcher fed the request's tokens and u's path (a copy per node)."""
    out = torch.zeros(tree.num_nodes, (vocab_size + 31) // 32, dtype=torch.int32)
    for u in range(tree.num_nodes):
        m = xgr.GrammarMatcher(compiled)
        if all(m.accept_token(t) for t in history + list(tree.path_tokens(u)[1:])):
            m.fill_next_token_bitmask(out, u)
    return out


def draft_tree(m: Matcher, reply: list[int], depth: int, width: int) -> TokenTree:
    """The reply's next `depth` tokens as a chain below its last token, and at each chain node
    `width` - 1 more children the grammar allows there."""
    tokens, parents, at = [reply[0]], [-1], 0            # at: the chain node the next tokens hang from
    for token in reply[1:depth + 1]:
        allowed = allowed_tokens(m.mask(), m.vocab_size)[0].nonzero().flatten().tolist()
        extra = [t for t in allowed if t != token][:width - 1]
        for t in [token, *extra]:
            tokens.append(t)
            parents.append(at)
        at = len(tokens) - 1 - len(extra)
        m.accept(token)
    m._m.rollback(min(depth, len(reply) - 1))
    return TokenTree(tokens, parents)


def per_call_us(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--width", default="1,2,4,8")
    ap.add_argument("--limit", type=int, default=8, help="extraction tasks")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    llm = LLM(max_num_seqs=1)
    backend = llm.engine.grammars
    rows: dict[int, dict[str, list[float]]] = {}
    for task in load_tasks(args.limit):
        structured = StructuredOutputs(json=task.schema)
        out = llm.generate(llm.apply_chat_template(task.messages()),
                           SamplingParams(temperature=0, max_tokens=128, structured=structured))[0].token_ids
        half = len(out) // 2
        m = backend.matcher(structured)
        assert all(m.accept(t) for t in out[:half])
        for width in (int(w) for w in args.width.split(",")):
            tree = draft_tree(m, out[half - 1:], args.depth, width)
            want = m.tree_masks(tree)
            assert torch.equal(python_walk(m, tree), want)
            assert torch.equal(fork_walk(backend.compile(structured), out[:half], tree, m.vocab_size), want)
            cell = rows.setdefault(tree.num_nodes, {"traverse": [], "python": [], "fork": []})
            cell["traverse"].append(per_call_us(lambda: m.tree_masks(tree), args.repeats))
            cell["python"].append(per_call_us(lambda: python_walk(m, tree), args.repeats))
            cell["fork"].append(per_call_us(lambda: fork_walk(backend.compile(structured), out[:half], tree, m.vocab_size),
                                            max(1, args.repeats // 10)))
    print("| tree nodes | traverse_draft_tree us | Python accept/rollback us | fork per node us |\n|---|---|---|---|")
    for nodes, cell in sorted(rows.items()):
        print(f"| {nodes} | " + " | ".join(f"{statistics.median(cell[k]):.0f}" for k in ("traverse", "python", "fork"))
              + " |")


if __name__ == "__main__":
    main()

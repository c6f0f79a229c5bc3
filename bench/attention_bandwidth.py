"""The paged tree-attention kernel's achieved memory bandwidth, and the cost of a tree verify.

    python -m bench.attention_bandwidth                                  # CUDA: Triton, bf16
    python -m bench.attention_bandwidth --shapes llama-3.1-8b --nodes 1,2,4,8,16,32,64   # random weights
    python -m bench.attention_bandwidth --device cpu --backend torch --dtype fp32 --batch 4

(1) One layer of attention shaped like the model (query heads, KV heads, head size) for a
batch of `--batch` sequences, each a `--context`-token cached prefix and a `--tree`-node draft
tree (a random tree: each node's parent is an earlier node). Bytes are what the kernel must
move at least: every sequence's cached K and V once, the new tokens' q, k, v and the output.
Bandwidth = bytes / median time of `--repeats` calls (CUDA events on a GPU).
(2) The target's whole forward for one sequence at a `--context`-token context verifying a
tree of n nodes, n = 1 .. `--max-nodes` (or the `--nodes` list): median ms per forward, the
curve that prices a tree. `--shapes llama-3.1-8b` times a model of that size with random weights
(bench/random_model.py): nothing to carry to a GPU machine but the config.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from bench.random_model import SHAPES, random_target
from tree.token_tree import TokenTree
from verifier.attention import get_backend
from verifier.batch import ForwardBatch, SeqInput
from verifier.model.loader import DEFAULT_MODEL
from verifier.target import TargetModel

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor mask (self included) of a random n-node tree: each node's parent is an earlier node."""
    parents = (-1, *(int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)))
    return TokenTree(tuple(range(n)), parents).ancestor_mask()


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_bandwidth(args, target: TargetModel, device: torch.device, dtype: torch.dtype) -> dict:
    c, bs, gen = target.config, 16, torch.Generator().manual_seed(0)
    per_seq = -(-(args.context + args.tree) // bs)
    seqs = [SeqInput([1] * args.tree, args.context, list(range(b * per_seq, (b + 1) * per_seq)),
                     mask=random_tree(args.tree, gen), logits_indices=list(range(args.tree)))
            for b in range(args.batch)]
    t = args.batch * args.tree
    q = torch.randn(t, c.num_heads, c.head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(t, c.num_kv_heads, c.head_dim, generator=gen).to(device, dtype) for _ in range(2))
    kc, vc = (torch.randn(args.batch * per_seq, bs, c.num_kv_heads, c.head_dim, generator=gen).to(device, dtype)
              for _ in range(2))
    backend = get_backend(args.backend)
    meta = backend.plan(ForwardBatch(seqs), bs, device)
    seconds = timed(lambda: backend.forward(q, k, v, kc, vc, meta, c.head_dim ** -0.5), device, args.repeats)
    item = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * args.batch * (args.context + args.tree) * c.num_kv_heads * c.head_dim * item
    new_bytes = t * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim * item      # q, out, k, v
    return {"us": seconds * 1e6, "bytes": kv_bytes + new_bytes, "gbps": (kv_bytes + new_bytes) / seconds / 1e9}


def verify_curve(args, target: TargetModel, device: torch.device) -> list[tuple[int, float]]:
    bs, gen = 16, torch.Generator().manual_seed(1)
    nodes = node_counts(args)
    target.allocate_kv(-(-(args.context + max(nodes)) // bs) + 1, bs)
    table = list(range(target.kv.num_blocks))
    target.forward(ForwardBatch([SeqInput(list(range(3, 3 + args.context)), 0, table)]))    # the cached prefix
    curve = []
    for n in nodes:
        seq = SeqInput([5] * n, args.context, table, mask=random_tree(n, gen), logits_indices=list(range(n)))
        curve.append((n, timed(lambda: target.forward(ForwardBatch([seq])), device, args.repeats) * 1e3))
    return curve


def node_counts(args) -> list[int]:
    if not args.nodes:
        return list(range(1, args.max_nodes + 1))
    counts = sorted({int(n) for n in args.nodes.split(",")})
    if counts[0] < 1:
        raise SystemExit(f"--nodes: counts must be >= 1, got {args.nodes!r}")
    return counts


def load_target(args, device: torch.device, dtype: torch.dtype) -> TargetModel:
    if args.shapes is None:
        return TargetModel(args.model, device=args.device, dtype=dtype, backend=args.backend, quantization="none")
    return random_target(args.shapes, tempfile.mkdtemp(prefix="tercel-shapes-"), device, dtype, args.backend)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tree", type=int, default=8)
    ap.add_argument("--max-nodes", type=int, default=16)
    ap.add_argument("--nodes", help="comma-separated tree sizes for the verify curve (instead of 1..--max-nodes)")
    ap.add_argument("--shapes", choices=sorted(SHAPES), help="random weights with these shapes instead of --model")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --backend torch --dtype fp32")
    target = load_target(args, device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    k = kernel_bandwidth(args, target, device, dtype)
    model = f"random weights, {args.shapes} shapes" if args.shapes else args.model
    print(f"{name}; {model}; {args.backend} attention, {args.dtype}; {target.config.num_heads} query heads, "
          f"{target.config.num_kv_heads} KV heads, head size {target.config.head_dim}\n")
    print(f"paged tree attention, {args.batch} sequences x ({args.context} cached + {args.tree}-node tree): "
          f"{k['us']:.1f} us, {k['bytes'] / 1e6:.2f} MB, {k['gbps']:.1f} GB/s\n")
    print(f"tree verify, one sequence at a {args.context}-token context (whole forward)\n\n| nodes | ms |\n|---|---|")
    for n, ms in verify_curve(args, target, device):
        print(f"| {n} | {ms:.2f} |")


if __name__ == "__main__":
    main()

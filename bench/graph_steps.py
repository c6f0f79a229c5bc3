"""The target's step time with CUDA graphs off and on: a tree verify of `--rows` rows for each of
`--requests` sequences, each after a `--context`-token cached prefix, logits for every row.

    python -m bench.graph_steps                                   # CUDA: the default model, bf16
    python -m bench.graph_steps --shapes default,llama-3.1-8b --trace step-trace.json.gz
    python -m bench.graph_steps --device cpu --shapes tiny --requests 1,2 --rows 1,4 --context 16 --repeats 1

Per shape, one TargetModel (the default model, or random weights with a `bench/random_model.py`
shape): its KV pool holds the largest point's sequences and the graphs' scratch blocks. Every
(requests, rows) point is timed eagerly; then `TargetModel.use_graphs` captures a CUDA graph per
row bucket (`verifier/graphs/`) and the same points are timed again. A point whose rows do not fit
the buckets (more than `--max-rows` in all, or more than `GraphConfig.max_seq_rows` per sequence)
runs eagerly both times, marked "(eager)". Median of `--repeats` after two warm-ups, CUDA events
on a GPU, perf_counter on the CPU. A line per shape gives the graphs' memory (measured, and
`TargetModel.graph_bytes_estimate`) and at how many graphed points the logits equal the eager ones
bit for bit; on CUDA another the 8B shape's HBM bound (its weights' bytes / `--hbm-gbps`).

`--device cpu` is a dry run of the script, not a timing: the Triton backend under the interpreter
(TRITON_INTERPRET=1, set here when the command line asks for the CPU, before triton is
imported), the fixed-buffer steps run uncaptured (`GraphConfig(cpu_proof=True)`).
"""
from __future__ import annotations

import os
import sys


def _asks_cpu(argv: list[str]) -> bool:
    for i, a in enumerate(argv):
        if a.startswith("--device="):
            return a.split("=", 1)[1].startswith("cpu")
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1].startswith("cpu")
    return False


if __name__ == "__main__" and _asks_cpu(sys.argv[1:]):
    os.environ.setdefault("TRITON_INTERPRET", "1")     # read once, when triton is first imported: below

import argparse  # noqa: E402
import gc  # noqa: E402
import gzip  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from bench.attention_bandwidth import DTYPES, timed  # noqa: E402
from bench.random_model import SHAPES, random_target  # noqa: E402
from tree.token_tree import TokenTree  # noqa: E402
from verifier.batch import ForwardBatch, SeqInput  # noqa: E402
from verifier.graphs.config import GraphConfig  # noqa: E402
from verifier.model.loader import DEFAULT_MODEL  # noqa: E402
from verifier.target import TargetModel  # noqa: E402

BLOCK_SIZE = 16
HBM_SHAPE = "llama-3.1-8b"      # the shape whose HBM bound is printed


@dataclass
class ShapeRun:
    shape: str
    eager_ms: dict[tuple[int, int], float] = field(default_factory=dict)
    graphs_ms: dict[tuple[int, int], float] = field(default_factory=dict)
    graphed: dict[tuple[int, int], bool] = field(default_factory=dict)      # ran from the buckets
    same_logits: dict[tuple[int, int], bool] = field(default_factory=dict)  # graphed points only
    max_diff: float = 0.0
    measured_bytes: int | None = None        # None: uncaptured (the CPU)
    estimate_bytes: int = 0
    buckets: tuple[int, ...] = ()
    weight_bytes: int = 0
    trace_error: str | None = None


def int_list(text: str, flag: str) -> list[int]:
    values = sorted({int(v) for v in text.split(",") if v.strip()})
    if not values or values[0] < 1:
        raise SystemExit(f"{flag}: positive counts, comma-separated; got {text!r}")
    return values


def tree_input(rows: int, context: int, table: list[int], vocab: int, gen: torch.Generator) -> SeqInput:
    """A random tree of `rows` nodes (each node's parent an earlier node, distinct tokens) after
    `context` cached tokens, at its depths' positions, logits for every node."""
    parents = [-1, *(int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, rows))]
    tokens = torch.randperm(vocab, generator=gen)[:rows].tolist()
    tree = TokenTree(tuple(tokens), tuple(parents))
    return SeqInput(tokens, context, table, positions=tree.positions(context), mask=tree.ancestor_mask(),
                    logits_indices=list(range(rows)))


def load_target(shape: str, args, device: torch.device, dtype: torch.dtype) -> TargetModel:
    if shape == "default":
        return TargetModel(args.model, device=str(device), dtype=dtype, backend=args.backend, quantization="none")
    return random_target(shape, tempfile.mkdtemp(prefix="tercel-shapes-"), device, dtype, args.backend)


def step_weight_bytes(target: TargetModel) -> int:
    """What a step reads of the weights: every parameter but an untied input embedding (a
    gather of a few rows)."""
    embed = target.net.model.embed_tokens.weight
    return sum(p.nbytes for p in target.net.parameters() if p is not embed or target.config.tie_word_embeddings)


@contextmanager
def eager_steps(target: TargetModel):
    """Steps run eagerly inside though `use_graphs` was called: the runner without its fixed-buffer
    steps (`DenseRunner.static`) for a while."""
    runner = target.runner
    static, runner.static = runner.static, None
    try:
        yield
    finally:
        runner.static = static


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_trace(path: Path, target: TargetModel, batch: ForwardBatch, device: torch.device) -> None:
    """A chrome trace (gzipped) of one graphed and one eager step of `batch`."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        with record_function("graphed step"):
            target.forward(batch)
            sync(device)
        with record_function("eager step"), eager_steps(target):
            target.forward(batch)
            sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)


def run_shape(shape: str, args, device: torch.device, dtype: torch.dtype, trace: Path | None) -> ShapeRun:
    target = load_target(shape, args, device, dtype)
    config = GraphConfig(max_rows=args.max_rows, cpu_proof=device.type == "cpu")
    requests, rows = args.requests, args.rows
    vocab, gen = target.config.vocab_size, torch.Generator().manual_seed(0)
    per_seq = -(-(args.context + max(rows)) // BLOCK_SIZE)
    seq_blocks, scratch = max(requests) * per_seq, config.scratch_blocks(BLOCK_SIZE)
    target.allocate_kv(seq_blocks + scratch, BLOCK_SIZE)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max(requests))]
    for table in tables if args.context else ():          # the cached prefixes, one forward each
        prompt = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
        target.forward(ForwardBatch([SeqInput(prompt, 0, table)]))
    batches = {(r, n): ForwardBatch([tree_input(n, args.context, tables[i], vocab, gen) for i in range(r)])
               for r in requests for n in rows}
    run = ShapeRun(shape, buckets=config.buckets, estimate_bytes=target.graph_bytes_estimate(config),
                   weight_bytes=step_weight_bytes(target))

    eager_logits = {}
    for point, batch in batches.items():
        run.eager_ms[point] = timed(lambda: target.forward(batch), device, args.repeats) * 1e3
        if point[0] * point[1] <= config.max_rows:        # may run graphed: kept to compare
            eager_logits[point] = target.forward(batch).logits.cpu()

    scratch_ids = list(range(seq_blocks, seq_blocks + scratch))
    measured = target.use_graphs(config, args.context + max(rows), scratch_ids, taps=())
    run.measured_bytes = measured if device.type == "cuda" else None
    static = target.runner.static
    for point, batch in batches.items():
        run.graphed[point] = static.rows_for(batch) is not None
        run.graphs_ms[point] = timed(lambda: target.forward(batch), device, args.repeats) * 1e3
        if run.graphed[point] and point in eager_logits:
            got = target.forward(batch).logits.cpu()
            run.same_logits[point] = torch.equal(got, eager_logits[point])
            run.max_diff = max(run.max_diff, (got - eager_logits[point]).abs().max().item())
    report_shape(run, args, device)           # before the trace, and before the next shape: what is done is printed
    if trace is not None:
        try:
            write_trace(trace, target, batches[(requests[0], rows[0])], device)
        except Exception as e:                # the tables stand without it; main exits 1
            run.trace_error = f"{type(e).__name__}: {e}"
    del target, static, batches, eager_logits
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()              # the next shape loads into what this one held
    return run


def size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def header(args, device: torch.device, dtype_name: str) -> None:
    clock = "CUDA events" if device.type == "cuda" else "perf_counter"
    graphs = "CUDA graphs" if device.type == "cuda" else "fixed-buffer steps, uncaptured (a dry run)"
    print(f"{device_name(device)}; {dtype_name}, {args.backend} attention; a {args.context}-token cached prefix per "
          f"request, a random tree of n rows per request, logits for every row; median of {args.repeats} after 2 "
          f"warm-ups ({clock}); graphs: {graphs}", flush=True)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"


def report_shape(run: ShapeRun, args, device: torch.device) -> None:
    """A shape's lines and then its table: what bench/gpu_check.sh's summary keeps (`figures`:
    tables, and lines with "bit for bit" or "GB/s"), the table last so that no line runs on into it."""
    measured = "uncaptured on the CPU" if run.measured_bytes is None else f"{size(run.measured_bytes)} measured"
    print(f"\n{run.shape}: graphs' memory {measured}, {size(run.estimate_bytes)} estimated ({len(run.buckets)} "
          f"buckets, up to {max(run.buckets)} rows); graphed points' logits equal the eager ones bit for bit at "
          f"{sum(run.same_logits.values())} of {len(run.same_logits)} (max abs diff {run.max_diff:.3g})")
    if device.type == "cuda" and run.shape == HBM_SHAPE:
        print(f"HBM bound, {run.shape}: {run.weight_bytes / 1e9:.2f} GB of weights a step / {args.hbm_gbps:.0f} GB/s "
              f"= {run.weight_bytes / (args.hbm_gbps * 1e9) * 1e3:.2f} ms ({device_name(device)}; --hbm-gbps "
              f"{args.hbm_gbps:g})")
    print("\n| shape | requests | rows/request | eager ms | graphs ms | ratio (eager / graphs) |")
    print("|---|---|---|---|---|---|")
    for (r, n), eager in run.eager_ms.items():
        graphs = run.graphs_ms[(r, n)]
        mark = "" if run.graphed[(r, n)] else " (eager)"
        print(f"| {run.shape} | {r} | {n} | {eager:.2f} | {graphs:.2f}{mark} | {eager / graphs:.2f} |")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="default",
                    help=f"comma-separated: default (--model), or random weights of {', '.join(sorted(SHAPES))}")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the model of the `default` shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--dtype", choices=list(DTYPES), help="default bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--requests", default="1,8,32", type=lambda s: int_list(s, "--requests"),
                    help="sequences per step, comma-separated")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64", type=lambda s: int_list(s, "--rows"),
                    help="tree rows per sequence, comma-separated")
    ap.add_argument("--context", type=int, default=256, help="cached tokens per sequence")
    ap.add_argument("--max-rows", type=int, default=GraphConfig.max_rows, help="GraphConfig.max_rows")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--hbm-gbps", type=float, default=3350.0, help="the card's memory bandwidth (H100 SXM: 3350)")
    ap.add_argument("--trace", type=Path, help="a gzipped chrome trace of one graphed and one eager step at the "
                                               "first point (1 request x 1 row by default), of the last shape")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --shapes tiny (a dry run)")
    if args.backend != "triton":
        raise SystemExit("fixed-buffer steps and CUDA graphs run on the triton attention backend only")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("the triton backend on the CPU needs TRITON_INTERPRET=1 before triton is imported")
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s != "default" and s not in SHAPES]
    if not shapes or unknown:
        raise SystemExit(f"--shapes: default or {', '.join(sorted(SHAPES))}; got {args.shapes!r}")
    header(args, device, dtype_name)
    runs = [run_shape(s, args, device, DTYPES[dtype_name], args.trace if i == len(shapes) - 1 else None)
            for i, s in enumerate(shapes)]
    if (error := runs[-1].trace_error) is not None:
        raise SystemExit(f"--trace: not written: {error}")


if __name__ == "__main__":
    main()

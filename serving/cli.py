"""`tercel` command line: `tercel chat`, `tercel serve` and `tercel bench` (train-drafter is
its own console script).

The entry lives in serving/, not spec/: it dispatches to the server and to bench, and spec/
(the engine core) sits below both. It is the one module of serving/ that may import bench/
(tests/project/test_layers.py); bench/ never imports serving/, so the folder graph stays acyclic."""
from __future__ import annotations

import argparse
import sys
import time

from bench.parser import add_bench_args
from serving.cluster.flags import uses_ray
from serving.flags import (add_graph_args, add_quantization_arg, add_speculation_args, add_tensor_parallel_arg,
                           drafter_name, graph_config, speculation_from_args)
from serving.server import add_serve_args, prepare_serve, run_serve
from spec import LLM, SamplingParams, Submission


def _chat_args(sub) -> None:
    p = sub.add_parser("chat", help="chat with the model in the terminal (one prompt, or a REPL)")
    p.add_argument("prompt", nargs="?", help="one user message; omit for an interactive session")
    p.add_argument("--model", default=None, help="alias, .gguf file or HF directory "
                                                 "(default: smollm2-135m-instruct)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_quantization_arg(p)
    add_tensor_parallel_arg(p)
    add_graph_args(p)
    add_speculation_args(p, None, "speculative drafter: eagle3:PATH, ngram, suffix, small:PATH, tree:SPEC "
                                  "(default: plain decoding)")




def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tercel", description="Tercel: speculative-decoding LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    _chat_args(sub)
    add_serve_args(sub)
    add_bench_args(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "chat":
            return run_chat(args)
        if args.command == "serve":
            return serve(args)
        if args.command == "bench":
            from bench.cli import run_bench   # lazy: `tercel serve` and `chat` load no benchmark
            return run_bench(args)
    except ValueError as e:
        print(f"tercel: error: {e}", file=sys.stderr)
        return 2
    return 0


def run_chat(args) -> int:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    drafter = drafter_name(args.drafter)
    speculation = speculation_from_args(drafter, args.gamma, args.topk, args.budget)
    print("loading model...", file=sys.stderr, flush=True)
    llm = LLM(args.model, drafter=drafter, speculation=speculation, quantization=args.quantization,
              tensor_parallel_size=args.tensor_parallel_size, graphs=graph_config(args),
              **({"num_threads": args.threads} if args.threads else {}))
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        _turn(llm, history, args.prompt, params)
        return 0
    print("tercel chat: type a message; /reset clears the history, Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
        elif line:
            _turn(llm, history, line, params)


def _turn(llm, history: list[dict], user: str, params) -> None:
    """Stream one assistant reply to stdout, then tokens/s to stderr."""
    history.append({"role": "user", "content": user})
    engine = llm.engine
    rid = f"chat-{len(history)}"
    start = time.perf_counter()
    engine.add_request(rid, Submission(llm.apply_chat_template(history), params))
    out = None
    while engine.has_unfinished:
        for out in engine.step():
            print(out.delta_text, end="", flush=True)
    elapsed = time.perf_counter() - start
    print()
    history.append({"role": "assistant", "content": out.text})
    n = len(out.token_ids)
    accepted = (f", mean accepted length {out.stats.mean_accepted_length:.2f}"
            if out.stats.verify_steps else "")
    print(f"[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s, "
          f"time to first token {out.ttft * 1000:.0f} ms{accepted}, finish: {out.finish_reason}]",
          file=sys.stderr)


def serve(args) -> int:
    """`tercel serve`: one process, or replicas behind Ray Serve (--replicas, where Ray is there)."""
    prepare_serve(args)
    if uses_ray(args):
        from serving.cluster.replicas import run_replicas   # lazy: Ray is the optional tercel[cluster]
        return run_replicas(args)
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())

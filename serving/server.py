"""`tercel serve`: load the model, start the engine thread, serve HTTP with uvicorn."""
from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path

import torch
import uvicorn
from sse_starlette.sse import AppStatus

from serving.app import ServerConfig, build_app
from serving.bridge import EngineBridge, debug_from_env
from serving.cluster.flags import add_replica_args
from serving.defaults import load_sampling_defaults
from serving.flags import (add_graph_args, add_lora_args, add_quantization_arg, add_speculation_args,
                           add_tensor_parallel_arg, drafter_name, graph_config, lora_serving, speculation_from_args)
from serving.limits import ServerLimits
from serving.metrics import Metrics
from serving.reasoning import REASONING_PARSERS
from serving.responses.store import StoreLimits
from serving.shutdown import BACKSTOP_S, GracefulServer, signals_resent_as_no_ops
from serving.tools.formats import FORMATS
from spec.adaptive import AdaptiveConfig
from spec.batch_guard import GuardConfig
from spec.config import EngineConfig
from spec.engine import LLMEngine, freeze_loaded_objects
from spec.profile import load_profile
from spec.threads import ThreadConfig
from verifier.model.loader import DEFAULT_MODEL
from verifier.memory import available_bytes
from verifier.sampling.grammar_limits import GrammarLimits

log = logging.getLogger("tercel.serve")
# Suffix decoding: a lookup (no model or corpus to load), at or above n-gram on each Spec-Bench task
# under the cost model (docs/performance.md, "On an AMD EPYC (Zen 4)"); `make serve` runs the same.
DEFAULT_DRAFTER = "suffix"


def add_serve_args(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with speculative decoding")
    p.add_argument("--model", default=DEFAULT_MODEL, help="alias, .gguf file or HF directory")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients send as \"model\" (the first is reported); default: --model and its last part")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file replacing the model's")
    p.add_argument("--generation-config", default="auto", metavar="auto|none|DIR",
                   help="sampling defaults for fields a request leaves out, from the model's generation_config.json "
                        "(auto), another folder's, or none")
    add_speculation_args(p, DEFAULT_DRAFTER, "suffix (default), ngram, eagle3:PATH, small:PATH, tree:SPEC, or 'none'")
    p.add_argument("--no-adaptive", action="store_true",
                   help="every request verifies its drafter's whole tree every step, whatever it costs")
    p.add_argument("--no-batch-guard", action="store_true",
                   help="draft at every batch size, even where speculation's measured steps cost more per "
                        "token than plain ones")
    p.add_argument("--no-jump-forward", action="store_true",
                   help="constrained requests sample the tokens their grammar forces one step each")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks in the pool")
    p.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="size the KV pool as this fraction of the device's memory (instead of --kv-blocks)")
    p.add_argument("--api-key", default=os.environ.get("TERCEL_API_KEY"), help="require Bearer auth")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    add_limit_args(p)
    add_lora_args(p)
    p.add_argument("--profile", default=None, help="a tuned profile from `tercel bench grid` (JSON)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds to finish requests on SIGTERM (30: what Kubernetes waits before it kills)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads at most (default: the affinity mask's CPUs or the cgroup's CPU quota)")
    p.add_argument("--fixed-threads", action="store_true",
                   help="every step on --threads; by default steps run on fewer while that measures faster")
    add_quantization_arg(p)
    add_tensor_parallel_arg(p)
    add_graph_args(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_replica_args(p)


def add_limit_args(p) -> None:
    """What one request may ask (serving/limits.py; docs/serving.md, "Limits")."""
    d = ServerLimits()
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="request body size (413 above)")
    p.add_argument("--max-stop", type=int, default=d.max_stop, help="stop strings per request")
    p.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars, help="characters per stop string")
    p.add_argument("--stream-buffer", type=int, default=d.stream_buffer,
                   help="outputs a stream holds unread before its client is dropped and its request aborted")
    p.add_argument("--send-timeout", type=float, default=d.send_timeout_s,
                   help="seconds one SSE write may block before the client is dropped")
    g = GrammarLimits()
    p.add_argument("--grammar-timeout", type=float, default=10.0,
                   help="seconds a constraint may take to compile (in a child process, killed past it)")
    p.add_argument("--max-grammar-bytes", type=int, default=g.max_bytes, help="size of a schema, pattern or grammar")
    p.add_argument("--max-grammar-depth", type=int, default=g.max_depth,
                   help="nesting of a JSON schema, or of a regular expression's groups")
    p.add_argument("--grammar-cache-bytes", type=int, default=g.cache_bytes,
                   help="compiled grammars kept (LRU), and as much again for xgrammar's own cache")
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="read special-token text in chat messages as tokens (lets a client forge turns)")
    p.add_argument("--logprobs-mode", default="raw", choices=["raw", "processed"],
                   help="logprobs of the forward's logits (raw, vLLM's default) or of the distribution sampled "
                        "from (processed: penalties, temperature, truncation)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split the model's <think> block out of the reply as reasoning_content (docs/serving.md, "
                        "\"Reasoning\"); a constraint then holds only what follows the block")
    p.add_argument("--tool-call-parser", default="hermes", choices=sorted(FORMATS),
                   help="how the model writes tool calls (docs/tools.md); the chat template's own tools "
                        "rendering is used where it has one")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated origins browser clients may call from (CORS); '*' for any; off by default")
    r = StoreLimits()
    p.add_argument("--responses-max-stored", type=int, default=r.max_stored,
                   help="responses kept in memory for previous_response_id and GET /v1/responses/{id}, the oldest "
                        "dropped first (0: none)")
    p.add_argument("--responses-ttl", type=float, default=r.ttl_s, help="seconds a stored response is kept")


def grammar_limits(args):
    return GrammarLimits(max_bytes=args.max_grammar_bytes, max_depth=args.max_grammar_depth,
                         cache_bytes=args.grammar_cache_bytes, xgrammar_cache_bytes=args.grammar_cache_bytes,
                         timeout_s=args.grammar_timeout)


def server_limits(args):
    return ServerLimits(max_body_bytes=args.max_body_bytes, max_stop=args.max_stop,
                        max_stop_chars=args.max_stop_chars, stream_buffer=args.stream_buffer,
                        send_timeout_s=args.send_timeout)


def parse_serve_args(argv: list[str]):
    """`tercel serve` flags as a namespace: how a Ray Serve replica rebuilds its engine's settings."""
    parser = argparse.ArgumentParser(prog="tercel serve")
    add_serve_args(parser.add_subparsers(dest="command"))
    args, unknown = parser.parse_known_args(["serve", *argv])
    if unknown:     # a Serve config's typo, named (argparse would exit the replica)
        raise ValueError(f"not a `tercel serve` flag: {' '.join(unknown)}")
    return args


def engine_config(args):
    drafter, gamma, topk, budget = args.drafter, args.gamma, args.topk, args.budget
    profiled = None
    if args.profile:       # the profile's drafter and tree; explicit tree flags still apply
        choice = load_profile(args.profile)
        drafter, profiled = choice.drafter, choice.speculation
    drafter = drafter_name(drafter)
    spec = speculation_from_args(drafter, gamma, topk, budget) or profiled
    kv = {}
    if args.kv_blocks:
        kv["num_kv_blocks"] = args.kv_blocks
    elif args.kv_memory_fraction:
        if not 0 < args.kv_memory_fraction < 1:
            raise ValueError(f"--kv-memory-fraction must be in (0, 1), got {args.kv_memory_fraction}")
        kv["kv_cache_bytes"] = int(_device_memory() * args.kv_memory_fraction)
    lora = lora_serving(args)
    return EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        drafter=drafter, speculation=spec, num_threads=args.threads,
                        thread_tuning=ThreadConfig(adaptive=not args.fixed_threads),
                        quantization=args.quantization, jump_forward=not args.no_jump_forward,
                        grammar=grammar_limits(args),
                        tensor_parallel_size=args.tensor_parallel_size, graphs=graph_config(args),
                        adaptive=AdaptiveConfig(enabled=not args.no_adaptive,
                                                guard=GuardConfig(enabled=not args.no_batch_guard)),
                        logprobs_mode=args.logprobs_mode, lora_modules=lora.modules,
                        draft_lora_modules=lora.draft_modules,
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, lora_dtype=args.lora_dtype, **kv)


def _device_memory() -> int:
    """Free memory where the pool will live: the GPU's, or on a CPU what the machine and the
    process's cgroup (a container's limit) leave (`verifier.memory.available_bytes`)."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    free = available_bytes()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") if free is None else free


def launch_app(args):
    """The engine (loaded on its own thread) and the app serving it: (EngineBridge, FastAPI).
    One `tercel serve` process has one; so has each Ray Serve replica (serving/cluster/replicas.py)."""
    config = engine_config(args)
    limits = server_limits(args)
    app_config = server_config(args, limits)      # before the load: a bad flag costs no model load
    log.info("loading %s (drafter: %s)", config.model, config.drafter or "none")
    bridge = EngineBridge.launch(lambda: LLMEngine(config), Metrics(), max_queue=args.max_queue,
                                 check_integrity_when_idle=args.log_level == "debug" or debug_from_env(),
                                 stream_buffer=limits.stream_buffer)
    freeze_loaded_objects()
    return bridge, build_app(bridge, app_config)


def server_config(args, limits):
    """The app's settings from the flags; the chat template and the sampling defaults are read
    here, so a missing file or a bad value stops the server before it listens."""
    names = tuple(args.served_model_name or dict.fromkeys((args.model, Path(args.model).name)))
    lora = lora_serving(args)
    if clash := sorted({name for name, _ in lora.modules} & set(names)):
        raise ValueError(f"--lora-modules name {clash[0]!r} is the served model's name; give the adapter another")
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    defaults = load_sampling_defaults(args.generation_config, args.model)
    log.info("%s; requests that leave a field out get it", defaults.describe())
    return ServerConfig(model_names=names, api_key=args.api_key, limits=limits, allowed_origins=origins,
                        special_tokens_in_content=args.allow_special_tokens_in_content,
                        tool_format=FORMATS[args.tool_call_parser], chat_template=chat_template(args.chat_template),
                        reasoning=REASONING_PARSERS.get(args.reasoning_parser),
                        sampling_defaults=defaults, lora=lora,
                        responses=StoreLimits(args.responses_max_stored, args.responses_ttl))


def chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--chat-template {path}: {e.strerror or e}") from None


def prepare_serve(args) -> None:
    """What `tercel serve` checks and sets up before it serves, in one process or as replicas."""
    if args.grace < 0:
        raise ValueError(f"--grace must be >= 0 seconds, got {args.grace}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without --api-key (or TERCEL_API_KEY): anyone who reaches it can use it",
                    args.host)


def run_serve(args) -> int:
    """Serve from this process until SIGTERM or SIGINT (`prepare_serve` first)."""
    bridge, app = launch_app(args)

    # SIGTERM: uvicorn stops accepting and waits for open requests. sse-starlette would cut
    # streams at once; let them run until the grace is over instead (GracefulServer).
    AppStatus.disable_automatic_graceful_drain()

    @app.on_event("shutdown")
    def _stop():
        bridge.shutdown(1.0)   # connections are closed by now; abort anything left

    http = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          timeout_graceful_shutdown=math.ceil(args.grace) + BACKSTOP_S)
    server = GracefulServer(http, bridge, args.grace)
    log.info("serving on http://%s:%d", args.host, args.port)
    with signals_resent_as_no_ops():
        server.run()
    return 0 if server.started else 1

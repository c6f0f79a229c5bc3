"""Command-line flags that `tercel serve` and `tercel chat` share: the drafter and its tree,
the CPU weights, tensor parallelism, CUDA graphs, LoRA adapters. Kept free of torch so that `--help` stays quick."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from drafters.kinds import default_speculation
from spec.config import QUANTIZATION_CHOICES
from verifier.graphs.config import GraphConfig
from verifier.model.lora import DEFAULT_MAX_LORAS, DEFAULT_MAX_RANK


def add_speculation_args(p, default_drafter: str | None, drafter_help: str) -> None:
    p.add_argument("--drafter", default=default_drafter, help=drafter_help)
    p.add_argument("--gamma", type=int, default=None, help="speculation depth (default: the drafter's)")
    p.add_argument("--topk", type=int, default=None, help="children per draft node (1 = a chain)")
    p.add_argument("--budget", type=int, default=None, help="draft nodes per request per step")


def drafter_name(arg: str | None) -> str | None:
    """The --drafter value as the engine takes it: None for plain decoding ('none' or empty)."""
    return None if arg in (None, "", "none") else arg


def add_quantization_arg(p) -> None:
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                   help="CPU weights: int4 or int8 kernels, gguf (each GGUF tensor on its own blocks), none "
                        "(dense fp32), or auto (default: int4 for a Q4 GGUF such as the default model, gguf for "
                        "other quantized GGUFs such as Q4_K_M, none for HF checkpoints and CUDA)")


def add_tensor_parallel_arg(p) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the target over N devices (N GPUs with NCCL; N processes with gloo on CPU); "
                        "dense weights only: with N > 1, --quantization auto picks none")


def add_graph_args(p) -> None:
    p.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run every step eagerly instead of replaying CUDA graphs captured at load")
    p.add_argument("--cuda-graph-max-rows", type=int, default=GraphConfig.max_rows, metavar="N",
                   help="the largest step (new rows, padded to 1, 2, 4, ... N) a CUDA graph is captured for; "
                        f"larger steps and prompt chunks run eagerly (default {GraphConfig.max_rows})")


def graph_config(args) -> GraphConfig:
    return GraphConfig(enabled=not args.enforce_eager, max_rows=args.cuda_graph_max_rows)


def speculation_from_args(drafter: str | None, gamma: int | None, topk: int | None, budget: int | None):
    """None when no tree option is given (the drafter's tuned default); else that default
    with the given fields replaced."""
    if gamma is None and topk is None and budget is None:
        return None
    base = default_speculation(drafter)
    given = {k: v for k, v in (("num_speculative_tokens", gamma), ("topk", topk)) if v is not None}
    if budget is not None or given:
        given["budget"] = budget      # a budget tuned for the default shape does not carry over
    return replace(base, **given)


@dataclass(frozen=True)
class LoraServing:
    """The adapters served from the start, and whether (and from where) more may be loaded."""
    modules: tuple[tuple[str, str], ...] = ()
    draft_modules: tuple[tuple[str, str], ...] = ()     # the drafter's own, by served name
    allow_runtime: bool = False
    root: Path | None = None          # runtime adapters only from under it (resolved)


def add_lora_args(p) -> None:
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served under their own model names")
    p.add_argument("--draft-lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="the drafter's own for a served adapter NAME: a small: model's LoRA adapter, an eagle3 head "
                        "trained on the adapted model (others draft for the base)")
    p.add_argument("--max-loras", type=int, default=DEFAULT_MAX_LORAS, help="adapters loaded at once at most")
    p.add_argument("--max-lora-rank", type=int, default=DEFAULT_MAX_RANK, help="the largest rank an adapter may have")
    p.add_argument("--lora-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="adapters' weights as held: bfloat16 halves what a step reads per adapter")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --lora-root)")
    p.add_argument("--lora-root", default=None, metavar="DIR", help="runtime adapters load from under it only")


def lora_serving(args) -> LoraServing:
    """The flags checked: a bad one stops the server before the model loads."""
    modules, drafts = _named_paths("--lora-modules", args.lora_modules), \
        _named_paths("--draft-lora-modules", args.draft_lora_modules)
    if args.allow_runtime_lora and not args.lora_root:
        raise ValueError("--allow-runtime-lora needs --lora-root: the folder runtime adapters load from")
    root = Path(args.lora_root) if args.lora_root else None
    if root is not None and not root.is_dir():
        raise ValueError(f"--lora-root {root} is not a folder")
    return LoraServing(modules, drafts, args.allow_runtime_lora, root)


def _named_paths(flag: str, items: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{flag} takes NAME=PATH, got {item!r}")
        pairs.append((name, path))
    if len({n for n, _ in pairs}) != len(pairs):
        raise ValueError(f"{flag} names an adapter twice")
    return tuple(pairs)

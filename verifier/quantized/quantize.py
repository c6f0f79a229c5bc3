"""Serve a loaded Llama on quantized CPU kernels: `quantization=` one of `verifier.quantized.modes.MODES`.

What each weight becomes (the model file's own weights wherever a kernel can take them):

| weight | int4 | int8 | gguf |
|---|---|---|---|
| projections, GGUF Q4_0 / Q4_1 / Q4_K | the file's blocks (group 32; Q4_K with its own scales) | requantized per channel | the file's blocks |
| projections, GGUF Q5_0 / Q6_K / Q8_0 | requantized, int4 groups of 32 | the file's blocks | the file's blocks |
| projections, dense (HF, F16/F32; GGUF kinds read dense) | int4 groups of 32 | per channel | int8 groups of 32 |
| embedding | the file's blocks; a dense table as int8 blocks of 32 (as Q8_0) | the same | the same |
| LM head | scan: the head requantized to int4 groups; rescoring: its file blocks | scan: int8 | as int4 |
| MoE router (Mixtral, Qwen3-MoE) | int8, its own kernel for every row | the same | the same |

`gguf` serves each tensor in its own format, as llama.cpp does: a Q4_K_M file mixes Q4_K with
Q6_K, Q5_0 and Q8_0, which csrc/q4k_matmul.c and csrc/q8_matmul.c take respectively. Parts
of one fused projection stored in several formats keep theirs, in one call (`_fused`,
csrc/mixed_matmul.c); where that kernel is not built they share the more precise one (`_one_form`).

Each expert's projections are decoder projections like the dense MLP's (`verifier/model/moe.py`).

A load reads the file one tensor at a time and keeps no dense copy (`quantize_model`): the first
layer is packed for every kernel that takes it and timed (`tune`), the others for the chosen
kernel only, on a thread pool, Q4_0, Q4_1, Q4_K and Q6_K blocks (and fused projections mixing
them) packed by csrc/repack.c straight from the file's bytes
(`verifier/quantized/own_kernels/from_file.py`), the LM head's table and scan likewise.

The LM head is a `RescoredHead`: torch's kernels cannot take the default GGUF's Q8_0 head
as it is (the int8 kernel has one scale per output channel, Q8_0 one per 32 weights), and
a requantized head alone loses top-1 agreement on held-out text. So a requantized copy scans the
vocabulary and the 32 best candidates are rescored with the file's weights in fp32: the
exact head's agreement at the scan's cost. The figures and the command that measures
them are in docs/quantization.md.
"""
from __future__ import annotations

import hashlib
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from verifier.cpu import cpu_ops
from verifier.model.config import ModelConfig
from verifier.model.gguf_blocks import INT4_NATIVE
from verifier.model.gguf_quant import INDEX_FILE, QuantizedTensors, read_quantized
from verifier.model.moe import CHECKPOINT_NAMES, SparseMoeBlock, block_prefix
from verifier.model.quant import (Int4KWeight, Int4Weight, Int8KWeight, Int8Weight, KQuantWeight, QuantWeight,
                                  StackedWeight, concat_rows, quantize_int8)
from verifier.model.weights import checkpoint, param_sources
from verifier.quantized.modes import MODES, Q8_GROUP, REGISTRY
from verifier.quantized.own_kernels import mixed
from verifier.quantized.own_kernels import from_file
from verifier.quantized import plan_memo
from verifier.quantized.own_kernels.base import Packed
from verifier.quantized.own_kernels.q8x16 import q8_bits
from verifier.quantized.matmul_paths import KernelPlan, KernelTimings, choosable_owns, load_or_time, time_paths
from verifier.quantized.qlinear import QuantEmbedding, QuantLinear, RescoredHead

log = logging.getLogger("tercel.quantize")
QUANTIZATIONS = (*MODES, "none")
SCAN_ROWS = 8192      # head rows converted at once for its scan
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def auto_quantization(model_dir: Path, device: torch.device) -> str:
    """The fastest setting that keeps the file's weights: int4 for a GGUF whose decoder is all
    in formats of int4 form (`INT4_NATIVE`: Q4_0, Q4_1, Q4_K), gguf (each tensor on its own
    blocks) for other quantized GGUFs where the integer kernels are built (AVX2 or AVX-512
    VNNI), else int8 for one with Q8_0 blocks; dense checkpoints, CUDA, and machines where the
    fused CPU kernels cannot be built (no C compiler) stay unquantized."""
    index = Path(model_dir) / INDEX_FILE
    if device.type != "cpu" or not index.is_file() or not cpu_ops.available():
        return "none"
    meta = json.loads(index.read_text())
    kinds = {t["kind"] for t in meta["tensors"] if t["name"].startswith("blk.")}
    if kinds and kinds <= INT4_NATIVE and not meta.get("other_kinds"):
        return "int4"
    if kinds and cpu_ops.q4_isa() > 0:
        if meta.get("other_kinds"):
            log.info("decoder weights stored as %s have no kernel of their own: dequantized, then served as "
                     "int8 blocks of 32", ", ".join(meta["other_kinds"]))
        return "gguf"
    return "int8" if "Q8_0" in kinds else "none"


def check_quantization(mode: str, device: torch.device) -> None:
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode != "none" and device.type != "cpu":
        raise ValueError(f"quantization {mode!r} runs on CPU kernels; on {device.type} use 'none'")
    if mode != "none" and not cpu_ops.available():
        raise ValueError(f"quantization {mode!r} needs Tercel's fused CPU kernels, which are compiled on "
                         "first use and could not be (is a C compiler, cc or gcc, installed?)")


def file_blocks(model_dir: Path) -> Mapping[str, QuantWeight]:
    """The GGUF's quantized tensors by HF name, each read when asked for ({}: not a GGUF)."""
    index = Path(model_dir) / INDEX_FILE
    return read_quantized(json.loads(index.read_text()), _hf_config(model_dir)) if index.is_file() else {}


def block_params(model_dir: Path, model_type: str) -> frozenset[str]:
    """The model's parameters whose every checkpoint tensor is in the file's blocks: `quantize_model`
    serves them from those, so they are never loaded dense."""
    blocks = file_blocks(model_dir)
    if not blocks:
        return frozenset()
    sources = param_sources(checkpoint(model_dir).names(), model_type)
    return frozenset(p for p, names in sources.items() if names <= blocks.keys())


def quantize_model(net: nn.Module, cfg: ModelConfig, mode: str, model_dir: Path,
                   choose: Callable[[list[QuantLinear], QuantLinear], KernelPlan],
                   known: KernelPlan | None = None) -> tuple[list[QuantLinear], KernelPlan]:
    """Swap the decoder's Linears, the LM head and the embedding of `net` for quantized modules,
    one layer at a time, each weight read from the file (or the loaded dense weight) just before it
    is packed. The first layer and a probe of the head's scan (`_scan_probe`) offer every own
    kernel; `choose` picks the plan on them (timing them, or reading this machine's timings), and
    the other layers and the head are packed for the chosen kernel only. Returns the decoder's
    QuantLinears and the plan. With `known` (an earlier load's plan, `plan_memo.recall`) the first
    layer is packed for it like the others and `choose` is not called."""
    if cfg.head_dim % 16 or cfg.head_dim > 256:
        raise ValueError(f"quantization {mode!r} needs a head size that is a multiple of 16 and at most 256 "
                         f"(the fused decode kernels), got {cfg.head_dim}; use 'none'")
    blocks = file_blocks(model_dir)
    # numpy's and torch's unpacking release the GIL: the head and the layers read and pack side by side
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        decoder = _quantize_layer(net.model.layers[0], 0, cfg, blocks, mode, known)
        plan = known or choose(decoder, _scan_probe(net, cfg, blocks, mode))
        ends = pool.submit(_quantize_ends, net, cfg, blocks, mode, plan)
        rest = list(enumerate(net.model.layers))[1:]
        for built in pool.map(lambda il: _quantize_layer(il[1], il[0], cfg, blocks, mode, plan), rest):
            decoder += built
        ends.result()
    return decoder, plan


def _quantize_layer(layer: nn.Module, i: int, cfg: ModelConfig, blocks: Mapping, mode: str,
                    plan: KernelPlan | None) -> list[QuantLinear]:
    """Layer `i`'s projections as QuantLinears (packed for `plan`'s kernel; None: every kernel)."""
    moe = isinstance(layer.mlp, SparseMoeBlock)
    out = []
    for block, name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                        *(() if moe else (("mlp", "gate_up_proj"), ("mlp", "down_proj")))):
        parent = getattr(layer, block)
        dense = getattr(parent, name)
        setattr(parent, name, _served(blocks, f"model.layers.{i}.{block}", name, dense, mode, plan))
        out.append(getattr(parent, name))
    if moe:
        out += _quantize_experts(layer.mlp, blocks, cfg.model_type, i, mode, plan)
    return out


def _served(blocks: Mapping, prefix: str, name: str, dense: nn.Module, mode: str, plan: KernelPlan | None,
            parts: tuple[str, ...] | None = None) -> QuantLinear:
    """One projection as a QuantLinear: packed straight from the file's bytes where it can be
    (`_from_file`), else read into its served form and packed from that."""
    fast = _from_file(blocks, prefix, name, mode, plan, dense.bias, parts)
    return fast or _planned(_projection(blocks, prefix, name, dense.weight, mode, parts), dense.bias, plan)


def _from_file(blocks: Mapping, prefix: str, name: str, mode: str, plan: KernelPlan | None,
               bias: torch.Tensor | None, parts: tuple[str, ...] | None = None) -> QuantLinear | None:
    """The projection packed from the file's bytes by csrc/repack.c (`own_kernels.from_file`: the
    same bytes in a fraction of the time) where its parts lie in formats it packs; else None."""
    if plan is None or mode not in ("int4", "gguf") or not isinstance(blocks, QuantizedTensors) \
            or not (cpu_ops.available() and cpu_ops.q4_isa() > 0):
        return None
    fused = f"{prefix}.{name}.weight"
    names = [fused] if fused in blocks else [f"{prefix}.{p}.weight" for p in parts or _FUSED.get(name, (name,))]
    if not all(n in blocks for n in names):
        return None
    rows = [blocks.file_rows(n) for n in names]
    if len({r.cols for r in rows}) != 1 or (made := from_file.packed(rows, mode, plan.own)) is None:
        return None
    own, packed = made
    return QuantLinear.from_packed((sum(r.address.shape[0] for r in rows), rows[0].cols), bias, plan, own, packed)


def _planned(weight: QuantWeight, bias: torch.Tensor | None, plan: KernelPlan | None) -> QuantLinear:
    """Packed for the plan's kernel (its first where it does not take the weight); no plan: for every kernel."""
    return QuantLinear(weight, bias, plan, own=plan and plan.own)


def _quantize_ends(net: nn.Module, cfg: ModelConfig, blocks: Mapping, mode: str, plan: KernelPlan) -> RescoredHead:
    """The embedding and the LM head (a scan on the plan's kernel, and the exact table)."""
    if not cfg.tie_word_embeddings and (looked_up := _q4k_embedding(blocks)) is not None:
        net.model.embed_tokens = looked_up              # no head to scan in it: read in its table's form
    else:
        embed = _table(_file_table(blocks, "model.embed_tokens.weight"), net.model.embed_tokens.weight)
        net.model.embed_tokens = QuantEmbedding(embed)
    head = embed if cfg.tie_word_embeddings else _table(_file_table(blocks, "lm_head.weight"), net.lm_head.weight)
    table = net.model.embed_tokens if cfg.tie_word_embeddings else QuantEmbedding(head)
    net.lm_head = RescoredHead(_scan(head, mode, plan), table)
    return net.lm_head


def _file_table(blocks: Mapping, name: str) -> QuantWeight | None:
    """The file's tensor `name` (None: not a block tensor), Q6_K unpacked into its int8 form by
    csrc/repack.c where it is built (numpy's unpacking took seconds for a large vocabulary)."""
    if name not in blocks:
        return None
    if isinstance(blocks, QuantizedTensors) and blocks.kind(name) == "Q6_K" and cpu_ops.available():
        rows = blocks.file_rows(name)
        return Int8Weight(*cpu_ops.unpack_q6k(torch.from_numpy(rows.address), rows.cols))
    return blocks[name]


def _q4k_embedding(blocks: Mapping) -> QuantEmbedding | None:
    """The embedding table of a file storing it as Q4_K, unpacked by csrc/repack.c into the
    table's form (q two to a byte) without the served form's byte a weight between (half a GB
    for a 128k-token vocabulary); None for other formats or where the library is not built."""
    name = "model.embed_tokens.weight"
    if not (isinstance(blocks, QuantizedTensors) and name in blocks and blocks.kind(name) == "Q4_K"
            and cpu_ops.available()):
        return None
    rows = blocks.file_rows(name)
    fields = cpu_ops.unpack_q4k_table(torch.from_numpy(rows.address), rows.cols)
    return QuantEmbedding.from_fields(Int4KWeight, (rows.address.shape[0], rows.cols), fields)


def _scan(head: QuantWeight, mode: str, plan: KernelPlan) -> QuantLinear:
    """The head's scan on the plan's kernel: an int8 table requantized to int4 and packed for
    q4x16 in one pass by csrc/repack.c where the plan took q4x16 (the same bytes), else
    converted in chunks (`_scan_weight`) and packed."""
    if REGISTRY[mode].scan == "int4" and plan.own == "q4x16" and isinstance(head, Int8Weight) \
            and head.group in (16, 32) and head.shape[1] % 32 == 0 and cpu_ops.available():
        packed = Packed((cpu_ops.scan_int4_from_int8(head.q.contiguous(), head.scale.contiguous()), head.shape[0]), 4)
        return QuantLinear.from_packed(head.shape, None, plan, "q4x16", packed)
    return _planned(_scan_weight(head, REGISTRY[mode].scan), None, plan)


def _scan_probe(net: nn.Module, cfg: ModelConfig, blocks: Mapping, mode: str) -> QuantLinear:
    """The head's first SCAN_ROWS rows in the scan's form, on every kernel that takes them: the plan
    times the scan on these (its kernels' cost per row is the same over the whole vocabulary),
    so that the head itself is read and packed once, beside the layers, for the kernel chosen."""
    name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    dense = net.model.embed_tokens.weight if cfg.tie_word_embeddings else net.lm_head.weight
    rows = blocks.rows(name, SCAN_ROWS) if name in blocks else None
    return QuantLinear(_to_mode(_table(rows, None if rows is not None else dense[:SCAN_ROWS]), REGISTRY[mode].scan),
                       None, None)


def _scan_weight(head: QuantWeight, mode: str) -> QuantWeight:
    """The head in the form that scans the vocabulary (it picks candidates: see RescoredHead),
    converted SCAN_ROWS rows at a time: a whole fp32 copy of a 128k-token head takes gigabytes."""
    first = _rows(head, 0, SCAN_ROWS)
    if _to_mode(first, mode) is first:              # served as it is
        return _to_mode(head, mode)
    return concat_rows([_to_mode(_rows(head, i, i + SCAN_ROWS), mode) for i in range(0, head.shape[0], SCAN_ROWS)])


def _rows(w: QuantWeight, start: int, stop: int) -> QuantWeight:
    return type(w)(*(getattr(w, f.name)[start:stop] for f in fields(w)))


def _quantize_experts(moe: SparseMoeBlock, blocks: Mapping, model_type: str, layer: int, mode: str,
                      plan: KernelPlan | None) -> list[QuantLinear]:
    """Each expert's projections in `mode` (the file's blocks where they fit), returned for the
    plan; the router as int8 per channel: its own kernel serves every row alike, so a token's
    routing never depends on the rows beside it, and int8 keeps near-ties as the file has them."""
    prefix = block_prefix(model_type, layer)
    moe.gate = QuantLinear(_projection(blocks, prefix, "gate", moe.gate.weight, "int8"), None, None)
    gate, up, down = CHECKPOINT_NAMES[model_type][1]
    out = []
    for e, expert in enumerate(moe.experts):
        for name, parts in (("gate_up_proj", (gate, up)), ("down_proj", (down,))):
            setattr(expert, name, _served(blocks, f"{prefix}.experts.{e}", name, getattr(expert, name), mode, plan,
                                          parts))
            out.append(getattr(expert, name))
    return out


def _hf_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _projection(blocks: dict, prefix: str, name: str, dense: torch.Tensor, mode: str,
                parts: tuple[str, ...] | None = None) -> QuantWeight:
    """`parts`: the file's names of the pieces fused into `name` (default: HF's, `_FUSED`)."""
    if f"{prefix}.{name}.weight" in blocks:              # a file that stores it fused (Phi-3)
        return _to_mode(blocks[f"{prefix}.{name}.weight"], mode)
    parts = [blocks.get(f"{prefix}.{p}.weight") for p in parts or _FUSED.get(name, (name,))]
    if all(p is not None for p in parts):
        return _fused([_to_mode(p, mode) for p in parts])
    return _to_mode(dense.detach(), mode)


def _fused(parts: list[QuantWeight]) -> QuantWeight:
    """One weight of a fused projection's parts: consecutive parts in one layout (form, group
    and, for int8, bits) stacked as one; parts in several layouts each kept in its own where the
    mixed kernel takes them (`own_kernels.mixed`), else in one form (`_one_form`)."""
    runs = [concat_rows(list(run)) for _, run in itertools.groupby(parts, _layout)]
    if len(runs) == 1:
        return runs[0]
    stacked = StackedWeight(tuple(runs))
    return stacked if mixed.offered(stacked) else concat_rows(_one_form(parts))


def _layout(w: QuantWeight) -> tuple:
    return (type(w), w.group, q8_bits(w) if isinstance(w, (Int8Weight, Int8KWeight)) else 4)


def _one_form(parts: list[QuantWeight]) -> list[QuantWeight]:
    """Parts of one fused projection in one form: Q4_K and Q6_K parts as int4 and int8 (exact), int4
    parts beside int8 ones requantized to int8 groups of 32 (the finer grid), int8 scale groups
    split to the smallest group (exact)."""
    parts = [p.as_grouped() if isinstance(p, KQuantWeight) else p for p in parts]
    if all(isinstance(p, Int4Weight) for p in parts) or all(isinstance(p, Int8Weight) and p.group == parts[0].group
                                                             for p in parts):
        return parts
    parts = [quantize_int8(p.dequantize(), Q8_GROUP) if isinstance(p, Int4Weight) else p for p in parts]
    g = min(p.group for p in parts)
    return [Int8Weight(p.q, p.scale.repeat_interleave(p.group // g, 1)) for p in parts]


def _to_mode(w: QuantWeight | torch.Tensor, mode: str) -> QuantWeight:
    return REGISTRY[mode].serve(w)


def _table(block: QuantWeight | None, dense: torch.Tensor) -> QuantWeight:
    """The file's own blocks (Q6_K's in the int8 form, which the C lookups and rescoring take), else
    a dense table as int8 blocks of 32 (as GGUF's Q8_0)."""
    if isinstance(block, Int8KWeight):
        return block.as_grouped()
    return block if block is not None else quantize_int8(dense.detach(), Q8_GROUP)


def apply_plan(linears: list[QuantLinear], timings: KernelTimings) -> KernelPlan:
    """Set the plan's own kernel in `linears` (one layer and the head's scan) and drop the others."""
    plan = timings.plan(choosable_owns(linears))
    for lin in linears:
        lin.use_own(plan.own if plan.own in lin.own_paths() else lin.own)
        lin.drop_other_owns()
        lin.plan = plan
    return plan


def timed_linears(layer: list[QuantLinear], moe_top_k: int | None) -> list[QuantLinear]:
    """The QuantLinears of one layer one token runs through, in forward order: a MoE layer's
    first top_k experts stand for the k a token reaches (all have the same shapes), not all of them."""
    if moe_top_k is None:
        return layer
    return layer[:2 + 2 * moe_top_k]


def shapes_key(linears: list[QuantLinear]) -> str:
    """What the kernels' timings depend on: each timed weight's shape, kind, own kernels and bits,
    not its values or its file: models of the same shapes share one measurement."""
    shapes = [[lin.kind, lin.out_features, lin.in_features, list(lin.own_paths()), lin.bits] for lin in linears]
    return hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]


def kernel_sources() -> dict[str, str]:
    """The integer kernels' source digests: a new kernel is timed anew."""
    return {path.stem: cpu_ops.sources_digest([path]) for path in (*cpu_ops.INTEGER_MATMULS, *cpu_ops.HEADERS)}


def tune(layer: list[QuantLinear], scan: QuantLinear, rows: tuple[int, ...], model_key: dict,
         cache_dir: Path | None, refresh: bool = False, threads: int | None = None,
         moe_top_k: int | None = None, model_dir: Path | None = None) -> tuple[KernelPlan, KernelTimings]:
    """Time every own kernel over one layer's linears (`timed_linears`) or read the timings this
    machine cached for weights of these shapes (`shapes_key`), then keep the fastest in that
    layer and in `scan` (the head's scan, or its probe). Where no weight of the layer offers a choice
    of kernel (every one on its format's only kernel, as a Q4_K_M's), the scan, which does, is timed
    too: its kernel is chosen. The plan is noted for the file in `model_dir` (`plan_memo`)."""
    timed = timed_linears(layer, moe_top_k)
    if not any(len(lin.own_paths()) > 1 for lin in timed):
        timed = [*timed, scan]
    sources = kernel_sources()
    key = {**model_key, "shapes": shapes_key(timed), **sources}
    choices = choosable_owns([*layer, scan])
    timings = load_or_time(rows, key, cache_dir, lambda: time_paths(timed, rows, choices=choices), refresh, threads)
    if model_dir is not None:
        plan_memo.remember(model_dir, model_key, rows, sources, key, choices, cache_dir, threads)
    plan = apply_plan([*layer, scan], timings)
    log.info("every row takes the %s kernel", plan.own)
    return plan, timings

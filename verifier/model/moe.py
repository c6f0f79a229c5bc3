"""Mixture-of-experts layers (Mixtral, Qwen3-MoE): a router picks top_k SwiGLU experts per row.

One layer's MLP, T rows, E experts, top-k (HF's rule, `route`):

    p       = softmax(router(h).float())          fp32 [T, E]
    w, e    = the k largest p per row, by rank    fp32 [T, k], int64 [T, k]
    w       = w / sum(w)                          Mixtral always; Qwen3-MoE if norm_topk_prob
    y[r]    = sum over j = 0 .. k-1 of w[r, j] * expert_{e[r, j]}(h[r])

Each expert runs once over the rows routed to it. The sum runs in a fixed order per row, its
top-k rank, so a row's bits never depend on which rows share the batch (HF adds in expert
order, the same numbers up to fp32 rounding). The dense path (`SparseMoeBlock.forward`) runs
each expert's Linears as the dense MLP does (fixed row tiles on CUDA); the quantized CPU path
(`cpu_moe`) runs them through the same own/planned kernels as the dense MLP's QuantLinears,
and the router on its int8 kernel, row-invariant at any row count.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from verifier.cpu import cpu_ops
from verifier.model.config import MoeConfig, ModelConfig
from verifier.model.linear import Linear

# model type -> (the MoE block's name in HF checkpoints, its experts' gate, up and down names)
CHECKPOINT_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


class Expert(nn.Module):
    """One SwiGLU expert with the dense MLP's fused [gate; up] projection."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    """The router (`gate`, as HF names it) and the experts; forward x [T, H] -> [T, H]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.moe = cfg.moe
        self.gate = Linear(cfg.hidden_size, cfg.moe.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe.intermediate_size)
                                     for _ in range(cfg.moe.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.moe)
        return mix(x, weights, experts, lambda e, rows: self.experts[e](rows)).to(x.dtype)


def route(logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k], experts int64 [T, k]), each row's k best in rank
    order; ties go to the lower expert index. The weights are fp32, or the logits' dtype
    where the model rounds them so (Qwen3-MoE)."""
    probs = torch.softmax(logits.float(), dim=-1)                     # fp32 whatever the logits' dtype
    top, experts = probs.sort(dim=-1, descending=True, stable=True)
    top, experts = top[:, :moe.top_k], experts[:, :moe.top_k].contiguous()
    if moe.norm_topk_prob:
        total = top[:, 0].clone()
        for j in range(1, moe.top_k):       # by rank, not a reduction whose order may follow the shape
            total += top[:, j]
        top = top / total[:, None]
    return (top.to(logits.dtype) if moe.weights_in_logits_dtype else top), experts


def mix(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
        run: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fp32 [T, H]: row r's sum of weights[r, j] * run(experts[r, j], x[r]) over its ranks j in
    order; `run(e, rows)` is expert e over the rows routed to it (row-wise: a row's result must
    not depend on the others)."""
    t, k = experts.shape
    flat = experts.view(-1)                                           # entry r * k + j
    outs = torch.empty(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    for e in flat.unique().tolist():                                  # syncs on CUDA
        at = (flat == e).nonzero().view(-1)
        outs[at] = run(e, x[at // k]).float()
    outs = outs.view(t, k, -1)
    w = weights.float()
    y = outs[:, 0] * w[:, :1]
    for j in range(1, k):                                             # the fixed order: by rank
        y += outs[:, j] * w[:, j:j + 1]
    return y


def cpu_moe(block: SparseMoeBlock, h: torch.Tensor, mm) -> torch.Tensor:
    """The quantized CPU path: h bf16 [T, H] -> bf16 [T, H]. `mm(lin, x)` is the caller's
    matmul for these rows (the own kernel for sampled rows, the plan's tiles for prompt rows);
    the router takes its own kernel for both, so a token routes alike as a prompt or a sampled row."""
    weights, experts = route(block.gate.run_own(h), block.moe)

    def run(e: int, rows: torch.Tensor) -> torch.Tensor:
        expert = block.experts[e]
        a = torch.empty(rows.shape[0], expert.down_proj.in_features, dtype=torch.bfloat16)
        cpu_ops.silu_mul(mm(expert.gate_up_proj, rows), a)
        return mm(expert.down_proj, a)
    return mix(h, weights, experts, run).to(torch.bfloat16)


def param_name(name: str, model_type: str) -> str:
    """A checkpoint tensor's name as this package's modules hold it: Mixtral's block_sparse_moe
    and w1 / w3 / w2 become mlp and gate_proj / up_proj / down_proj (then fused by the loader)."""
    block, parts = CHECKPOINT_NAMES.get(model_type, ("mlp", ()))
    if block == "mlp" or f".{block}." not in name:
        return name
    name = name.replace(f".{block}.", ".mlp.")
    for src, dst in zip(parts, ("gate_proj", "up_proj", "down_proj")):
        name = name.replace(f".{src}.", f".{dst}.")
    return name


def split_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """transformers' fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H], `.down_proj`
    [E, H, I]) as one `mlp.experts.{e}.*.weight` per expert; any other tensor as it is."""
    if ".experts." not in name or tensor.dim() != 3:
        return [(name, tensor)]
    base, proj = name.rsplit(".", 1)
    return [(f"{base}.{e}.{proj}.weight", tensor[e]) for e in range(tensor.shape[0])]


def block_prefix(model_type: str, layer: int) -> str:
    """Where layer `layer`'s router (`.gate`) and experts (`.experts.{e}`) lie in an HF checkpoint."""
    return f"model.layers.{layer}.{CHECKPOINT_NAMES[model_type][0]}"

"""The logits transform and plain sampling. Speculative acceptance reuses `target_probs`,
so the distribution it preserves is exactly the one sampled here.

Order of operations (as vLLM v1): logit_bias and min_tokens on raw logits -> penalties -> a
spent thinking budget's forced token -> temperature -> top-k -> top-p -> min-p -> renormalise.
The first four depend on the tokens before the row (`transform_logits`); a tree node's row is
transformed with its own path, so speculative acceptance and plain sampling see one function.
"""
from __future__ import annotations

import torch

from verifier.cpu import cpu_ops
from verifier.model.row_tiles import in_row_tiles
from verifier.sampling.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams,
                    prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """logits: [V] raw -> [V] penalised (a new tensor when any penalty is set)."""
    if not params.has_penalties:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long,
                            device=logits.device)
        vals = logits[seen]
        # HF convention: shrink positive logits, push negative ones further down.
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty,
                                   vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=vocab)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def transform_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                     output_ids: list[int], held_back: frozenset[int] | tuple = ()) -> torch.Tensor:
    """logits: [V] raw -> [V] biased, masked and penalised (a new tensor when any applies).
    `output_ids`: the output before this row (a tree node's: the output plus its path);
    `held_back`: the ids min_tokens masks while the output is shorter (`finishing_ids`)."""
    early = params.min_tokens > len(output_ids) and held_back
    if params.logit_bias or early:
        logits = logits.clone()
        if params.logit_bias:
            ids, bias = zip(*params.logit_bias)
            logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
        if early:
            logits[sorted(held_back)] = float("-inf")
    logits = apply_penalties(logits, params, prompt_ids, output_ids)
    forced = params.thinking.forced(output_ids) if params.thinking is not None else None
    if forced is None or logits[forced] == float("-inf"):     # a constraint's mask outranks the budget
        return logits
    only = torch.full_like(logits, float("-inf"))      # the thinking budget is spent: its end, one-hot
    only[forced] = 0.0
    return only


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] penalised logits -> [N, V] fp32 probabilities after temperature and truncation.

    Not for greedy requests (temperature 0 has no distribution; it is an argmax). On CUDA row
    by row, as plain sampling calls it: torch's reductions and sort pick their layout by the
    tensor's shape (verifier/model/row_tiles.py)."""
    if logits.is_cuda and logits.shape[0] > 1:
        return in_row_tiles(lambda row: _target_probs(row, params), logits, rows=1)
    return _target_probs(logits, params)


def _target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    # Drop a token when the mass strictly before it already reaches top_p. The top one always
    # stays: a top_p below fp32's smallest value (5e-324) compares as 0, and 0 >= 0.
    drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
    return probs.masked_fill(drop, 0.0)


def greedy_token(logits: torch.Tensor, chunk: int = 128) -> int:
    """argmax of logits [V] (the first index of the largest value, as torch.argmax).

    torch.argmax over a 49k row is a scalar loop, slow enough to matter once per decode step,
    and torch's vectorized reductions use every thread, which after the step's Python glue
    first wait for threads that went to sleep (figures: docs/quantization.md). On the CPU the
    C kernels' serial scan answers; without them (or with a NaN in the row) the maxima of
    128-wide chunks are one reduction, and the first maximum lies in the first chunk holding
    the largest one."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous() \
            and cpu_ops.available():
        best = cpu_ops.argmax(logits)
        if best is not None:
            return best
    v = logits.shape[0]
    if v % chunk or logits.device.type != "cpu":
        return int(logits.argmax())
    best = int(logits.view(-1, chunk).amax(-1).argmax())
    return best * chunk + int(logits[best * chunk:(best + 1) * chunk].argmax())


def sample_token(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                 output_ids: list[int], generator: torch.Generator | None,
                 held_back: frozenset[int] | tuple = ()) -> int:
    """logits: [V] raw logits of one position -> the next token id."""
    logits = transform_logits(logits, params, prompt_ids, output_ids, held_back)
    if params.greedy:
        return greedy_token(logits)
    probs = target_probs(logits[None], params)[0]
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's generator, on the device of the logits it samples from: torch refuses a
    generator on another device (every T > 0 request would fail on CUDA)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g

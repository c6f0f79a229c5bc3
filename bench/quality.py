"""`tercel bench quality`: what a quantization costs, against the fp32 weights.

Both models read the same held-out conversations (teacher forcing: the conversation's own
tokens, not the model's). At every assistant-reply position it compares the next-token
predictions: top-1 agreement (argmax equal) and the perplexity of the reply tokens; the
ratio is candidate / fp32. The default quantization must keep agreement >= 99% and the
ratio <= 1.01 (`GATE`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.data import DATA
from verifier.batch import ForwardBatch, SeqInput
from verifier.target import TargetModel

GATE_AGREEMENT, GATE_PPL_RATIO = 0.99, 1.01
BLOCK = 16


@dataclass(frozen=True)
class Scored:
    """One conversation: its token ids and which positions predict a reply token."""
    ids: list[int]
    targets: list[int]       # position i predicts ids[i + 1]


@dataclass(frozen=True)
class Quality:
    positions: int
    agreement: float         # share of positions whose argmax equals the reference's
    ppl: float
    ref_ppl: float

    @property
    def ppl_ratio(self) -> float:
        return self.ppl / self.ref_ppl

    @property
    def passes(self) -> bool:
        return self.agreement >= GATE_AGREEMENT and self.ppl_ratio <= GATE_PPL_RATIO


def heldout_conversations(tokenizer, limit: int, max_len: int = 512, path: Path | None = None) -> list[Scored]:
    """The first `limit` held-out conversations, templated; reply tokens are scored."""
    path = path or DATA / "heldout" / "gsm8k_test.jsonl"
    template = lambda turns, open_reply: list(tokenizer.apply_chat_template(  # noqa: E731
        turns, add_generation_prompt=open_reply, tokenize=True, return_dict=False))
    out = []
    for line in path.read_text().splitlines()[:limit]:
        turns = json.loads(line)["conversations"]
        targets = []
        for i, turn in enumerate(turns):
            if turn["role"] == "assistant":       # the reply's tokens, from the opened turn on
                targets += range(len(template(turns[:i], True)) - 1, len(template(turns[:i + 1], False)) - 1)
        ids = template(turns, False)[:max_len]
        out.append(Scored(ids, [t for t in targets if t < len(ids) - 1]))
    return out


@torch.inference_mode()
def log_probs(model: TargetModel, conv: Scored, adapter: int = 0) -> torch.Tensor:
    """[len(targets), vocab] log-probabilities at the scored positions, from one forward
    that samples every position: the rows decoding takes (on a quantized target, the
    row-invariant exact path), not the prefill path; under LoRA adapter slot `adapter`."""
    blocks = -(-len(conv.ids) // BLOCK)
    if model.kv is None or model.kv.num_blocks < blocks:
        model.allocate_kv(blocks, BLOCK)
    seq = SeqInput(conv.ids, 0, list(range(blocks)), logits_indices=list(range(len(conv.ids))), adapter=adapter)
    return torch.log_softmax(model.forward(ForwardBatch([seq])).logits[conv.targets], dim=-1)


def compare(reference: TargetModel, candidate: TargetModel, convs: list[Scored], adapter: int = 0) -> Quality:
    """`candidate` against `reference` on `convs`, both under LoRA adapter slot `adapter` (0: none)."""
    agree, nll, ref_nll, n = 0, 0.0, 0.0, 0
    for conv in convs:
        ref, cand = log_probs(reference, conv, adapter), log_probs(candidate, conv, adapter)
        nxt = torch.tensor([conv.ids[t + 1] for t in conv.targets])
        agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        nll -= float(cand.gather(1, nxt[:, None]).sum())
        ref_nll -= float(ref.gather(1, nxt[:, None]).sum())
        n += len(conv.targets)
    return Quality(n, agree / n, math.exp(nll / n), math.exp(ref_nll / n))


def run_quality(model: str, modes: list[str], limit: int) -> list[tuple[str, Quality]]:
    reference = TargetModel(model, quantization="none")
    convs = heldout_conversations(reference.tokenizer, limit)
    return [(mode, compare(reference, TargetModel(model, quantization=mode), convs)) for mode in modes]


def quality_table(results: list[tuple[str, Quality]]) -> str:
    lines = ["| quantization | positions | top-1 agreement | perplexity (fp32) | ratio | gate |",
             "|---|---|---|---|---|---|"]
    for mode, q in results:
        lines.append(f"| {mode} | {q.positions} | {q.agreement:.2%} | {q.ppl:.4f} ({q.ref_ppl:.4f}) | "
                     f"{q.ppl_ratio:.4f} | {'pass' if q.passes else 'FAIL'} |")
    return "\n".join(lines) + (f"\n\nGate: agreement >= {GATE_AGREEMENT:.0%} and perplexity ratio "
                               f"<= {GATE_PPL_RATIO} against quantization=none.")

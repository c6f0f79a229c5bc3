"""Draft vocabulary: the target tokens the head may propose (EAGLE-3's d2t / t2d).

The most frequent tokens of the training responses (assistant tokens only), in
ascending target-id order, as the public recipe builds it. The LM head then has
`draft_vocab` rows instead of the target's full vocabulary: cheaper to run and to ship.
"""
from __future__ import annotations

from collections import Counter

import torch

from training.data import TokenizedExample


def select_draft_vocab(examples: list[TokenizedExample], draft_vocab: int, vocab_size: int,
                       always: tuple[int, ...] = ()) -> tuple[torch.Tensor, float]:
    """Returns (target ids [draft_vocab] ascending, share of assistant tokens covered).
    `always` (e.g. end-of-turn tokens) are kept whatever their count."""
    if not 0 < draft_vocab <= vocab_size:
        raise ValueError(f"--draft-vocab must be in [1, {vocab_size}], got {draft_vocab}")
    counts: Counter[int] = Counter()
    for ex in examples:
        counts.update(t for t, m in zip(ex.input_ids, ex.loss_mask) if m)
    chosen = list(dict.fromkeys(t for t in always if 0 <= t < vocab_size))[:draft_vocab]
    for tok, _ in counts.most_common():
        if len(chosen) == draft_vocab:
            break
        if tok not in chosen:
            chosen.append(tok)
    # Pad with the lowest unused ids so the head always has exactly draft_vocab rows.
    used = set(chosen)
    filler = (t for t in range(vocab_size) if t not in used)
    while len(chosen) < draft_vocab:
        chosen.append(next(filler))
    total = sum(counts.values())
    covered = sum(counts[t] for t in chosen) / total if total else 0.0
    return torch.tensor(sorted(chosen), dtype=torch.long), covered

"""Prompt logprobs (`SamplingParams.prompt_logprobs`; completions with `echo`): each prompt
token's logprob under the rows before it, the first token's None.

A teacher-forced pass of its own on scratch KV blocks, once the request's prompt is in: the
request's prefill runs its prompt rows on the prompt kernels, and asking for logits there
would move them onto the sampled-row kernels and change the KV the output is decoded from,
so a request that asks for prompt logprobs would decode differently from one that does not.
The pass runs in chunks (a row of logits is a vocabulary of floats), every row a sampled row.
"""
from __future__ import annotations

from verifier.batch import ForwardBatch, SeqInput
from verifier.sampling.logprobs import TokenLogprob, row_logprob

CHUNK = 256     # prompt rows per forward: logits of CHUNK x vocabulary floats at a time


def prompt_logprobs(target, blocks, seq_id: int, prompt: list[int], k: int,
                    adapter: int = 0) -> list[TokenLogprob | None]:
    """Raw logprobs of prompt[1:] (and None for prompt[0]), from a forward over scratch blocks
    lent under `seq_id` (NoFreeBlocksError, the pool unchanged, when they are not there), under
    LoRA adapter slot `adapter` (0: the base)."""
    out: list[TokenLogprob | None] = [None]
    with blocks.scratch(seq_id, len(prompt)) as table:
        for start in range(0, len(prompt) - 1, CHUNK):
            chunk = prompt[start:start + CHUNK]
            fwd = target.forward(ForwardBatch([SeqInput(chunk, start, table, logits_indices=list(range(len(chunk))),
                                                        sampled_from=0, adapter=adapter)]))
            logits = fwd.seq_logits(0)
            for r in range(len(chunk)):
                if start + r + 1 < len(prompt):
                    out.append(row_logprob(logits[r], prompt[start + r + 1], k))
    return out

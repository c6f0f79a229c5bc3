"""Conversation data for drafter training: held-out prompts, chat templating, loss masks.

The conversation files themselves (both JSONL schemas, bad lines skipped and reported) are
read by drafters/conversations.py, which the datastore drafter shares.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from drafters.conversations import Conversation, expand_paths, parse_message


def load_prompts(path: str, limit: int) -> list[list[dict]]:
    """Up to `limit` held-out prompts from one JSONL file: each conversation's turns before its
    first assistant turn (Tercel's schema or ShareGPT), or a benchmark question's first turn
    (MT-bench and Spec-Bench question files: {"turns": ["...", ...]}). Lines that are neither
    are skipped."""
    prompts = []
    for p in expand_paths([path]):
        for line in p.read_text(encoding="utf-8").splitlines():
            if len(prompts) == limit:
                return prompts
            try:
                obj = json.loads(line)
                turns = obj.get("turns") if isinstance(obj, dict) else None
                if isinstance(turns, list) and turns and isinstance(turns[0], str):
                    prompts.append([{"role": "user", "content": turns[0]}])
                    continue
                messages = [parse_message(t, i) for i, t in enumerate(obj.get("conversations", obj.get("messages")))]
            except (ValueError, TypeError, AttributeError):
                continue
            first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
            if any(m["role"] == "user" for m in messages[:first]):
                prompts.append(messages[:first])
    return prompts


@dataclass(frozen=True)
class TokenizedExample:
    """One conversation through the chat template: ids and which of them are assistant tokens."""
    id: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]       # 1 where the token belongs to an assistant reply


def tokenize_conversation(tokenizer, conv: Conversation, max_len: int) -> TokenizedExample | None:
    """Template the conversation turn by turn; tokens of assistant turns (their content and
    the end-of-turn marker, not the role header) carry loss. None if nothing trainable fits."""
    ids: list[int] = []
    mask: list[int] = []
    msgs = list(conv.messages)
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            head = _template(tokenizer, msgs[:i], add_generation_prompt=True)
            full = _template(tokenizer, msgs[:i + 1], add_generation_prompt=False)
        else:
            head = full = _template(tokenizer, msgs[:i + 1], add_generation_prompt=False)
        if full[:len(ids)] != ids or head[:len(ids)] != ids:
            return None     # the template rewrites earlier turns: the masks would not line up
        mask.extend([0] * (len(head) - len(ids)) + [int(m["role"] == "assistant")] * (len(full) - len(head)))
        ids = full
    ids, mask = ids[:max_len], mask[:max_len]
    if sum(mask) < 2:
        return None
    return TokenizedExample(conv.id, tuple(ids), tuple(mask))


def _template(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                              tokenize=True, return_dict=False))

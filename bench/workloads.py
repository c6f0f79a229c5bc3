"""`--dataset multiturn`: multi-turn conversations that share long system prompts, the workload
where routing by prefix across replicas pays (serving/cluster/prefix_router.py).

Each MT-bench question becomes a two-turn conversation (its second turn follows the model's own
first answer) under one of three long system prompts, dealt round-robin, as an assistant product
with a few fixed personas would send them. Every request after a conversation's first turn, and
every conversation after the first under its system prompt, finds a cached prefix, provided it
reaches the replica that holds it.
"""
from __future__ import annotations

from dataclasses import replace

from bench.data import BenchPrompt, load_datasets

_RULES = ("Answer in plain English and keep to the point. When a question is ambiguous, say which "
          "reading you chose and why. Prefer short paragraphs and numbered steps for procedures. "
          "Never invent citations, figures or quotations; say plainly when you do not know. "
          "Refuse requests for harmful instructions and explain the refusal in one sentence. ")
SYSTEM_PROMPTS = (
    "You are the writing assistant of a small publishing house. Editors send you drafts, outlines "
    "and questions about style; authors ask for feedback on tone, structure and pacing. Follow the "
    "house style: British spelling, the serial comma, numbers below ten in words, dates as 1 March "
    "2026. " + _RULES * 3,
    "You are a patient tutor for first-year university students in mathematics, physics and "
    "computer science. Show your reasoning step by step, check each result by a second method when "
    "you can, and end with a one-line summary of the answer. Use LaTeX-free notation such as x^2 "
    "and sqrt(x). " + _RULES * 3,
    "You are the support assistant of a software company that sells a database for small teams. "
    "Customers ask about installation, backups, permissions, performance and billing. Ask for the "
    "version and operating system when they matter, give commands in code blocks, and point to the "
    "relevant section of the administrator's guide. " + _RULES * 3,
)


def multiturn(limit: int | None = None) -> list[BenchPrompt]:
    """MT-bench's two-turn questions in file order, at most `limit`, each under a shared system prompt."""
    prompts = load_datasets(["mtbench"], both_turns=True).prompts[:limit]
    return [replace(p, task="multiturn", system=SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)])
            for i, p in enumerate(prompts)]

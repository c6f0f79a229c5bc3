"""Self-distillation data: the target answers the training prompts itself.

A drafter is judged on how well it predicts the *target's* continuation, so training on
the target's own replies (rather than on replies written by another model) removes the
mismatch between training and serving. Replies come from Tercel's own batched engine.

Each conversation keeps its turns up to the first assistant turn, whose content is
replaced by the target's reply; later turns are dropped (they answer a reply the target
did not write). The output is JSONL in the common schema, written as replies finish;
ids already in the output file are skipped, so an interrupted run resumes.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from tqdm import tqdm

from drafters.conversations import Conversation
from spec.llm import LLM
from spec.request import Submission
from verifier.sampling.sampling_params import SamplingParams

log = logging.getLogger("tercel.training")


def regenerate(conversations: list[Conversation], model: str, out_path: str, *,
               max_new_tokens: int = 256, temperature: float = 0.0, batch_size: int = 32,
               seed: int = 0, quantization: str = "auto", llm=None) -> list[Conversation]:
    out = Path(out_path)
    done = _read_done(out)
    todo = [c for c in conversations if c.id not in done and _prompt_turns(c)]
    log.info("regenerating %d replies (%d already in %s)", len(todo), len(done), out)
    llm = llm or LLM(model, max_num_seqs=batch_size, seed=seed, quantization=quantization)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature)
    engine, start, tokens = llm.engine, time.perf_counter(), 0
    pending = {f"regen-{i}": c for i, c in enumerate(todo)}
    queue = list(pending.items())
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc="regenerate", unit="reply", dynamic_ncols=True, mininterval=2.0)
    with open(out, "a", encoding="utf-8") as f:
        while queue or engine.has_unfinished:
            # Keep the engine full without queueing everything (the scheduler sorts nothing).
            while queue and len(engine.requests) < 2 * batch_size:
                rid, conv = queue.pop(0)
                engine.add_request(rid, Submission(llm.apply_chat_template(list(_prompt_turns(conv))), params))
            for o in engine.step():
                if not o.finished:
                    continue
                conv = pending.pop(o.request_id)
                reply = {"role": "assistant", "content": o.text}
                f.write(json.dumps({"id": conv.id, "source": conv.source,
                                    "conversations": list(_prompt_turns(conv)) + [reply]}) + "\n")
                f.flush()
                tokens += len(o.token_ids)
                done[conv.id] = True
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tok/s", refresh=False)
                bar.update(1)                       # tqdm adds the time left
        bar.close()
        log.info("regenerated %d replies, %d tokens in %.0f s", len(todo), tokens, time.perf_counter() - start)
    return todo


def _prompt_turns(conv: Conversation) -> tuple[dict, ...]:
    for i, m in enumerate(conv.messages):
        if m["role"] == "assistant":
            return conv.messages[:i]
    return ()


def _read_done(path: Path) -> dict[str, bool]:
    if not path.exists():
        return {}
    done = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            done[json.loads(line)["id"]] = True
        except (ValueError, KeyError, TypeError):
            continue    # a line cut short by an interrupted run: regenerate it
    return done

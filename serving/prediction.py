"""Predicted Outputs in the server (docs/predicted.md): the `prediction` field tokenized and checked
before any work, and what the usage reports of it.

A prediction only changes speed: the engine drafts its tokens (drafters/prediction.py) and
verification decides, so the reply is the one the same request gets without it.
"""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from drafters.base import Prediction
from serving.protocol import APIError
from spec.request import Submission
from spec.stats import EngineLimits


async def tokenized(text: str, tokenizer) -> Prediction:
    """The prediction's tokens, off the event loop (a whole file takes a while to tokenize)."""
    return await run_in_threadpool(Prediction.from_text, text, tokenizer)


def check_predictions(limits: EngineLimits, subs: list[Submission]) -> None:
    """A 400 naming `prediction` where one could never be drafted (longer than the context)."""
    for sub in subs:
        try:
            limits.validate_prediction(sub.prompt_token_ids, sub.params, sub.prediction)
        except ValueError as e:
            code = "context_length_exceeded" if "context length" in str(e) else None
            raise APIError(400, str(e), param="prediction", code=code) from None


def completion_tokens_details(outputs) -> dict:
    """OpenAI's usage.completion_tokens_details: the prediction's tokens accepted by verification,
    and those verified and rejected, summed over the choices."""
    return {"accepted_prediction_tokens": sum(o.stats.prediction_accepted for o in outputs),
            "rejected_prediction_tokens": sum(o.stats.prediction_rejected for o in outputs)}

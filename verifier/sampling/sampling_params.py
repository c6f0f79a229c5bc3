"""Per-request sampling parameters (the same knobs as vLLM and the OpenAI API), which drive the
logits transform (`verifier/sampling/sampler.py`). `from spec import SamplingParams` is the
offline API's name for this class."""
from __future__ import annotations

from dataclasses import dataclass

from verifier.checks import positive_int
from verifier.sampling.structured import StructuredOutputs
from verifier.sampling.thinking import ThinkingBudget


GREEDY_BELOW = 1e-5               # temperatures below this sample the argmax
# A logit divided by a smaller penalty (and then by the temperature) can overflow fp32 to inf,
# and softmax over several infs has no answer.
MIN_REPETITION_PENALTY = 0.01
MAX_LOGPROBS = 20                 # alternatives per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0            # OpenAI's range for logit_bias values: [-100, 100]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0          # 0 means greedy (argmax after penalties)
    top_k: int = 0                    # 0 disables; otherwise keep the k most likely tokens
    top_p: float = 1.0                # nucleus mass in (0, 1]
    min_p: float = 0.0                # drop tokens below min_p * max prob, in [0, 1]
    repetition_penalty: float = 1.0   # HF-style, over prompt and output tokens; > 0
    presence_penalty: float = 0.0     # OpenAI-style, over output tokens; in [-2, 2]
    frequency_penalty: float = 0.0    # OpenAI-style, over output tokens; in [-2, 2]
    seed: int | None = None           # per-request generator seed: same seed, same output
    max_tokens: int = 16              # new tokens at most (as vLLM's default)
    stop: tuple[str, ...] = ()        # stop strings; the text is cut before them
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # (token id, bias) pairs added to the raw logits, OpenAI's logit_bias; a dict is accepted
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0               # EOS and stop tokens are held back until this many output tokens
    include_stop_str_in_output: bool = False   # keep the stop string (or stop token's text) in the text
    # The output's constraint (JSON schema, regex, grammar, choice), or None; see verifier/sampling/grammar.py
    structured: StructuredOutputs | None = None
    # Per output token its logprob and the `logprobs` most likely alternatives (None: none at all);
    # per prompt token the same with `prompt_logprobs` (verifier/sampling/logprobs.py)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # At most this many tokens of a reasoning block, then its end forced (verifier/sampling/thinking.py)
    thinking: ThinkingBudget | None = None

    def __post_init__(self):
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _frozen_bias(self.logit_bias))
        for check in (_check_temperature, _check_top, _check_penalties, _check_lengths, _check_bias):
            check(self)
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise ValueError(f"structured must be a StructuredOutputs, got {type(self.structured).__name__}")
        if self.thinking is not None and not isinstance(self.thinking, ThinkingBudget):
            raise ValueError(f"thinking must be a ThinkingBudget, got {type(self.thinking).__name__}")

    @property
    def greedy(self) -> bool:
        # Below 1e-5 (vLLM's cut-off) logits / T overflows fp32 and softmax has no answer; the
        # distribution is the argmax to within fp32 anyway.
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def has_logit_transform(self) -> bool:
        """Whether `transform_logits` changes a row: a bias, min_tokens, a penalty or a thinking budget is set."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.has_penalties or self.thinking is not None

    def finishing_ids(self, eos_ids) -> frozenset[int]:
        """The token ids that end this request when sampled: its stop tokens, and EOS unless
        ignored. min_tokens holds back exactly these."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_ids))


def _frozen_bias(bias) -> tuple[tuple[int, float], ...]:
    # Sorted pairs: a frozen, hashable value whatever order the caller's dict had.
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        return tuple(sorted((k, v) for k, v in items))
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from None


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _check_temperature(p: SamplingParams) -> None:
    if _number("temperature", p.temperature) < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {p.temperature}")


def _check_top(p: SamplingParams) -> None:
    if isinstance(p.top_k, bool) or not isinstance(p.top_k, int) or p.top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 disables), got {p.top_k!r}")
    if not 0.0 < _number("top_p", p.top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    if not 0.0 <= _number("min_p", p.min_p) <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p}")


def _check_penalties(p: SamplingParams) -> None:
    if _number("repetition_penalty", p.repetition_penalty) < MIN_REPETITION_PENALTY:
        raise ValueError(f"repetition_penalty must be >= {MIN_REPETITION_PENALTY} (1 disables), "
                         f"got {p.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= _number(name, getattr(p, name)) <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(p, name)}")


def _check_lengths(p: SamplingParams) -> None:
    positive_int("max_tokens", p.max_tokens)
    if p.seed is not None and (isinstance(p.seed, bool) or not isinstance(p.seed, int)):
        raise ValueError(f"seed must be an int or None, got {p.seed!r}")
    if any(not isinstance(s, str) or not s for s in p.stop):
        raise ValueError(f"stop must be non-empty strings, got {p.stop!r}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in p.stop_token_ids):
        raise ValueError(f"stop_token_ids must be ints >= 0, got {p.stop_token_ids!r}")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"{name} must be an int in [0, {MAX_LOGPROBS}] or None, got {k!r}")
    if isinstance(p.min_tokens, bool) or not isinstance(p.min_tokens, int) or p.min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {p.min_tokens!r}")
    if p.min_tokens > p.max_tokens:
        raise ValueError(f"min_tokens ({p.min_tokens}) must not exceed the maximum of new tokens ({p.max_tokens})")
    if p.min_tokens and p.structured is not None:
        # The grammar may allow only a stop token where min_tokens forbids it: no token left.
        raise ValueError("min_tokens cannot be combined with an output constraint")


def _check_bias(p: SamplingParams) -> None:
    for token, bias in p.logit_bias:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if not -MAX_LOGIT_BIAS <= _number("logit_bias value", bias) <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
    if len({t for t, _ in p.logit_bias}) != len(p.logit_bias):
        raise ValueError("logit_bias names a token twice")

"""A request as it is handed to the engine (`Submission`), and as the engine holds it
(`Request`: what outlives a step; a step's own values live on its `spec/plan.py:SeqPlan`;
derived values are properties)."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spec.detokenizer import IncrementalDetokenizer
from spec.faults import RequestError
from verifier.block_manager import ROOT_DIGEST
from verifier.sampling.sampling_params import SamplingParams

from drafters.base import Prediction
from drafters.config import SpecConfig

if TYPE_CHECKING:
    import torch

    from spec.adaptive import SpecHistory
    from verifier.sampling.grammar import Matcher


@dataclass(frozen=True)
class Submission:
    """One request as a caller hands it to `LLMEngine.add_request`: the server builds it from the
    wire (serving/app.py), `LLM` from its arguments; the engine checks it and builds a `Request`."""
    prompt_token_ids: list[int] | None      # None: the engine tokenizes `prompt`
    params: SamplingParams
    speculate: bool = True                  # False: decode plainly
    speculation: SpecConfig | None = None   # caps this request's tree below the engine's SpecConfig
    grammar: object | None = None           # params.structured already compiled (verifier.sampling.grammar)
    prediction: Prediction | None = None    # the reply the client expects (Predicted Outputs); drafted only
    lora: str | None = None                 # the LoRA adapter it runs under (None: the base model)
    prompt: str | None = None               # the prompt's text, kept for the outputs

    def __post_init__(self):
        # A text where ids belong would be read as one id per character: refused, named.
        if isinstance(self.prompt_token_ids, str) or (self.prompt_token_ids is None and self.prompt is None):
            raise ValueError("a Submission takes prompt_token_ids (a list of ids), or None and the text as prompt=")


class Status(enum.Enum):
    WAITING = "waiting"      # not admitted, or preempted (blocks freed; recompute on re-admission)
    RUNNING = "running"      # holds KV blocks
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculation counters of one request (all zero when it decodes plainly)."""
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0          # tokens produced by verify steps (accepted + corrected/bonus)
    forced_tokens: int = 0           # grammar-forced tokens accepted in jump-forward steps (not counted above)
    prediction_accepted: int = 0     # tokens of the request's prediction accepted by verification
    prediction_rejected: int = 0     # tokens of its prediction verified and not accepted
    accepted_per_depth: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        # Tokens emitted per verify step, the bonus/corrected token included.
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0


_seq_ids = itertools.count()


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, prompt: str | None = None,
                 generator=None, arrival_time: float | None = None):
        self.request_id = request_id
        self.seq_id = next(_seq_ids)             # the block manager's key
        self.prompt = prompt
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)   # prompt, then output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0             # leading tokens whose KV is in the cache
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.detok = detokenizer
        self.generator: torch.Generator | None = generator     # for seeded sampling
        self.arrival_time = arrival_time if arrival_time is not None else time.perf_counter()
        self.first_token_time: float | None = None
        self.admit_time: float | None = None     # first admitted (its queue time ends there)
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0        # prefix-cache hit at first admission
        self.spec = SpecStats()
        self.speculate = True                    # False: this request always decodes plainly
        self.speculation: SpecConfig | None = None       # a per-request cap (None: the engine's)
        self.history: SpecHistory | None = None          # what its drafts have shown (the adaptive controller's)
        self.grammar: Matcher | None = None              # the matcher of params.structured
        self.prediction: Prediction | None = None        # the reply the client expects
        self.error: RequestError | None = None   # why it failed alone (finish_reason "error")
        self.logprobs: list = []                 # verifier.sampling.logprobs.TokenLogprob per output token, if asked
        self.prompt_logprobs: list | None = None  # per prompt token (the first None), once computed, if asked
        self.adapter: int = 0                    # the LoRA adapter's slot it runs under (0: the base)
        self.cache_root: bytes = ROOT_DIGEST     # where its prompt's prefix-cache keys chain from (its adapter's)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        # More than the last sampled token still lacks KV: a prompt (or recompute) chunk is due.
        return self.num_uncomputed > 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    """What a caller sees for one request: the whole output so far, plus the newest delta."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" | "error" | None while running
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    ttft: float | None = None          # seconds from arrival to the first output token
    queue_time: float | None = None    # seconds from arrival to first admission
    total_time: float | None = None    # seconds from arrival to finish
    num_cached_tokens: int = 0         # prompt tokens served from the prefix cache
    stats: SpecStats = field(default_factory=SpecStats)
    error: RequestError | None = None  # finish_reason "error": this request failed alone, and why
    # per output token (params.logprobs set): a verifier.sampling.logprobs.TokenLogprob, aligned with token_ids
    logprobs: list | None = None
    prompt_logprobs: list | None = None   # per prompt token (params.prompt_logprobs set), the first None
    # the stop string that ended the text (finish_reason "stop"; vLLM's stop_reason): the text
    # is cut before it, so a caller could not tell which of several it was
    stop_string: str | None = None

"""The engine: requests in, one step at a time, outputs out.

One step: schedule -> forward (prefill chunks and decode tokens in one pass) -> sample
-> commit (publish full blocks to the prefix cache) -> emit (detokenize, stop checks).
"""
from __future__ import annotations

import time

import torch

from spec.block_manager import BlockManager, BlockManagerConfig
from spec.config import EngineConfig
from spec.detokenizer import IncrementalDetokenizer
from spec.request import Request, RequestOutput, Status
from spec.sampler import make_generator, sample_token
from spec.sampling_params import SamplingParams
from spec.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from verifier.batch import ForwardBatch, ForwardOutput, SeqInput
from verifier.target import TargetModel


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.target = TargetModel(config.model, device=config.device, backend=config.attention_backend)
        self.tokenizer = self.target.tokenizer
        mc = self.target.config
        self.max_model_len = min(config.max_model_len or min(mc.max_position, 8192), mc.max_position)
        num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_bytes // self.target.kv_bytes_per_block(config.block_size))
        self.target.allocate_kv(num_blocks, config.block_size)
        self.blocks = BlockManager(BlockManagerConfig(num_blocks, config.block_size,
                                                      config.enable_prefix_cache))
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len), self.blocks)
        self.eos_ids = frozenset(mc.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.requests: dict[str, Request] = {}
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        self._pending: list[RequestOutput] = []

    # ---- requests in ------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"] if prompt else []
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    prompt_token_ids: list[int] | None = None) -> Request:
        """Validate and queue; ValueError (naming the problem) leaves no state behind."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        self._validate(ids, params)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        req = Request(request_id, ids, params,
                      IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens),
                      prompt=prompt if isinstance(prompt, str) else None,
                      generator=make_generator(seed))
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.target.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        total = len(ids) + params.max_tokens
        if len(ids) >= self.max_model_len or total > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the context length max_model_len={self.max_model_len}")
        if self.blocks.blocks_needed(None, total) > self.blocks.num_total_blocks:
            raise ValueError(f"prompt + max_tokens = {total} tokens needs more KV blocks than the "
                             f"pool has ({self.blocks.num_total_blocks} of {self.blocks.block_size})")

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        self.scheduler.finish(req, "abort")
        self._pending.append(self._finalize(req))

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pending)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        fwd = self.target.forward(self._forward_batch(sched))
        return outputs + self._postprocess(sched, fwd)

    def _forward_batch(self, sched: SchedulerOutput) -> ForwardBatch:
        seqs = []
        for s in sched.seqs:
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            seqs.append(SeqInput(req.token_ids[start:end], start, self.blocks.block_table(req.seq_id),
                                 logits_indices=None if end == req.num_tokens else []))
        return ForwardBatch(seqs)

    def _postprocess(self, sched: SchedulerOutput, fwd: ForwardOutput) -> list[RequestOutput]:
        outputs = []
        for i, s in enumerate(sched.seqs):
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.blocks.publish(req.seq_id, req.token_ids, req.num_computed_tokens)
            if req.num_computed_tokens < req.num_tokens:
                continue                       # a prefill chunk that is not the last one
            token = sample_token(fwd.seq_logits(i)[-1], req.params, req.prompt_token_ids,
                                 req.output_token_ids, req.generator)
            outputs.append(self._append_tokens(req, [token]))
        return outputs

    def _append_tokens(self, req: Request, tokens: list[int]) -> RequestOutput:
        """Append sampled tokens one by one until one finishes the request; emit the delta."""
        added = []
        for t in tokens:
            req.token_ids.append(t)
            added.append(t)
            if req.first_token_time is None:
                req.first_token_time = time.perf_counter()
            req.detok.add(req.output_token_ids)
            reason = self._finish_reason(req, t)
            if reason:
                self.scheduler.finish(req, reason)
                break
        return self._finalize(req, added) if req.finished else self._output(req, added)

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if req.detok.stopped_by is not None or token in p.stop_token_ids:
            return "stop"
        if token in self.eos_ids and not p.ignore_eos:
            return "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finalize(self, req: Request, added: list[int] | None = None) -> RequestOutput:
        req.finish_time = time.perf_counter()
        req.detok.flush(req.output_token_ids)
        del self.requests[req.request_id]
        return self._output(req, added or [])

    def _output(self, req: Request, added: list[int]) -> RequestOutput:
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        total = None if req.finish_time is None else req.finish_time - req.arrival_time
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            text=req.detok.text, token_ids=req.output_token_ids, finished=req.finished,
            finish_reason=req.finish_reason, delta_text=req.detok.take_delta(req.finished),
            delta_token_ids=added, ttft=ttft, total_time=total,
            num_cached_tokens=req.num_cached_prompt_tokens, stats=req.spec)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

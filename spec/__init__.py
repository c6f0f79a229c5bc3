"""Tercel's engine core: `from spec import LLM, SamplingParams`."""
from spec.config import EngineConfig
from spec.llm import LLM
from spec.request import RequestOutput
from verifier.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]

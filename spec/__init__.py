"""Tercel's engine core: `from spec import LLM, SamplingParams, StructuredOutputs, Prediction`; `Submission`
is what `LLMEngine.add_request` takes."""
from drafters.base import Prediction
from spec.config import EngineConfig
from spec.llm import LLM
from spec.request import RequestOutput, Submission
from verifier.sampling.sampling_params import SamplingParams
from verifier.sampling.structured import StructuredOutputs

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "EngineConfig", "RequestOutput", "Prediction", "Submission"]

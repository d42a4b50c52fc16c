"""The generation engine: continuous batching over a paged KIVI (or bf16) cache."""

from pipeline.actors.engine.config import EngineConfig
from pipeline.actors.engine.llm_engine import LLMEngine
from pipeline.actors.engine.request import Completion, Request, SamplingParams

__all__ = ["Completion", "EngineConfig", "LLMEngine", "Request", "SamplingParams"]

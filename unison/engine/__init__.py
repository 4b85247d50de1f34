"""The generation engine. ``from unison.engine import Engine, EngineConfig, SamplingParams, Completion``; what the
rollout loop sees of any engine, local or remote: ``GenerationEngine``."""

from .attention import ATTN_NAME, NO_MASK, register
from .engine import Engine
from .protocol import GenerationEngine
from .types import Completion, EngineConfig, SamplingParams

__all__ = ["ATTN_NAME", "NO_MASK", "Completion", "Engine", "EngineConfig", "GenerationEngine", "SamplingParams",
           "register"]

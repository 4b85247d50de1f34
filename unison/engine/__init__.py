"""The generation engine. ``from unison.engine import Engine, EngineConfig, SamplingParams, Completion``."""

from .attention import ATTN_NAME, NO_MASK, register
from .engine import Engine
from .types import Completion, EngineConfig, SamplingParams

__all__ = ["ATTN_NAME", "NO_MASK", "Completion", "Engine", "EngineConfig", "SamplingParams", "register"]

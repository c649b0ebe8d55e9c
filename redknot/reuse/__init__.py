"""Position-independent chunk reuse: prompt layout, recovery forward, methods, FLOPs accounting."""

from .methods import CHUNK_METHODS, REUSE_METHODS, ReuseEngine, ReuseOptions
from .prompt import ChunkedPrompt, build_prompt

__all__ = ["CHUNK_METHODS", "REUSE_METHODS", "ChunkedPrompt", "ReuseEngine", "ReuseOptions", "build_prompt"]

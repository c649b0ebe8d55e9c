"""Position-independent chunk reuse: prompt layout, the method registry, recovery policies, FLOPs accounting."""

from .options import ReuseOptions
from .prompt import ChunkedPrompt, build_prompt
from .registry import METHOD_NAMES, METHODS, MethodSpec, canonical_name, get_method, parse_method

__all__ = ["METHOD_NAMES", "METHODS", "ChunkedPrompt", "MethodSpec", "ReuseOptions", "build_prompt",
           "canonical_name", "get_method", "parse_method"]

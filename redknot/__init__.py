"""redknot: long-context LLM serving with position-independent chunk KV reuse and per-head paged attention."""

from .config import HeadConfig, HeadConfigError

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "HeadConfig", "HeadConfigError", "__version__"]


def __getattr__(name):
    # The engine pulls in torch and transformers; import it only when asked for.
    if name in ("LLM", "SamplingParams", "StructuredOutputs"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'redknot' has no attribute {name!r}")

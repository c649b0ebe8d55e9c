from .config import ModelConfig, UnsupportedModelError
from .llama import LlamaForCausalLM
from .loader import CheckpointError, build_model, load_model, resolve_dtype
from .resolve import resolve_model

__all__ = ["ModelConfig", "UnsupportedModelError", "LlamaForCausalLM", "CheckpointError", "build_model",
           "load_model", "resolve_dtype", "resolve_model"]

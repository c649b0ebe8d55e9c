from .config import ModelConfig, UnsupportedModelError
from .llama import LlamaForCausalLM
from .loader import CheckpointError, build_model, load_model, resolve_dtype

__all__ = ["ModelConfig", "UnsupportedModelError", "LlamaForCausalLM", "CheckpointError", "build_model",
           "load_model", "resolve_dtype"]

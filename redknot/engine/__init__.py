from .llm import LLM, METHODS, CompletionOutput, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "METHODS", "CompletionOutput", "RequestOutput", "SamplingParams"]

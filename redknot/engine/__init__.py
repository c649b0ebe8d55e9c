from .llm import LLM, METHODS, CompletionOutput, RequestOutput
from .sampling import SamplingParams
from .structured import StructuredOutputs

__all__ = ["LLM", "METHODS", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputs"]

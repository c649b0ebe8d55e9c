"""The architectures redknot runs: ``model_type`` -> (model class, adapter class).

The one place a new architecture is registered; the loaders build ``model_class(cfg)`` and the
engine and profiler talk to ``adapter_for(model, cfg)``.
"""

from __future__ import annotations

from .adapter import LlamaAdapter, ModelAdapter
from .config import ModelConfig, UnsupportedModelError
from .deepseek import DeepseekForCausalLM, MLAAdapter
from .gemma3 import Gemma3Adapter, Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .qwen3_next import HybridAdapter, Qwen3NextForCausalLM

ARCHITECTURES: dict[str, tuple[type, type[ModelAdapter]]] = {
    "llama": (LlamaForCausalLM, LlamaAdapter),
    "mistral": (LlamaForCausalLM, LlamaAdapter),
    "qwen2": (LlamaForCausalLM, LlamaAdapter),
    "qwen3": (LlamaForCausalLM, LlamaAdapter),
    # mixture-of-experts: the same decoder with a sparse MoE block as the FFN (models/moe.py)
    "qwen3_moe": (LlamaForCausalLM, LlamaAdapter),
    "qwen2_moe": (LlamaForCausalLM, LlamaAdapter),
    "mixtral": (LlamaForCausalLM, LlamaAdapter),
    "olmoe": (LlamaForCausalLM, LlamaAdapter),
    # hybrid: Gated DeltaNet linear-attention layers beside gated full-attention layers, MoE FFNs
    "qwen3_next": (Qwen3NextForCausalLM, HybridAdapter),
    "gemma3_text": (Gemma3ForCausalLM, Gemma3Adapter),
    # gpt-oss: the same decoder with attention sinks, biased projections and its own MoE options
    "gpt_oss": (LlamaForCausalLM, LlamaAdapter),
    # multi-head latent attention (one cached latent per token and layer) and DeepSeek's experts
    "deepseek_v2": (DeepseekForCausalLM, MLAAdapter),
    "deepseek_v3": (DeepseekForCausalLM, MLAAdapter),
}


def _entry(config: ModelConfig):
    kind = getattr(config, "model_type", "llama") or "llama"
    if kind not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"model_type {kind!r} has no adapter (supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[kind]


def model_class(config: ModelConfig) -> type:
    """The ``nn.Module`` class whose forward computes ``config``'s architecture."""
    return _entry(config)[0]


def adapter_for(model, config: ModelConfig) -> ModelAdapter:
    """The adapter of ``config.model_type``; a clear error for an architecture without one."""
    return _entry(config)[1](model, config)

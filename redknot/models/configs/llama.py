"""The Llama-family attention options (Llama, Mistral, Qwen2/3 and the MoE families built on the same
attention): projection biases and native sliding windows."""

from __future__ import annotations

from .common import UnsupportedModelError


def parse_attention_bias(raw: dict, model_type: str) -> tuple[bool, bool]:
    """(q/k/v projections have a bias, the output projection has one), as transformers builds them."""
    if model_type == "qwen2":  # always q/k/v bias
        return True, False
    if model_type == "qwen2_moe":
        return bool(raw.get("qkv_bias", True)), False
    if model_type in ("mistral", "mixtral"):  # no attention bias whatever the config says
        return False, False
    bias = bool(raw.get("attention_bias", False))
    return bias, bias  # llama, qwen3, qwen3_moe, olmoe, gpt_oss: every projection


def parse_clip_qkv(raw: dict, model_type: str, n_heads: int, head_dim: int) -> float | None:
    """OLMoE's q/k/v clamp (``clip_qkv``; None elsewhere), after checking that its q norm, sized
    hidden_size and applied to the whole q projection, fits."""
    if model_type != "olmoe":
        return None
    if head_dim * n_heads != raw["hidden_size"]:
        raise UnsupportedModelError(
            f"config.json: head_dim={head_dim} x num_attention_heads={n_heads} must equal hidden_size for olmoe")
    clip = raw.get("clip_qkv")
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        raise UnsupportedModelError(f"config.json: clip_qkv={clip!r} must be a positive number or null")
    return float(clip) if clip is not None else None


def parse_sliding_windows(raw: dict, model_type: str, n_layers: int) -> list[int | None]:
    """Each layer's native sliding window (None: full causal) of the Llama, Mistral/Mixtral, OLMoE,
    Qwen2/3 (-MoE, -Next) families, as transformers applies ``sliding_window``."""
    window = raw.get("sliding_window")
    if model_type in ("llama", "olmoe") or not window:
        return [None] * n_layers
    if model_type in ("mistral", "mixtral"):
        return [int(window)] * n_layers
    # qwen2 / qwen3 / qwen2_moe / qwen3_moe: sliding only when enabled
    if not raw.get("use_sliding_window", False):
        return [None] * n_layers
    if model_type == "qwen3_moe":  # every layer (transformers reads no layer_types for it)
        return [int(window)] * n_layers
    types = raw.get("layer_types")
    if types is None and model_type == "qwen2_moe":  # transformers' default: every other layer below max_window_layers
        max_window_layers = raw.get("max_window_layers", 28)
        types = ["sliding_attention" if (i + 1) % 2 and i < max_window_layers else "full_attention"
                 for i in range(n_layers)]
    if types is None:
        max_window_layers = raw.get("max_window_layers", n_layers)
        types = ["sliding_attention" if i >= max_window_layers else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers:
        raise UnsupportedModelError(f"config.json: layer_types has {len(types)} entries for {n_layers} layers")
    return [int(window) if t == "sliding_attention" else None for t in types]

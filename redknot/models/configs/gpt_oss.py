"""gpt-oss: transformers' defaults for absent fields, and its experts (biases, a biased router
whose top k logits are softmaxed, the clamped SwiGLU)."""

from __future__ import annotations

from .common import UnsupportedModelError, positive_int
from .moe import MoEConfig


def gpt_oss_defaults(raw: dict) -> dict:
    """gpt-oss's config with transformers' defaults (GptOssConfig) where a field is absent: bias on
    every attention projection, YaRN RoPE (factor 32 over 4096 positions, theta 150000), sliding
    windows of 128 on the even layers."""
    raw = dict(raw)
    raw.setdefault("attention_bias", True)
    raw.setdefault("sliding_window", 128)
    if not raw.get("rope_parameters") and not raw.get("rope_scaling"):
        raw["rope_parameters"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 4096}
    params = raw.get("rope_parameters") or {}
    if "rope_theta" not in params and "rope_theta" not in raw:
        raw["rope_theta"] = 150000.0
    if raw.get("layer_types") is None:
        raw["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                              for i in range(raw["num_hidden_layers"])]
    return raw


def parse_gpt_oss_moe(raw: dict, n_layers: int) -> MoEConfig:
    n_experts = positive_int(raw, "num_local_experts", 128)
    top_k = positive_int(raw, "num_experts_per_tok", 4)
    if top_k > n_experts:
        raise UnsupportedModelError(f"config.json: num_experts_per_tok={top_k} exceeds num_local_experts={n_experts}")
    limit, alpha = raw.get("swiglu_limit", 7.0), raw.get("swiglu_alpha", 1.702)
    for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise UnsupportedModelError(f"config.json: {key} must be a positive number, got {value!r}")
    return MoEConfig(num_experts=n_experts, top_k=top_k, intermediate_size=raw["intermediate_size"],
                     layers=[True] * n_layers, routing="topk_softmax", activation="swiglu_clamped",
                     swiglu_alpha=float(alpha), swiglu_limit=float(limit), router_bias=True, expert_bias=True,
                     router_name="router", checkpoint_layout="gpt_oss")


def gpt_oss_sliding_windows(raw: dict, n_layers: int) -> list[int | None]:
    """The window on the layers ``layer_types`` marks sliding (``gpt_oss_defaults`` filled both in)."""
    types, window = raw["layer_types"], raw.get("sliding_window")
    if not window:
        return [None] * n_layers
    if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"config.json: layer_types must be {n_layers} entries of "
                                    f"sliding_attention / full_attention, got {types!r}")
    return [int(window) if t == "sliding_attention" else None for t in types]

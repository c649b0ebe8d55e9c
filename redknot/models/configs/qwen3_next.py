"""Qwen3-Next: Gated DeltaNet (linear-attention) layers beside gated full-attention layers."""

from __future__ import annotations

from dataclasses import dataclass

from .common import UnsupportedModelError, positive_int

# linear-attention (Gated DeltaNet) layers beside gated full-attention layers, with MoE FFNs
HYBRID_MODEL_TYPES = ("qwen3_next",)
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


@dataclass
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3-Next): q/k heads of ``key_head_dim``,
    value heads of ``value_head_dim`` (a multiple of the key heads: each k head serves a group), and
    the depthwise causal convolution of width ``conv_kernel`` over the q/k/v channels."""
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def state_elements(self) -> tuple[int, int]:
        """(conv state, recurrent state) elements one sequence holds per linear layer."""
        return self.conv_dim * (self.conv_kernel - 1), self.num_value_heads * self.key_head_dim * self.value_head_dim


def parse_hybrid(raw: dict, model_type: str, n_layers: int) -> dict:
    """Qwen3-Next's layer types (``layer_types``, else transformers' default: every
    ``full_attention_interval``-th layer full), its Gated DeltaNet shape (``linear_*``), the output
    gate of its full layers and its (1 + weight) norms; nothing for other families."""
    if model_type not in HYBRID_MODEL_TYPES:
        return {}
    types = raw.get("layer_types")
    if types is None:
        interval = positive_int(raw, "full_attention_interval", 4)
        types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise UnsupportedModelError(f"config.json: layer_types must list {n_layers} layer types, got {types!r}")
    bad = sorted({t for t in types if t not in (LINEAR_ATTENTION, FULL_ATTENTION)})
    if bad:
        raise UnsupportedModelError(f"config.json: layer_types holds {bad}; supported: {LINEAR_ATTENTION!r}, "
                                    f"{FULL_ATTENTION!r}")
    if FULL_ATTENTION not in types:
        raise UnsupportedModelError("config.json: layer_types has no full_attention layer (a model of linear "
                                    "layers only is not supported)")
    linear = LinearAttentionConfig(
        num_key_heads=positive_int(raw, "linear_num_key_heads", 16),
        num_value_heads=positive_int(raw, "linear_num_value_heads", 32),
        key_head_dim=positive_int(raw, "linear_key_head_dim", 128),
        value_head_dim=positive_int(raw, "linear_value_head_dim", 128),
        conv_kernel=positive_int(raw, "linear_conv_kernel_dim", 4))
    if linear.num_value_heads % linear.num_key_heads:
        raise UnsupportedModelError(
            f"config.json: linear_num_value_heads={linear.num_value_heads} is not a multiple of "
            f"linear_num_key_heads={linear.num_key_heads}")
    if linear.conv_kernel < 2:
        raise UnsupportedModelError(f"config.json: linear_conv_kernel_dim={linear.conv_kernel} must be at least 2")
    return {"layer_types": list(types), "linear": linear, "attn_output_gate": True, "norm_offset": True}

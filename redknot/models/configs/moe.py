"""The sparse mixture-of-experts FFN's config (``MoEConfig``) and the experts of the Qwen-MoE,
Mixtral and OLMoE families."""

from __future__ import annotations

from dataclasses import dataclass

from .common import UnsupportedModelError, positive_int

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")


@dataclass
class MoEConfig:
    """A sparse mixture-of-experts FFN: its experts, its router and the layers that use it."""
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    layers: list[bool]  # per layer: the MoE block (True) or a dense MLP of ModelConfig.intermediate_size
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    # "softmax_topk": softmax over all experts, then the top k (Qwen, Mixtral, OLMoE);
    # "topk_softmax": the top k logits, then a softmax over them (gpt-oss);
    # "softmax_group_topk": softmax, the top k within the topk_group groups of highest best score
    # (DeepSeek-V2's greedy / group_limited_greedy); "sigmoid_group_topk": sigmoid scores, the choice
    # among the topk_group groups of highest top-2 sum and the top k by score + a learned correction
    # bias, weights the scores without it (DeepSeek-V3); both times routed_scaling_factor
    routing: str = "softmax_topk"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False  # the router's e_score_correction_bias (sigmoid_group_topk)
    # "silu": silu(gate) * up; "swiglu_clamped": gpt-oss's (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_bias: bool = False
    expert_bias: bool = False
    shared_expert_intermediate_size: int = 0  # > 0: a shared expert MLP gated by sigmoid(linear(x)) (Qwen2-MoE)
    shared_expert_gated: bool = True  # False: the shared expert's output is added as it is (DeepSeek)
    shared_expert_name: str = "shared_expert"  # its module name in checkpoints ("shared_experts" in DeepSeek)
    router_name: str = "gate"  # the router's module name in checkpoints ("router" in gpt-oss)
    # Fused expert tensors in checkpoints: "gate_up_rows" is transformers' in-memory layout (gate_up
    # [E, 2I, H] gate rows then up rows, down [E, H, I]); "gpt_oss" is [E, H, 2I] with gate and up
    # interleaved and down [E, I, H]
    checkpoint_layout: str = "gate_up_rows"

    def is_moe_layer(self, layer: int) -> bool:
        return self.layers[layer]


def parse_moe(raw: dict, model_type: str, n_layers: int) -> MoEConfig | None:
    """The experts of qwen3_moe / qwen2_moe (``num_experts``, ``moe_intermediate_size``, dense layers
    by ``decoder_sparse_step`` and ``mlp_only_layers``, qwen2_moe's shared expert), mixtral (every
    layer, ``num_local_experts`` of ``intermediate_size``, always renormalised), olmoe (every layer,
    ``num_experts`` of ``intermediate_size``) and qwen3_next (as qwen2_moe: a shared expert); None
    where every layer is dense. gpt-oss's are in ``configs/gpt_oss.py``, DeepSeek's in
    ``configs/deepseek.py``."""
    expert_key = "num_experts" if "num_experts" in raw else "num_local_experts"
    n_experts = raw.get(expert_key)
    if model_type in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        if not isinstance(n_experts, int) or n_experts < 0:
            raise UnsupportedModelError(f"config.json: {expert_key} must be a non-negative integer, got {n_experts!r}")
        step = positive_int(raw, "decoder_sparse_step", 1)
        dense = raw.get("mlp_only_layers") or []
        if not all(isinstance(i, int) and 0 <= i < n_layers for i in dense):
            raise UnsupportedModelError(f"config.json: mlp_only_layers={dense!r} must hold layer indices < {n_layers}")
        layers = [n_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n_layers)]
        if not any(layers):
            return None  # every layer dense: a plain decoder
        size = positive_int(raw, "moe_intermediate_size")
    else:  # mixtral, olmoe: every layer, experts of intermediate_size
        n_experts = positive_int(raw, expert_key)
        layers = [True] * n_layers
        size = raw["intermediate_size"]
    top_k = positive_int(raw, "num_experts_per_tok")
    if top_k > n_experts:
        raise UnsupportedModelError(f"config.json: num_experts_per_tok={top_k} exceeds {expert_key}={n_experts}")
    shared = 0
    if model_type in ("qwen2_moe", "qwen3_next"):
        shared = positive_int(raw, "shared_expert_intermediate_size")
    norm = True if model_type == "mixtral" else raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise UnsupportedModelError(f"config.json: norm_topk_prob must be true or false, got {norm!r}")
    return MoEConfig(num_experts=n_experts, top_k=top_k, intermediate_size=size, layers=layers,
                     norm_topk_prob=norm, shared_expert_intermediate_size=shared)

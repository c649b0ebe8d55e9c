"""DeepSeek-V2/V3: multi-head latent attention (``MLAConfig``) and DeepSeek's routed and shared
experts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .common import UnsupportedModelError, positive_int
from .moe import MoEConfig

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention, DeepSeek's MoE


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank
    projection; keys and values of every head expanded from one normed latent of ``kv_lora_rank``
    per token, plus one RoPE key part of ``qk_rope_head_dim`` shared by the heads."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the RoPE dims come as interleaved pairs (x0, x1), (x2, x3), ...
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What the cache holds per token and layer: the RoPE key part, then the latent."""
        return self.qk_rope_head_dim + self.kv_lora_rank


def parse_mla(raw: dict, model_type: str, n_heads: int, n_kv: int) -> MLAConfig | None:
    """DeepSeek-V2/V3's latent attention, as transformers computes it: every key and value head
    expanded from one latent (``num_key_value_heads`` is the query heads'), RoPE on the last
    ``qk_rope_head_dim`` dims of each query and on a key part shared by the heads, interleaved
    pairs in V2 and with ``rope_interleave`` in V3, YaRN's ``mscale_all_dim`` in the softmax scale."""
    if model_type not in MLA_MODEL_TYPES:
        return None
    if n_kv != n_heads:
        raise UnsupportedModelError(f"config.json: num_key_value_heads={n_kv} must equal num_attention_heads="
                                    f"{n_heads} for {model_type} (every head's keys come from the one latent)")
    q_lora = raw.get("q_lora_rank")
    if q_lora is not None:
        q_lora = positive_int(raw, "q_lora_rank")
    rank = positive_int(raw, "kv_lora_rank")
    nope = positive_int(raw, "qk_nope_head_dim")
    rope_dim = positive_int(raw, "qk_rope_head_dim")
    v_dim = positive_int(raw, "v_head_dim")
    if rope_dim % 2:
        raise UnsupportedModelError(f"config.json: qk_rope_head_dim={rope_dim} must be even")
    if (rank + rope_dim) % 2 or rope_dim > (rank + rope_dim) // 2:
        # the pool keeps a token's [RoPE key | latent] row as its K and V halves, the RoPE part in K
        raise UnsupportedModelError(f"config.json: kv_lora_rank={rank} + qk_rope_head_dim={rope_dim} must be even "
                                    f"with qk_rope_head_dim at most half of it")
    if raw.get("attention_dropout"):
        raise UnsupportedModelError(f"config.json: attention_dropout={raw['attention_dropout']!r} (inference only)")
    interleave = True if model_type == "deepseek_v2" else raw.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise UnsupportedModelError(f"config.json: rope_interleave must be true or false, got {interleave!r}")
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    scale = (nope + rope_dim) ** -0.5
    factor, all_dim = params.get("factor"), params.get("mscale_all_dim")
    if params.get("rope_type", params.get("type", "default")) != "default" and all_dim:
        if not isinstance(factor, (int, float)):
            raise UnsupportedModelError(f"config.json: rope factor={factor!r} must be a number with mscale_all_dim")
        m = 0.1 * all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return MLAConfig(q_lora, rank, nope, rope_dim, v_dim, interleave, scale)


def parse_deepseek_moe(raw: dict, model_type: str, n_layers: int) -> MoEConfig | None:
    """DeepSeek's experts: ``n_routed_experts`` of ``moe_intermediate_size`` from layer
    ``first_k_dense_replace`` on, ``n_shared_experts`` of them fused into one ungated shared expert,
    weights times ``routed_scaling_factor``. V2 routes by softmax (``topk_method`` greedy or
    group_limited_greedy over ``n_group`` groups); V3 by sigmoid scores plus ``e_score_correction_bias``
    within the ``topk_group`` best of ``n_group`` groups, renormalised with ``norm_topk_prob``."""
    n_experts = positive_int(raw, "n_routed_experts")
    top_k = positive_int(raw, "num_experts_per_tok")
    if top_k > n_experts:
        raise UnsupportedModelError(f"config.json: num_experts_per_tok={top_k} exceeds n_routed_experts={n_experts}")
    first = raw.get("first_k_dense_replace", 3 if model_type == "deepseek_v3" else 0)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise UnsupportedModelError(f"config.json: first_k_dense_replace={first!r} must be an integer >= 0")
    if raw.get("moe_layer_freq", 1) != 1:
        raise UnsupportedModelError(f"config.json: moe_layer_freq={raw['moe_layer_freq']!r} is not supported (only 1)")
    layers = [i >= first for i in range(n_layers)]
    if not any(layers):
        return None
    size = positive_int(raw, "moe_intermediate_size")
    shared = raw.get("n_shared_experts", 1 if model_type == "deepseek_v3" else 2) or 0
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise UnsupportedModelError(f"config.json: n_shared_experts={shared!r} must be an integer >= 0")
    scaling = raw.get("routed_scaling_factor", 2.5 if model_type == "deepseek_v3" else 1.0)
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or scaling <= 0:
        raise UnsupportedModelError(f"config.json: routed_scaling_factor={scaling!r} must be a positive number")
    norm = raw.get("norm_topk_prob", model_type == "deepseek_v3")
    if not isinstance(norm, bool):
        raise UnsupportedModelError(f"config.json: norm_topk_prob must be true or false, got {norm!r}")
    if model_type == "deepseek_v3":
        routing, scoring, method, grouped = "sigmoid_group_topk", "sigmoid", "noaux_tc", True
    else:
        routing, scoring = "softmax_group_topk", "softmax"
        method = raw.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(f"config.json: topk_method={method!r} is not supported for deepseek_v2 "
                                        f"(greedy, group_limited_greedy)")
        grouped = method == "group_limited_greedy"
        if norm:  # transformers' DeepSeek-V2 router never renormalises: ambiguous, refused
            raise UnsupportedModelError("config.json: norm_topk_prob=true is not supported for deepseek_v2")
    if model_type == "deepseek_v3" and raw.get("topk_method", method) != method:
        raise UnsupportedModelError(f"config.json: topk_method={raw['topk_method']!r} is not supported for "
                                    f"deepseek_v3 (noaux_tc)")
    if raw.get("scoring_func", scoring) != scoring:
        raise UnsupportedModelError(f"config.json: scoring_func={raw['scoring_func']!r} is not supported for "
                                    f"{model_type} ({scoring})")
    n_group, topk_group = 1, 1
    if grouped:
        n_group = positive_int(raw, "n_group")
        topk_group = positive_int(raw, "topk_group")
        if n_experts % n_group or topk_group > n_group:
            raise UnsupportedModelError(f"config.json: n_group={n_group} must divide n_routed_experts={n_experts} "
                                        f"and topk_group={topk_group} be at most n_group")
        if top_k > topk_group * (n_experts // n_group):
            raise UnsupportedModelError(f"config.json: num_experts_per_tok={top_k} exceeds the experts of "
                                        f"topk_group={topk_group} groups")
        if routing == "sigmoid_group_topk" and n_experts // n_group < 2:
            raise UnsupportedModelError(f"config.json: n_group={n_group} leaves fewer than 2 experts per group "
                                        f"(a group scores by its top two)")
    return MoEConfig(num_experts=n_experts, top_k=top_k, intermediate_size=size, layers=layers, norm_topk_prob=norm,
                     routing=routing, n_group=n_group, topk_group=topk_group, routed_scaling_factor=float(scaling),
                     score_correction_bias=model_type == "deepseek_v3",
                     shared_expert_intermediate_size=size * shared, shared_expert_gated=False,
                     shared_expert_name="shared_experts")

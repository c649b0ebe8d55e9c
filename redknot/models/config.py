"""Model configuration: the subset of an HF ``config.json`` that the forward needs, as one
``ModelConfig`` (the Llama-family decoder, and what each family adds to it: experts, DeepSeek's
latent attention, Gemma 3's layer pattern, Qwen3-Next's linear-attention layers).

Each family's parsing lives in ``models/configs/`` (llama, moe, gpt_oss, deepseek, gemma3,
qwen3_next; the shared strict helpers and RoPE in ``common``); this module checks the fields every
family shares and assembles them. Parsing is strict: an architecture or option we do not implement
raises ``UnsupportedModelError`` naming the config field, instead of silently computing something
else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .configs.common import (DEQUANTISED_AT_LOAD, SUPPORTED_ROPE_TYPES, RopeConfig, UnsupportedModelError,
                             as_int_list, check_quantization, parse_rope)
from .configs.deepseek import MLA_MODEL_TYPES, MLAConfig, parse_deepseek_moe, parse_mla
from .configs.gemma3 import gemma3_fields
from .configs.gpt_oss import gpt_oss_defaults, gpt_oss_sliding_windows, parse_gpt_oss_moe
from .configs.llama import parse_attention_bias, parse_clip_qkv, parse_sliding_windows
from .configs.moe import MOE_MODEL_TYPES, MoEConfig, parse_moe
from .configs.qwen3_next import (FULL_ATTENTION, HYBRID_MODEL_TYPES, LINEAR_ATTENTION, LinearAttentionConfig,
                                 parse_hybrid)

__all__ = ["DEQUANTISED_AT_LOAD", "FULL_ATTENTION", "HYBRID_MODEL_TYPES", "LINEAR_ATTENTION", "MLA_MODEL_TYPES",
           "MOE_MODEL_TYPES", "SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES", "LinearAttentionConfig", "MLAConfig",
           "ModelConfig", "MoEConfig", "RopeConfig", "UnsupportedModelError"]

SUPPORTED_MODEL_TYPES = (("llama", "mistral", "qwen2", "qwen3", "gemma3_text") + MOE_MODEL_TYPES + MLA_MODEL_TYPES
                         + HYBRID_MODEL_TYPES)


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_per_head: bool = True  # False: one RMSNorm over the whole q (and k) projection (OLMoE)
    clip_qkv: float | None = None  # clamp q, k, v to [-clip, clip] after the norms (OLMoE)
    o_proj_bias: bool = False
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None  # DeepSeek's latent attention (head_dim: its per-head query/key width)
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Per-layer native sliding window of the architecture (None = full causal).
    sliding_windows: list[int | None] = field(default_factory=list)
    # A learned sink logit per query head in every attention softmax (gpt-oss: ``self_attn.sinks``).
    attention_sinks: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    hidden_act: str = "silu"
    # Gemma 3: the sliding-window layers' own RoPE (None: every layer rotates with ``rope``)
    local_rope: RopeConfig | None = None
    # Attention scores scale by query_pre_attn_scalar**-0.5 (None: head_dim**-0.5)
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # Hybrid models: each layer's token mixer ("linear_attention" or "full_attention"; empty: every
    # layer full attention), the linear layers' shape, the full layers' sigmoid output gate, and
    # norms that scale by (1 + weight) (Qwen3-Next's zero-centred RMSNorm)
    layer_types: list[str] = field(default_factory=list)
    linear: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
    norm_offset: bool = False

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer)

    def is_linear_layer(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def attention_layers(self) -> list[int]:
        """The layers with softmax attention over K/V pages (every layer but a hybrid's linear ones)."""
        return [i for i in range(self.num_hidden_layers) if not self.is_linear_layer(i)]

    @property
    def is_hybrid(self) -> bool:
        return self.linear is not None

    def attention_flops(self) -> tuple[int, int]:
        """FLOPs of attention: (per row through the projections, per visible (query, key) pair and
        query head). MLA as transformers computes it (and a GPU prefill does): each row's latent
        expanded once to every head's key and value, then (dn + dr) + dv multiply-adds a pair."""
        h, hq = self.hidden_size, self.num_attention_heads
        if self.mla is None:
            d = self.head_dim
            gate = hq if self.attn_output_gate else 0  # a hybrid's full layers: q_proj also gives the gate
            return 2 * h * d * (2 * hq + gate + 2 * self.num_key_value_heads), 4 * d
        m = self.mla
        q = h * hq * m.qk_head_dim if m.q_lora_rank is None else m.q_lora_rank * (h + hq * m.qk_head_dim)
        expand = hq * m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim)
        return 2 * (q + h * m.latent_dim + expand + hq * m.v_head_dim * h), 2 * (m.qk_head_dim + m.v_head_dim)

    def ffn_flops_per_row(self, layer: int) -> tuple[int, int]:
        """FLOPs of one row through layer ``layer``'s FFN: (the part a sparse FFN skips, the part every
        row runs). Dense: the MLP and 0; MoE: the router and the k routed experts, and the shared
        expert with its gate (zero without one)."""
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            return 2 * 3 * h * self.intermediate_size, 0
        m = self.moe
        shared = m.shared_expert_intermediate_size
        return (2 * h * m.num_experts + 2 * 3 * h * m.intermediate_size * m.top_k,
                2 * 3 * h * shared + 2 * h if shared else 0)

    @property
    def attention_scale(self) -> float:
        """The softmax scale of every attention layer's scores. The backends and every attention-mass
        computation (recovery, selection, profiling) take it as their scale instead of q being
        pre-scaled by scale * sqrt(head_dim): in bf16 a pre-scaled q is rounded once more (Gemma 3
        27B scales by 168**-0.5, not by its head_dim 128's), so the kernels would differ from the model.
        MLA: its own (qk_head_dim ** -0.5 with YaRN's mscale)."""
        if self.mla is not None:
            return self.mla.softmax_scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE layer ``layer`` rotates its queries and keys with."""
        if self.local_rope is not None and self.sliding_windows and self.sliding_windows[layer]:
            return self.local_rope
        return self.rope

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path}: no config.json (expected an HF checkpoint directory)")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise UnsupportedModelError(f"{cfg_file}: malformed JSON ({e})") from None
        cfg = cls.from_dict(raw)
        gen = path / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                cfg.eos_token_ids = as_int_list(eos)
        return cfg

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type == "gemma3":
            raise UnsupportedModelError(
                "config.json: model_type='gemma3' is Gemma 3 with its vision tower (Gemma3ForConditionalGeneration); "
                "only the text model is supported (model_type 'gemma3_text', Gemma3ForCausalLM)")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"config.json: model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        gemma = model_type == "gemma3_text"
        act_key, act_supported = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
        act = raw.get(act_key) or act_supported
        if act != act_supported:
            raise UnsupportedModelError(f"config.json: {act_key}={act!r} is not supported (only {act_supported!r})")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(raw.get(key), int) or raw[key] <= 0:
                raise UnsupportedModelError(f"config.json: {key} must be a positive integer, got {raw.get(key)!r}")
        n_heads = raw["num_attention_heads"]
        n_kv = raw.get("num_key_value_heads") or n_heads
        if n_heads % n_kv:
            raise UnsupportedModelError(
                f"config.json: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}"
            )
        head_dim = raw.get("head_dim") or (256 if gemma else raw["hidden_size"] // n_heads)
        mla = parse_mla(raw, model_type, n_heads, n_kv)
        if mla is not None:  # a query head's width; RoPE covers its last qk_rope_head_dim dims
            head_dim = mla.qk_head_dim
        n_layers = raw["num_hidden_layers"]
        eos = raw.get("eos_token_id")
        check_quantization(raw, model_type)
        if gemma:
            return cls(**gemma3_fields(raw, n_heads, n_kv, head_dim, n_layers))
        if model_type == "gpt_oss":
            raw = gpt_oss_defaults(raw)
        attention_bias, o_proj_bias = parse_attention_bias(raw, model_type)
        clip = parse_clip_qkv(raw, model_type, n_heads, head_dim)
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) and model_type != "deepseek_v3",
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe", "qwen3_next"),
            qk_norm_per_head=model_type != "olmoe",
            clip_qkv=clip,
            moe=_parse_experts(raw, model_type, n_layers),
            mla=mla,
            rope=parse_rope(raw, head_dim if mla is None else mla.qk_rope_head_dim),
            sliding_windows=_sliding_windows(raw, model_type, n_layers),
            attention_sinks=model_type == "gpt_oss",
            eos_token_ids=as_int_list(eos) if eos is not None else [],
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            **parse_hybrid(raw, model_type, n_layers),
        )


def _parse_experts(raw: dict, model_type: str, n_layers: int) -> MoEConfig | None:
    """The family's experts (None for a dense model)."""
    if model_type in MLA_MODEL_TYPES:
        return parse_deepseek_moe(raw, model_type, n_layers)
    if model_type == "gpt_oss":
        return parse_gpt_oss_moe(raw, n_layers)
    if model_type in MOE_MODEL_TYPES + HYBRID_MODEL_TYPES:
        return parse_moe(raw, model_type, n_layers)
    return None


def _sliding_windows(raw: dict, model_type: str, n_layers: int) -> list[int | None]:
    """Each layer's native sliding window (None: full causal attention)."""
    if model_type in MLA_MODEL_TYPES:
        return [None] * n_layers
    if model_type == "gpt_oss":
        return gpt_oss_sliding_windows(raw, n_layers)
    return parse_sliding_windows(raw, model_type, n_layers)

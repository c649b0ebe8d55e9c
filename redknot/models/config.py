"""Model configuration: the subset of an HF ``config.json`` that the Llama-family forward needs
(dense, and the mixture-of-experts families whose layers differ from it only in the FFN), and
DeepSeek's multi-head latent attention (``MLAConfig``, ``models/deepseek.py``).

Parsing is strict: an architecture or option we do not implement raises ``UnsupportedModelError``
naming the config field, instead of silently computing something else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")
# linear-attention (Gated DeltaNet) layers beside gated full-attention layers, with MoE FFNs
HYBRID_MODEL_TYPES = ("qwen3_next",)
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention, DeepSeek's MoE
SUPPORTED_MODEL_TYPES = (("llama", "mistral", "qwen2", "qwen3", "gemma3_text") + MOE_MODEL_TYPES + MLA_MODEL_TYPES
                         + HYBRID_MODEL_TYPES)
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this runner does not implement."""


@dataclass
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    partial_rotary_factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


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
                cfg.eos_token_ids = _as_int_list(eos)
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
        mla = _parse_mla(raw, model_type, n_heads, n_kv)
        if mla is not None:  # a query head's width; RoPE covers its last qk_rope_head_dim dims
            head_dim = mla.qk_head_dim
        n_layers = raw["num_hidden_layers"]
        eos = raw.get("eos_token_id")
        _check_quantization(raw, model_type)
        if gemma:
            return cls._gemma3(raw, n_heads, n_kv, head_dim, n_layers)
        if model_type == "gpt_oss":
            raw = _gpt_oss_defaults(raw)
        attention_bias, o_proj_bias = _parse_attention_bias(raw, model_type)
        if model_type == "olmoe" and head_dim * n_heads != raw["hidden_size"]:
            # OLMoE's q norm is sized hidden_size and applied to the whole q projection
            raise UnsupportedModelError(
                f"config.json: head_dim={head_dim} x num_attention_heads={n_heads} must equal hidden_size for olmoe")
        clip = raw.get("clip_qkv") if model_type == "olmoe" else None
        if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
            raise UnsupportedModelError(f"config.json: clip_qkv={clip!r} must be a positive number or null")
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
            clip_qkv=float(clip) if clip is not None else None,
            moe=_parse_moe(raw, model_type, n_layers),
            mla=mla,
            rope=_parse_rope(raw, head_dim if mla is None else mla.qk_rope_head_dim),
            sliding_windows=_parse_sliding_windows(raw, model_type, n_layers),
            attention_sinks=model_type == "gpt_oss",
            eos_token_ids=_as_int_list(eos) if eos is not None else [],
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            **_parse_hybrid(raw, model_type, n_layers),
        )


    @classmethod
    def _gemma3(cls, raw: dict, n_heads: int, n_kv: int, head_dim: int, n_layers: int) -> "ModelConfig":
        """Gemma 3 text (transformers' Gemma3TextConfig defaults where a field is missing)."""
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if raw.get(key):
                raise UnsupportedModelError(f"config.json: {key}={raw[key]!r} is not supported (only null/false)")
        rope, local_rope = _parse_gemma3_rope(raw, head_dim)
        eos = raw.get("eos_token_id", 1)
        softcap = raw.get("final_logit_softcapping")
        return cls(
            model_type="gemma3_text", vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_hidden_layers=n_layers, num_attention_heads=n_heads,
            num_key_value_heads=n_kv, head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 131072),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            attention_bias=bool(raw.get("attention_bias", False)), qk_norm=True,
            rope=rope, local_rope=local_rope, sliding_windows=_gemma3_sliding_windows(raw, n_layers),
            eos_token_ids=_as_int_list(eos) if eos is not None else [], bos_token_id=raw.get("bos_token_id", 2),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"), hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 256),
            final_logit_softcapping=float(softcap) if softcap else None,
        )


def _as_int_list(x) -> list[int]:
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def _parse_rope(raw: dict, head_dim: int) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("config.json: per-layer-type rope_parameters are not supported")
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    field_name = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json: {field_name}.rope_type={rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    prf = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if not 0 < prf <= 1 or int(head_dim * prf) % 2:
        raise UnsupportedModelError(
            f"config.json: partial_rotary_factor={prf} must give an even rotary dim in (0, head_dim={head_dim}]"
        )
    rc = RopeConfig(
        theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        partial_rotary_factor=float(prf),
    )
    if rope_type != "default":
        if params.get("factor") is None and rope_type != "yarn":
            raise UnsupportedModelError(f"config.json: {field_name}.factor is required for rope_type={rope_type!r}")
        rc.factor = float(params["factor"]) if params.get("factor") is not None else None
    if rope_type in ("llama3", "yarn"):
        rc.original_max_position_embeddings = int(
            raw.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or raw.get("max_position_embeddings", 2048)
        )
    if rope_type == "llama3":
        rc.low_freq_factor = float(params.get("low_freq_factor", 1.0))
        rc.high_freq_factor = float(params.get("high_freq_factor", 4.0))
    if rope_type == "yarn":
        if rc.factor is None:
            rc.factor = raw.get("max_position_embeddings", 2048) / rc.original_max_position_embeddings
        rc.beta_fast = float(params.get("beta_fast") or 32.0)
        rc.beta_slow = float(params.get("beta_slow") or 1.0)
        rc.attention_factor = params.get("attention_factor")
        rc.mscale = params.get("mscale")
        rc.mscale_all_dim = params.get("mscale_all_dim")
        rc.truncate = bool(params.get("truncate", True))
    return rc


# MXFP4 experts are dequantised at load (models/mxfp4.py); no other quantisation is implemented.
DEQUANTISED_AT_LOAD = {"gpt_oss": ("mxfp4",)}


def _check_quantization(raw: dict, model_type: str) -> None:
    quant = raw.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in DEQUANTISED_AT_LOAD.get(model_type, ()):
        raise UnsupportedModelError(
            f"config.json: quantization_config.quant_method={method!r} is not supported for {model_type} "
            "(load an unquantised bf16/fp32 checkpoint)")


def _gpt_oss_defaults(raw: dict) -> dict:
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


def _parse_attention_bias(raw: dict, model_type: str) -> tuple[bool, bool]:
    """(q/k/v projections have a bias, the output projection has one), as transformers builds them."""
    if model_type == "qwen2":  # always q/k/v bias
        return True, False
    if model_type == "qwen2_moe":
        return bool(raw.get("qkv_bias", True)), False
    if model_type in ("mistral", "mixtral"):  # no attention bias whatever the config says
        return False, False
    bias = bool(raw.get("attention_bias", False))
    return bias, bias  # llama, qwen3, qwen3_moe, olmoe, gpt_oss: every projection


def _positive_int(raw: dict, key: str, default=None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UnsupportedModelError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _parse_moe(raw: dict, model_type: str, n_layers: int) -> MoEConfig | None:
    """The experts of qwen3_moe / qwen2_moe (``num_experts``, ``moe_intermediate_size``, dense layers
    by ``decoder_sparse_step`` and ``mlp_only_layers``, qwen2_moe's shared expert), mixtral (every
    layer, ``num_local_experts`` of ``intermediate_size``, always renormalised) and olmoe (every
    layer, ``num_experts`` of ``intermediate_size``), gpt_oss (every layer, ``num_local_experts`` of
    ``intermediate_size`` with biases, a biased router whose top k logits are softmaxed, the clamped
    SwiGLU of ``swiglu_limit``); DeepSeek's in ``_parse_deepseek_moe``; qwen3_next as qwen2_moe (a
    shared expert)."""
    if model_type in MLA_MODEL_TYPES:
        return _parse_deepseek_moe(raw, model_type, n_layers)
    if model_type not in MOE_MODEL_TYPES + HYBRID_MODEL_TYPES:
        return None
    if model_type == "gpt_oss":
        return _parse_gpt_oss_moe(raw, n_layers)
    expert_key = "num_experts" if "num_experts" in raw else "num_local_experts"
    n_experts = raw.get(expert_key)
    if model_type in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        if not isinstance(n_experts, int) or n_experts < 0:
            raise UnsupportedModelError(f"config.json: {expert_key} must be a non-negative integer, got {n_experts!r}")
        step = _positive_int(raw, "decoder_sparse_step", 1)
        dense = raw.get("mlp_only_layers") or []
        if not all(isinstance(i, int) and 0 <= i < n_layers for i in dense):
            raise UnsupportedModelError(f"config.json: mlp_only_layers={dense!r} must hold layer indices < {n_layers}")
        layers = [n_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n_layers)]
        if not any(layers):
            return None  # every layer dense: a plain decoder
        size = _positive_int(raw, "moe_intermediate_size")
    else:  # mixtral, olmoe: every layer, experts of intermediate_size
        n_experts = _positive_int(raw, expert_key)
        layers = [True] * n_layers
        size = raw["intermediate_size"]
    top_k = _positive_int(raw, "num_experts_per_tok")
    if top_k > n_experts:
        raise UnsupportedModelError(f"config.json: num_experts_per_tok={top_k} exceeds {expert_key}={n_experts}")
    shared = 0
    if model_type in ("qwen2_moe", "qwen3_next"):
        shared = _positive_int(raw, "shared_expert_intermediate_size")
    norm = True if model_type == "mixtral" else raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise UnsupportedModelError(f"config.json: norm_topk_prob must be true or false, got {norm!r}")
    return MoEConfig(num_experts=n_experts, top_k=top_k, intermediate_size=size, layers=layers,
                     norm_topk_prob=norm, shared_expert_intermediate_size=shared)


def _parse_hybrid(raw: dict, model_type: str, n_layers: int) -> dict:
    """Qwen3-Next's layer types (``layer_types``, else transformers' default: every
    ``full_attention_interval``-th layer full), its Gated DeltaNet shape (``linear_*``), the output
    gate of its full layers and its (1 + weight) norms; nothing for other families."""
    if model_type not in HYBRID_MODEL_TYPES:
        return {}
    types = raw.get("layer_types")
    if types is None:
        interval = _positive_int(raw, "full_attention_interval", 4)
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
        num_key_heads=_positive_int(raw, "linear_num_key_heads", 16),
        num_value_heads=_positive_int(raw, "linear_num_value_heads", 32),
        key_head_dim=_positive_int(raw, "linear_key_head_dim", 128),
        value_head_dim=_positive_int(raw, "linear_value_head_dim", 128),
        conv_kernel=_positive_int(raw, "linear_conv_kernel_dim", 4))
    if linear.num_value_heads % linear.num_key_heads:
        raise UnsupportedModelError(
            f"config.json: linear_num_value_heads={linear.num_value_heads} is not a multiple of "
            f"linear_num_key_heads={linear.num_key_heads}")
    if linear.conv_kernel < 2:
        raise UnsupportedModelError(f"config.json: linear_conv_kernel_dim={linear.conv_kernel} must be at least 2")
    return {"layer_types": list(types), "linear": linear, "attn_output_gate": True, "norm_offset": True}


def _parse_mla(raw: dict, model_type: str, n_heads: int, n_kv: int) -> MLAConfig | None:
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
        q_lora = _positive_int(raw, "q_lora_rank")
    rank = _positive_int(raw, "kv_lora_rank")
    nope = _positive_int(raw, "qk_nope_head_dim")
    rope_dim = _positive_int(raw, "qk_rope_head_dim")
    v_dim = _positive_int(raw, "v_head_dim")
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


def _parse_deepseek_moe(raw: dict, model_type: str, n_layers: int) -> MoEConfig | None:
    """DeepSeek's experts: ``n_routed_experts`` of ``moe_intermediate_size`` from layer
    ``first_k_dense_replace`` on, ``n_shared_experts`` of them fused into one ungated shared expert,
    weights times ``routed_scaling_factor``. V2 routes by softmax (``topk_method`` greedy or
    group_limited_greedy over ``n_group`` groups); V3 by sigmoid scores plus ``e_score_correction_bias``
    within the ``topk_group`` best of ``n_group`` groups, renormalised with ``norm_topk_prob``."""
    n_experts = _positive_int(raw, "n_routed_experts")
    top_k = _positive_int(raw, "num_experts_per_tok")
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
    size = _positive_int(raw, "moe_intermediate_size")
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
        n_group = _positive_int(raw, "n_group")
        topk_group = _positive_int(raw, "topk_group")
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


def _parse_gpt_oss_moe(raw: dict, n_layers: int) -> MoEConfig:
    n_experts = _positive_int(raw, "num_local_experts", 128)
    top_k = _positive_int(raw, "num_experts_per_tok", 4)
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


def _parse_gemma3_rope(raw: dict, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) RoPE of Gemma 3: ``rope_parameters`` per layer type (transformers >= 5), or
    rope_theta + rope_scaling for the full-attention layers and rope_local_base_freq (unscaled)
    for the sliding ones. Missing bases default as transformers' do (1e6 global, 1e4 local)."""
    per_type = raw.get("rope_parameters") or {}
    if per_type and not all(isinstance(v, dict) for v in per_type.values()):
        per_type = {"full_attention": per_type}  # one flat dict: the global layers' (as rope_scaling)
    unknown = set(per_type) - {"full_attention", "sliding_attention"}
    if unknown:
        raise UnsupportedModelError(f"config.json: rope_parameters for layer types {sorted(unknown)} are not supported")
    full = {"rope_theta": raw.get("rope_theta", 1_000_000.0), **(raw.get("rope_scaling") or {}),
            **(per_type.get("full_attention") or {})}
    local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0), **(per_type.get("sliding_attention") or {})}
    rest = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    return (_parse_rope({**rest, "rope_parameters": full}, head_dim),
            _parse_rope({**rest, "rope_parameters": local}, head_dim))


def _gemma3_sliding_windows(raw: dict, n_layers: int) -> list[int | None]:
    """Gemma 3's ``layer_types`` (else every ``sliding_window_pattern``-th layer full, the rest
    sliding) with its ``sliding_window``."""
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers:
        raise UnsupportedModelError(f"config.json: layer_types has {len(types)} entries for {n_layers} layers")
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        raise UnsupportedModelError(f"config.json: layer_types {bad} are not supported")
    window = raw.get("sliding_window", 4096)
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise UnsupportedModelError(f"config.json: sliding_window={window!r} must be a positive integer "
                                    f"for the sliding_attention layers")
    return [int(window) if t == "sliding_attention" else None for t in types]


def _parse_sliding_windows(raw: dict, model_type: str, n_layers: int) -> list[int | None]:
    window = raw.get("sliding_window")
    if model_type in ("llama", "olmoe") + MLA_MODEL_TYPES or not window:
        return [None] * n_layers
    if model_type in ("mistral", "mixtral"):
        return [int(window)] * n_layers
    if model_type == "gpt_oss":  # always on the layers `layer_types` marks (defaults filled in)
        types = raw["layer_types"]
        if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise UnsupportedModelError(f"config.json: layer_types must be {n_layers} entries of "
                                        f"sliding_attention / full_attention, got {types!r}")
        return [int(window) if t == "sliding_attention" else None for t in types]
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

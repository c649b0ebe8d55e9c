"""What the GPU benchmarks share: the random-weight architectures they build, their name lists,
the synthetic head plans, the HF baseline model, a device sync."""

from __future__ import annotations

import torch

from ..config import HeadConfig
from ..models.config import ModelConfig

ARCHS = {
    "mistral-7b": {"model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 262144, "rope_theta": 1e6, "rms_norm_eps": 1e-5},
    "qwen3-8b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 262144, "rope_theta": 1e6, "rms_norm_eps": 1e-6},
    # mixture of experts: 128 experts of 768, 8 per token (3.3B of 30.5B parameters active per token);
    # intermediate_size is the dense MLP's of layers mlp_only_layers would make dense (none here)
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "max_position_embeddings": 40960, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                      "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": True},
    # hybrid: Qwen3-Next-80B-A3B at its real widths (Gated DeltaNet layers of 16 key / 32 value heads of
    # 128, full layers of 16 query / 2 KV heads of 256 with a quarter rotated, 512 experts of 512 with
    # 10 per token and a shared expert) but 12 of its 48 layers (9 linear + 3 full), so the bf16
    # weights (~40 GB) fit one 80 GB card
    "qwen3-next-a3b-12l": {"model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
                           "intermediate_size": 5120, "num_hidden_layers": 12, "num_attention_heads": 16,
                           "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 262144,
                           "rope_theta": 1e7, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
                           "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                           "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                           "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                           "shared_expert_intermediate_size": 512, "norm_topk_prob": True},
    # gpt-oss: 32 experts of 2880 with biases, 4 per token (3.6B of 20.9B parameters active per token);
    # layers alternate a 128-token sliding window and full attention, every head has a learned sink
    "gpt-oss-20b": {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
                    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "attention_bias": True,
                    "num_local_experts": 32, "num_experts_per_tok": 4, "swiglu_limit": 7.0, "sliding_window": 128,
                    "layer_types": ["sliding_attention", "full_attention"] * 12, "rope_theta": 150000.0,
                    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 4096}},
    # DeepSeek-V2-Lite: multi-head latent attention (a 512-wide latent + a 64-dim RoPE key per token
    # and layer, 16 query heads of 128 + 64), no q LoRA; 64 experts of 1408 (top-6, 2 shared) from
    # layer 1 on (2.4B of 15.7B parameters active per token)
    "deepseek-v2-lite": {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
                         "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16,
                         "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
                         "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6,
                         "n_shared_experts": 2, "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
                         "topk_method": "greedy", "routed_scaling_factor": 1.0, "norm_topk_prob": False,
                         "max_position_embeddings": 163840, "rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    # CPU smoke tests
    "tiny-deepseek": {"model_type": "deepseek_v3", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
                      "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
                      "q_lora_rank": 24, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
                      "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2,
                      "topk_group": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                      "max_position_embeddings": 4096},
    "tiny-gpt-oss": {"model_type": "gpt_oss", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 32,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "max_position_embeddings": 4096, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 150000.0,
                     "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 128}},
    "tiny-hybrid": {"model_type": "qwen3_next", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "max_position_embeddings": 4096, "partial_rotary_factor": 0.25, "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 48, "norm_topk_prob": True},
    "tiny-moe": {"model_type": "qwen3_moe", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "max_position_embeddings": 4096, "num_experts": 8, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "norm_topk_prob": True},
    # Gemma 3 12B / 27B text (the language model of the released checkpoints): five 1024-token
    # sliding-window layers to one global, local RoPE base 1e4, global 1e6 with linear scaling 8
    "gemma3-12b": {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 3840,
                   "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
                   "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "max_position_embeddings": 131072,
                   "rms_norm_eps": 1e-6},
    "gemma3-27b": {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 5376,
                   "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
                   "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024,
                   "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "max_position_embeddings": 131072,
                   "rms_norm_eps": 1e-6},
    "tiny-gemma3": {"model_type": "gemma3_text", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "query_pre_attn_scalar": 24, "sliding_window": 32, "sliding_window_pattern": 6,
                    "rope_theta": 1e6, "rope_local_base_freq": 1e4, "max_position_embeddings": 4096},
    # tensor-parallel runs (bench tp / decode / capacity at --tensor-parallel-size 4 or 8)
    "llama-3-70b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    "tiny": {"model_type": "llama", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "max_position_embeddings": 4096},
}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def parse_names(spec: str, known, what: str) -> list[str]:
    """A comma list of names, each one of ``known``: a typo fails before any model is built."""
    names = [x for x in spec.split(",") if x]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise ValueError(f"unknown {what}(s) {unknown or [spec]}; available: {', '.join(known)}")
    return names


def head_config(name: str, cfg: ModelConfig, anchor: str | None) -> HeadConfig:
    """``anchor`` (the upstream JSON at ``anchor``) or ``gPERCENT-wWINDOW``: that share of each layer's
    KV heads global at seeded positions, the rest local with the window and sink 4."""
    if name == "anchor":
        if not anchor:
            raise ValueError("--head-configs anchor needs --anchor-head-config")
        return HeadConfig.from_json(anchor).validate_model(cfg.num_hidden_layers, cfg.num_key_value_heads)
    ratio, window = name.split("-")
    return HeadConfig.synthetic(cfg.num_hidden_layers, cfg.num_key_value_heads, int(ratio[1:]) / 100,
                                window=int(window[1:]), sink=4)


def hf_model(arch: dict, dev, dtype):
    import transformers

    if arch["model_type"] == "gemma3_text":
        return _hf_gemma3(arch, dev, dtype)
    cls = {"mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config,
           "llama": transformers.LlamaConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
           "gpt_oss": transformers.GptOssConfig, "deepseek_v2": transformers.DeepseekV2Config,
           "deepseek_v3": transformers.DeepseekV3Config, "qwen3_next": transformers.Qwen3NextConfig}[arch["model_type"]]
    kw = {k: v for k, v in arch.items() if k not in ("model_type", "rope_theta", "rope_scaling", "partial_rotary_factor")}
    if not arch["model_type"].startswith("deepseek") and arch["model_type"] != "qwen3_next":
        # HF's MistralConfig defaults to a 4096-token sliding window; ours reads none from the arch: the
        # baseline must compute the same attention (full causal) as our dense
        kw.setdefault("sliding_window", None)
    rope = {"rope_type": "default", **arch.get("rope_scaling", {}), "rope_theta": arch.get("rope_theta", 1e4)}
    if "partial_rotary_factor" in arch:
        rope["partial_rotary_factor"] = arch["partial_rotary_factor"]
    hf_cfg = cls(**kw, rope_parameters=rope)
    attn = "sdpa"
    if arch["model_type"] == "gpt_oss":
        # transformers has no SDPA path for gpt-oss's sinks: flex attention on a GPU (eager would hold
        # every score: 64 heads x 32K^2 at 32K), eager on the CPU (its flex path refuses sinks there)
        attn = "flex_attention" if torch.device(dev).type == "cuda" else "eager"
    # MoE: transformers' default experts implementation (grouped_mm where it dispatches)
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation=attn)
    return model.eval()


def _hf_gemma3(arch: dict, dev, dtype):
    """transformers' Gemma3ForCausalLM of a gemma3_text arch: the same layer pattern and RoPEs (a
    per-layer-type ``rope_parameters``, as transformers 5 writes it)."""
    import transformers

    cfg = ModelConfig.from_dict(arch)
    kw = {k: v for k, v in arch.items() if k not in ("model_type", "rope_theta", "rope_local_base_freq", "rope_scaling",
                                                     "sliding_window_pattern")}
    kw["layer_types"] = ["sliding_attention" if w else "full_attention" for w in cfg.sliding_windows]
    glob = {"rope_theta": cfg.rope.theta, "rope_type": cfg.rope.rope_type}
    if cfg.rope.rope_type == "linear":
        glob["factor"] = cfg.rope.factor
    elif cfg.rope.rope_type != "default":
        raise ValueError(f"the gemma3 baseline builds default or linear RoPE, not {cfg.rope.rope_type!r}")
    local = {"rope_theta": cfg.local_rope.theta, "rope_type": "default"}
    hf_cfg = transformers.Gemma3TextConfig(**kw, rope_parameters={"full_attention": glob, "sliding_attention": local})
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()

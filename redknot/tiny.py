"""Tiny random HF checkpoints of each supported family, written with transformers' own
``save_pretrained`` so tests and the demo exercise the real loading path without any download."""

from __future__ import annotations

from pathlib import Path

from .models.tokenizer import CHAT_TEMPLATE, make_tokenizer  # noqa: F401  (the checkpoints' tokenizer)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "mixtral", "olmoe", "qwen2_moe",
            "gpt_oss", "deepseek_v3", "deepseek_v2", "qwen3_next")

# Mixture-of-experts families: 8 experts of width 32, top-2 (the dense MLP of qwen3_moe/qwen2_moe
# layers that mlp_only_layers or decoder_sparse_step make dense is intermediate_size wide).
MOE_OVERRIDES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False, clip_qkv=None),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                      shared_expert_intermediate_size=48),
    # gpt-oss: its layers alternate an 8-token sliding window and full attention (transformers'
    # default layer_types); a SwiGLU limit of 1 makes the clamps bite on tiny activations (transformers
    # 5.17 ignores config.json's swiglu_limit and clamps at 7.0, 5.25 reads it: a reference built with
    # transformers sets its experts' limit from the config, as test_models_gpt_oss does)
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
                    swiglu_limit=1.0),
    # hybrid: Gated DeltaNet layers (2 key heads, 4 value heads of 16) with every 4th layer full attention
    # (4 layers by default: 3 linear + 1 full), a quarter of each head rotated, MoE with a shared expert
    "qwen3_next": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                       shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4),
}
# Layers a family's checkpoint has unless the caller says (a hybrid needs a full-attention layer)
DEFAULT_LAYERS = {"qwen3_next": 4, "gemma3_text": 6}

# DeepSeek (multi-head latent attention): a 32-wide latent and a 16-dim RoPE key part per token, the
# first layer dense, then 8 experts of width 32 (top-2, one shared); V3 routes by sigmoid scores in
# 2 groups (the best one chosen), V2 greedily by softmax
MLA_OVERRIDES = {
    "deepseek_v3": dict(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True),
    "deepseek_v2": dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=1.0,
                        topk_method="greedy", norm_topk_prob=False),
}

ROPE_VARIANTS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    # DeepSeek's YaRN: mscale / mscale_all_dim set the cos/sin factor, mscale_all_dim also MLA's softmax scale
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                    "mscale_all_dim": 0.7},
    # gpt-oss's own (YaRN factor 32, untruncated ramp, theta 150000) over a 32-token original context
    "gpt_oss": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 32, "rope_theta": 150000.0},
}

def make_tiny_checkpoint(path: str | Path, family: str = "llama", rope: str = "default",
                         tie_word_embeddings: bool = False, num_hidden_layers: int | None = None,
                         num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 16,
                         max_position_embeddings: int = 1024, seed: int = 0, sharded: bool = False,
                         **overrides) -> Path:
    """Write a random checkpoint (config.json, safetensors, tokenizer) and return its directory.

    ``num_hidden_layers`` defaults to 2 (gemma3_text: 6, so its five sliding layers to one global
    show; DeepSeek: 3, a dense layer before two MoE ones; qwen3_next: 4, three linear layers and a full
    one). gemma3_text: ``rope`` is the global layers' RoPE; the sliding layers (window 8) rotate
    with their own base, scores scale by query_pre_attn_scalar 24 (not head_dim), and every norm
    weight is random (HF initialises them to 0, i.e. a scale of 1)."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: use one of {FAMILIES}")
    path = Path(path)
    tokenizer = make_tokenizer()
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                  "qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
                  "olmoe": transformers.OlmoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
                  "gemma3_text": transformers.Gemma3TextConfig, "gpt_oss": transformers.GptOssConfig,
                  "deepseek_v3": transformers.DeepseekV3Config, "deepseek_v2": transformers.DeepseekV2Config,
                  "qwen3_next": transformers.Qwen3NextConfig}[family]
    if family == "gpt_oss" and rope == "default":
        rope = "gpt_oss"
    rope_params = {"rope_theta": 10000.0, **ROPE_VARIANTS[rope]}
    if family == "qwen3_next":
        rope_params["partial_rotary_factor"] = 0.25  # the released models' share
    if num_hidden_layers is None:
        num_hidden_layers = DEFAULT_LAYERS.get(family, 3 if family in MLA_OVERRIDES else 2)
    kwargs = dict(
        vocab_size=len(tokenizer), hidden_size=num_attention_heads * head_dim, intermediate_size=96,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, initializer_range=0.08, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, rope_parameters=rope_params,
    )
    if family in ("mistral", "mixtral"):
        kwargs["sliding_window"] = None  # full attention unless a test asks for a window
    kwargs.update(MOE_OVERRIDES.get(family, {}))
    if family == "gemma3_text":
        kwargs.update(sliding_window=8, query_pre_attn_scalar=24, rope_parameters={
            "full_attention": {**rope_params, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    if family in MLA_OVERRIDES:  # per-head widths come from the MLA fields; every head has its keys
        kwargs.pop("head_dim")
        kwargs.update(MLA_OVERRIDES[family], num_key_value_heads=overrides.get("num_attention_heads", num_attention_heads))
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # HF initialises biases to zero; make them matter in the comparison
                p.normal_(0, 0.05)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                # a router initialised at std 0.08 routes near-uniformly; a wider one makes the choice of
                # experts (and its ties) decisive, as in a trained model
                p.normal_(0, 0.5)
            elif name.endswith("self_attn.sinks"):  # gpt-oss: sinks that take a real share of the softmax
                p.normal_(1.0, 1.5)
            elif family == "qwen3_next" and name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)  # zero-centred norms: make (1 + w) differ from 1
            elif family == "gemma3_text" and name.endswith("norm.weight"):
                p.normal_(0, 0.3)  # Gemma's norm weights are offsets from 1, zero at init: make them matter
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: zero would not test it
                b.normal_(0, 0.1)
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "10GB")
    tokenizer.save_pretrained(path)
    return path


def llama_cpp_permute(w, n_head: int):
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py), applied to q/k rows of llama."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Tensor type per GGUF tensor kind in the tiny files: every quantised type the tests cover.
TINY_GGUF_TYPES = {"token_embd": "Q8_0", "output": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1",
                   "attn_output": "Q5_0", "ffn_gate": "Q4_0", "ffn_up": "Q8_0", "ffn_down": "F16"}


def make_tiny_gguf(path: str | Path, arch: str = "llama", tie_word_embeddings: bool = True,
                   num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                   head_dim: int = 16, intermediate_size: int = 128, context_length: int = 1024,
                   types: dict | None = None, seed: int = 0, hidden_size: int | None = None,
                   sliding_window: int = 8, gemma_metadata: dict | None = None):
    """Write a tiny random GGUF file the way llama.cpp's converter lays one out (tensor names, q/k
    rows permuted for llama, Gemma's norm weights stored plus 1, quantised tensor types, byte-level
    BPE tokenizer and chat template in the metadata). Returns ``(path, hf_weights)``: the HF-layout
    float32 weights before quantisation.

    gemma3: ``hidden_size`` may differ from heads x head_dim; four norms per layer and q/k norms;
    ``sliding_window``, rope.freq_base 1e6 and ``gemma_metadata`` ({"sliding_window_pattern": 3,
    "rope_freq_base_swa": 500.0}: keys llama.cpp's reader knows and transformers' does not) in the
    metadata."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize

    if arch not in ("llama", "qwen2", "gemma3"):
        raise ValueError(f"arch={arch!r}: use llama, qwen2 or gemma3")
    gemma = arch == "gemma3"
    path = Path(path)
    types = {**TINY_GGUF_TYPES, **(types or {})}
    tok = make_tokenizer()
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    model_json = __import__("json").loads(tok.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]]
    specials = set(tok.all_special_tokens)
    hidden, vocab_size = hidden_size or num_attention_heads * head_dim, len(tokens)
    rng = np.random.default_rng(seed)

    def rand(*shape, std=0.08):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    hf = {"model.embed_tokens.weight": rand(vocab_size, hidden, std=0.5),
          "model.norm.weight": 1 + rand(hidden, std=0.1)}
    if not tie_word_embeddings:
        hf["lm_head.weight"] = rand(vocab_size, hidden, std=0.2)
    q_out, kv_out = num_attention_heads * head_dim, num_key_value_heads * head_dim
    for i in range(num_hidden_layers):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = 1 + rand(hidden, std=0.1)
        hf[p + "post_attention_layernorm.weight"] = 1 + rand(hidden, std=0.1)
        hf[p + "self_attn.q_proj.weight"] = rand(q_out, hidden, std=0.3)
        hf[p + "self_attn.k_proj.weight"] = rand(kv_out, hidden, std=0.3)
        hf[p + "self_attn.v_proj.weight"] = rand(kv_out, hidden)
        hf[p + "self_attn.o_proj.weight"] = rand(hidden, q_out)
        if gemma:  # HF stores Gemma's norms as offsets from 1; two more per layer, and q/k norms
            hf[p + "input_layernorm.weight"] -= 1
            hf[p + "post_attention_layernorm.weight"] -= 1
            for name, dim in (("pre_feedforward_layernorm", hidden), ("post_feedforward_layernorm", hidden),
                              ("self_attn.q_norm", head_dim), ("self_attn.k_norm", head_dim)):
                hf[p + name + ".weight"] = rand(dim, std=0.3)
        if arch == "qwen2":
            hf[p + "self_attn.q_proj.bias"] = rand(q_out, std=0.3)
            hf[p + "self_attn.k_proj.bias"] = rand(kv_out, std=0.3)
            hf[p + "self_attn.v_proj.bias"] = rand(kv_out, std=0.1)
        hf[p + "mlp.gate_proj.weight"] = rand(intermediate_size, hidden)
        hf[p + "mlp.up_proj.weight"] = rand(intermediate_size, hidden)
        hf[p + "mlp.down_proj.weight"] = rand(hidden, intermediate_size)

    if gemma:
        hf["model.norm.weight"] -= 1
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_block_count(num_hidden_layers)
    w.add_feed_forward_length(intermediate_size)
    w.add_head_count(num_attention_heads)
    w.add_head_count_kv(num_key_value_heads)
    w.add_rope_freq_base(1_000_000.0 if gemma else 10000.0)
    if gemma:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(sliding_window)
        extra = gemma_metadata or {}
        if "sliding_window_pattern" in extra:
            w.add_uint32(f"{arch}.attention.sliding_window_pattern", extra["sliding_window_pattern"])
        if "rope_freq_base_swa" in extra:
            w.add_float32(f"{arch}.rope.freq_base_swa", extra["rope_freq_base_swa"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if t in specials else TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    def put(name: str, arr, kind: str | None):
        qtype = GGMLQuantizationType[types[kind]] if kind else GGMLQuantizationType.F32
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)

    put("token_embd.weight", hf["model.embed_tokens.weight"], "token_embd")
    plus = 1 if gemma else 0  # llama.cpp's converter stores Gemma's norm weights plus 1
    put("output_norm.weight", hf["model.norm.weight"] + plus, None)
    if not tie_word_embeddings:
        put("output.weight", hf["lm_head.weight"], "output")
    for i in range(num_hidden_layers):
        p = f"model.layers.{i}."
        q, k = hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"]
        if arch == "llama":  # what convert_hf_to_gguf does to llama's q/k rows
            q, k = llama_cpp_permute(q, num_attention_heads), llama_cpp_permute(k, num_key_value_heads)
        put(f"blk.{i}.attn_norm.weight", hf[p + "input_layernorm.weight"] + plus, None)
        if gemma:
            put(f"blk.{i}.post_attention_norm.weight", hf[p + "post_attention_layernorm.weight"] + 1, None)
            put(f"blk.{i}.ffn_norm.weight", hf[p + "pre_feedforward_layernorm.weight"] + 1, None)
            put(f"blk.{i}.post_ffw_norm.weight", hf[p + "post_feedforward_layernorm.weight"] + 1, None)
            put(f"blk.{i}.attn_q_norm.weight", hf[p + "self_attn.q_norm.weight"] + 1, None)
            put(f"blk.{i}.attn_k_norm.weight", hf[p + "self_attn.k_norm.weight"] + 1, None)
        else:
            put(f"blk.{i}.ffn_norm.weight", hf[p + "post_attention_layernorm.weight"], None)
        put(f"blk.{i}.attn_q.weight", q, "attn_q")
        put(f"blk.{i}.attn_k.weight", k, "attn_k")
        put(f"blk.{i}.attn_v.weight", hf[p + "self_attn.v_proj.weight"], "attn_v")
        put(f"blk.{i}.attn_output.weight", hf[p + "self_attn.o_proj.weight"], "attn_output")
        if arch == "qwen2":
            for x in "qkv":
                put(f"blk.{i}.attn_{x}.bias", hf[p + f"self_attn.{x}_proj.bias"], None)
        put(f"blk.{i}.ffn_gate.weight", hf[p + "mlp.gate_proj.weight"], "ffn_gate")
        put(f"blk.{i}.ffn_up.weight", hf[p + "mlp.up_proj.weight"], "ffn_up")
        put(f"blk.{i}.ffn_down.weight", hf[p + "mlp.down_proj.weight"], "ffn_down")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, hf

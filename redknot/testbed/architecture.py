"""The testbed model's architecture: a standard HF ``LlamaForCausalLM`` (GQA, RoPE, SwiGLU, RMSNorm,
tied embeddings), so redknot serves it through exactly the path it serves any user's checkpoint;
its sizes, and block expansion to more layers."""

from __future__ import annotations

import torch

# Architectures. "small": ≈19.4M parameters, ≈39 MB in bf16; 8 query / 4 KV heads of dim 64 so the
# head profiler has a real GQA layout to classify. The shipped model is "small" grown to 12 layers
# (--grow-layers 12: ≈28M parameters, 56 MB in bf16, under the package's 60 MB budget). "tiny" is for CPU tests.
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=16, vocab_size=512),
    "small": dict(hidden_size=512, intermediate_size=896, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=4096),
}
ROPE_THETA = 500_000.0        # long enough wavelengths for 8K+ positions (Llama-3 uses the same for 8K)
MAX_POSITIONS = 16384         # ≥ 8192: the model is trained at 4K and evaluated beyond
_HF_ATTN = {"sdpa": "sdpa", "flex": "flex_attention"}  # --attn -> transformers' attn_implementation


def make_config(size: str, tokenizer, attn: str = "sdpa"):
    from transformers import LlamaConfig

    shape = dict(SIZES[size])
    shape.pop("vocab_size")
    return LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, initializer_range=0.02, hidden_act="silu",
                       attention_bias=False, mlp_bias=False,
                       rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, attn_implementation=_HF_ATTN[attn], **shape)


def build_model(config, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                            attn_implementation=config._attn_implementation)


def grow_depth(weights: dict, layers: int, new_layers: int) -> dict:
    """A checkpoint's weights deepened from ``layers`` to ``new_layers`` decoder layers without changing
    what it computes (block expansion, as LLaMA Pro): the new layers are spread evenly, each a copy
    of the layer before it with its attention output and FFN down projections zeroed, so it adds
    nothing to the residual stream until training moves those projections."""
    if new_layers < layers:
        raise ValueError(f"--grow-layers {new_layers}: the checkpoint already has {layers} layers")
    extra = new_layers - layers
    source, zeroed = [], []  # new layer -> the old layer it copies; the copies (outputs zeroed)
    for i in range(layers):
        source.append(i)
        for _ in range((i + 1) * extra // layers - i * extra // layers):  # copies after layer i
            source.append(i)
            zeroed.append(len(source) - 1)
    out = {k: v for k, v in weights.items() if not k.startswith("model.layers.")}
    for new, old in enumerate(source):
        prefix = f"model.layers.{old}."
        for k, v in weights.items():
            if k.startswith(prefix):
                name = k[len(prefix):]
                zero = new in zeroed and name in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
                out[f"model.layers.{new}.{name}"] = torch.zeros_like(v) if zero else v.clone()
    return out


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embeddings count once

"""Gemma 3 (text): its fields with transformers' Gemma3TextConfig defaults, its two RoPE bases and
its sliding/full layer pattern."""

from __future__ import annotations

from .common import RopeConfig, UnsupportedModelError, as_int_list, parse_rope


def gemma3_fields(raw: dict, n_heads: int, n_kv: int, head_dim: int, n_layers: int) -> dict:
    """``ModelConfig``'s fields for Gemma 3 text (transformers' Gemma3TextConfig defaults where a field
    is missing)."""
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(key):
            raise UnsupportedModelError(f"config.json: {key}={raw[key]!r} is not supported (only null/false)")
    rope, local_rope = parse_gemma3_rope(raw, head_dim)
    eos = raw.get("eos_token_id", 1)
    softcap = raw.get("final_logit_softcapping")
    return dict(
        model_type="gemma3_text", vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_hidden_layers=n_layers, num_attention_heads=n_heads,
        num_key_value_heads=n_kv, head_dim=head_dim,
        max_position_embeddings=raw.get("max_position_embeddings", 131072),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        attention_bias=bool(raw.get("attention_bias", False)), qk_norm=True,
        rope=rope, local_rope=local_rope, sliding_windows=gemma3_sliding_windows(raw, n_layers),
        eos_token_ids=as_int_list(eos) if eos is not None else [], bos_token_id=raw.get("bos_token_id", 2),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"), hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 256),
        final_logit_softcapping=float(softcap) if softcap else None,
    )


def parse_gemma3_rope(raw: dict, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
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
    return (parse_rope({**rest, "rope_parameters": full}, head_dim),
            parse_rope({**rest, "rope_parameters": local}, head_dim))


def gemma3_sliding_windows(raw: dict, n_layers: int) -> list[int | None]:
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

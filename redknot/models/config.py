"""Model configuration: the subset of an HF ``config.json`` that the Llama-family forward needs.

Parsing is strict: an architecture or option we do not implement raises ``UnsupportedModelError``
naming the config field, instead of silently computing something else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Per-layer native sliding window of the architecture (None = full causal).
    sliding_windows: list[int | None] = field(default_factory=list)
    # A learned sink logit per query head in every attention softmax (gpt-oss: ``self_attn.sinks``).
    attention_sinks: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

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
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"config.json: model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(raw.get(key), int) or raw[key] <= 0:
                raise UnsupportedModelError(f"config.json: {key} must be a positive integer, got {raw.get(key)!r}")
        n_heads = raw["num_attention_heads"]
        n_kv = raw.get("num_key_value_heads") or n_heads
        if n_heads % n_kv:
            raise UnsupportedModelError(
                f"config.json: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}"
            )
        head_dim = raw.get("head_dim") or raw["hidden_size"] // n_heads
        n_layers = raw["num_hidden_layers"]
        eos = raw.get("eos_token_id")
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
            # qwen2 always has q/k/v bias; llama-style configs say so with attention_bias.
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            rope=_parse_rope(raw, head_dim),
            sliding_windows=_parse_sliding_windows(raw, model_type, n_layers),
            eos_token_ids=_as_int_list(eos) if eos is not None else [],
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
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


def _parse_sliding_windows(raw: dict, model_type: str, n_layers: int) -> list[int | None]:
    window = raw.get("sliding_window")
    if model_type in ("llama",) or not window:
        return [None] * n_layers
    if model_type == "mistral":
        return [int(window)] * n_layers
    # qwen2 / qwen3: sliding only when enabled, on the layers `layer_types` marks.
    if not raw.get("use_sliding_window", False):
        return [None] * n_layers
    types = raw.get("layer_types")
    if types is None:
        max_window_layers = raw.get("max_window_layers", n_layers)
        types = ["sliding_attention" if i >= max_window_layers else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers:
        raise UnsupportedModelError(f"config.json: layer_types has {len(types)} entries for {n_layers} layers")
    return [int(window) if t == "sliding_attention" else None for t in types]

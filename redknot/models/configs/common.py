"""What every family's config parsing shares: the strict error, RoPE, positive integers and the
quantisation check."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# MXFP4 experts are dequantised at load (models/mxfp4.py); no other quantisation is implemented.
DEQUANTISED_AT_LOAD = {"gpt_oss": ("mxfp4",)}


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


def as_int_list(x) -> list[int]:
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def positive_int(raw: dict, key: str, default=None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UnsupportedModelError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def parse_rope(raw: dict, head_dim: int) -> RopeConfig:
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


def check_quantization(raw: dict, model_type: str) -> None:
    quant = raw.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in DEQUANTISED_AT_LOAD.get(model_type, ()):
        raise UnsupportedModelError(
            f"config.json: quantization_config.quant_method={method!r} is not supported for {model_type} "
            "(load an unquantised bf16/fp32 checkpoint)")

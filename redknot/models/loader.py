"""Load an HF checkpoint directory (config.json + safetensors) into redknot's own forward."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .registry import model_class
from .rope import RotaryEmbedding

# Buffers some checkpoints carry that our forward recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The weight files do not match the model config."""


def resolve_dtype(dtype, cfg: ModelConfig | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cpu":
            return torch.float32  # half precision matmuls are slow on CPU
        # on an accelerator: the checkpoint's half precision, else bf16 (as vLLM serves fp32
        # checkpoints in 16 bits); fp32 there needs dtype="float32" explicitly
        dtype = cfg.torch_dtype if cfg is not None and cfg.torch_dtype in ("bfloat16", "float16") else "bfloat16"
    names = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r} is not supported (use one of {', '.join(names)} or a torch.dtype)")
    return names[dtype]


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: weight files listed in the index are missing: {missing[:3]}")
    return files


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A model with random (PyTorch default init) weights, built directly on the device."""
    with torch.device(device):
        model = model_class(cfg)(cfg)
    return model.to(dtype).eval()


def load_model(path: str | Path, dtype=None, device=None) -> tuple[torch.nn.Module, ModelConfig]:
    """``path``: an HF checkpoint directory, a ``.gguf`` file (or a directory holding one; converted
    once into the cache) or a fetched shelf name: see ``redknot.models.resolve.resolve_model``."""
    from .resolve import resolve_model

    path = resolve_model(path)
    cfg = ModelConfig.from_dir(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(dtype, cfg, device)
    files = weight_files(path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # to_empty leaves buffers uninitialised: recompute RoPE frequencies (every RoPE of the model).
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_frequencies(device)

    params = dict(model.named_parameters())
    loaded, unexpected = set(), []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(_IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and key == "lm_head.weight"):
                    continue
                if key not in params:
                    unexpected.append(key)
                    continue
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(params[key].shape):
                    raise CheckpointError(
                        f"{file.name}: {key} has shape {tuple(tensor.shape)}, config.json implies {tuple(params[key].shape)}"
                    )
                with torch.no_grad():
                    params[key].copy_(tensor)
                loaded.add(key)
    if unexpected:
        raise CheckpointError(f"{path}: unexpected weights (not a {cfg.model_type} layout?): {unexpected[:5]}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{path}: missing weights: {missing[:5]}{' …' if len(missing) > 5 else ''}")
    return model.eval(), cfg

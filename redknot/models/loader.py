"""Load an HF checkpoint directory (config.json + safetensors) into redknot's own forward."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from . import mxfp4
from .config import ModelConfig, MoEConfig
from .registry import model_class
from .rope import RotaryEmbedding

# Buffers some checkpoints carry that our forward recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Weights of parts no forward here runs: Qwen3-Next's multi-token-prediction head (transformers
# skips it too).
_IGNORED_PREFIXES = ("mtp.",)
# Layers past num_hidden_layers: DeepSeek-V3's multi-token-prediction modules (transformers skips them too).
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# One expert's projection in a checkpoint (Mixtral names them w1 = gate, w3 = up, w2 = down).
_PER_EXPERT = re.compile(r"^((?:.+\.)?experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(weight|bias)$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


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


def expert_target(key: str, tensor: torch.Tensor, moe: MoEConfig | None):
    """Where a checkpoint tensor of MoE experts goes: (parameter name, index into it, the tensor in
    the parameter's layout), or None for a key that needs no mapping. Per-expert keys
    (``...experts.N.gate_proj.weight``, Mixtral's ``w1/w3/w2``) fill expert N's slice of the 3D
    ``experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows) or ``experts.down_proj`` [E, H, I]
    (biases alike); gpt-oss's fused tensors ([E, H, 2I] with gate and up interleaved, down [E, I, H])
    are transposed and de-interleaved into that layout."""
    if moe is None:
        return None
    m = _PER_EXPERT.match(key)
    if m is not None:
        prefix, expert, proj, kind = m.groups()
        proj = _MIXTRAL_PROJ.get(proj, proj)
        suffix = "" if kind == "weight" else "_bias"
        if proj == "down_proj":
            return f"{prefix}.down_proj{suffix}", (int(expert),), tensor
        i = moe.intermediate_size
        half = slice(0, i) if proj == "gate_proj" else slice(i, 2 * i)
        return f"{prefix}.gate_up_proj{suffix}", (int(expert), half), tensor
    if moe.checkpoint_layout == "gpt_oss" and re.search(r"(^|\.)experts\.(gate_up_proj|down_proj)(_bias)?$", key):
        if tensor.dim() == 3:  # weights [E, in, out] -> [E, out, in]
            tensor = tensor.transpose(1, 2)
        if ".gate_up_proj" in key:  # rows gate0, up0, gate1, up1 ... -> the gate rows, then the up rows
            tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        return key, (slice(None),), tensor
    return None


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, shard=None) -> torch.nn.Module:
    """A model with random (PyTorch default init) weights, built directly on the device. Half
    precision models are created in their dtype (a 30B-parameter MoE never exists in float32).
    ``shard``: a tensor-parallel rank's share (``redknot.distributed.Shard``): only its part is built."""
    previous = torch.get_default_dtype()
    if dtype in (torch.float16, torch.bfloat16):
        torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(cfg)(cfg) if shard is None else shard.build()
    finally:
        torch.set_default_dtype(previous)
    model = model.to(dtype)
    rope = model.model.rotary_emb  # the frequencies stay float32 (``.to`` cast them)
    rope.inv_freq = type(rope)(cfg).inv_freq.to(device)
    return model.eval()


def load_model(path: str | Path, dtype=None, device=None, shard=None) -> tuple[torch.nn.Module, ModelConfig]:
    """``path``: an HF checkpoint directory, a ``.gguf`` file (or a directory holding one; converted
    once into the cache) or a fetched shelf name: see ``redknot.models.resolve.resolve_model``.
    ``shard``: a tensor-parallel rank's share (``redknot.distributed.Shard``): each tensor is cut
    to the rank's slice as it is read, so the rank never holds the whole model. The config
    returned is the full model's either way."""
    from .resolve import resolve_model

    path = resolve_model(path)
    cfg = ModelConfig.from_dir(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(dtype, cfg, device)
    files = weight_files(path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg) if shard is None else shard.build()
    model = model.to(dtype).to_empty(device=device)  # allocated in the dtype only
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # to_empty leaves buffers uninitialised: recompute RoPE frequencies (every RoPE of the model).
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_frequencies(device)

    params = dict(model.named_parameters())
    loaded, unexpected = set(), []
    filled: dict[str, int] = {}  # elements copied into parameters that checkpoints give in slices (experts)
    packed: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 experts: name -> the blocks and scales seen so far
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if (key.endswith(_IGNORED_SUFFIXES) or key.startswith(_IGNORED_PREFIXES)
                        or (cfg.tie_word_embeddings and key == "lm_head.weight")):
                    continue
                layer = _LAYER.match(key) if cfg.model_type == "deepseek_v3" else None
                if layer is not None and int(layer.group(1)) >= cfg.num_hidden_layers:
                    continue
                name = key.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name of its MoE block
                tensor = f.get_tensor(key)
                if name.endswith((mxfp4.BLOCKS, mxfp4.SCALES)):  # dequantised once both halves are read
                    base, part = name[:-len(mxfp4.BLOCKS)], name[-len(mxfp4.BLOCKS):]
                    packed.setdefault(base, {})[part] = tensor
                    if len(packed[base]) < 2:
                        continue
                    halves = {k: v.to(device) for k, v in packed.pop(base).items()}  # dequantised where it runs
                    name, tensor = base, mxfp4.dequantize(halves[mxfp4.BLOCKS], halves[mxfp4.SCALES], dtype)
                name, index, tensor = expert_target(name, tensor, cfg.moe) or (name, (slice(None),), tensor)
                if shard is not None:
                    tensor = shard.slice(name, tensor)
                if name not in params:
                    unexpected.append(key)
                    continue
                try:
                    dest = params[name][index]
                except IndexError:
                    raise CheckpointError(f"{file.name}: {key} does not fit {name} of shape "
                                          f"{tuple(params[name].shape)} (config.json)") from None
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise CheckpointError(
                        f"{file.name}: {key} has shape {tuple(tensor.shape)}, config.json implies {tuple(dest.shape)}"
                    )
                with torch.no_grad():
                    dest.copy_(tensor)
                filled[name] = filled.get(name, 0) + dest.numel()
                if filled[name] == params[name].numel():
                    loaded.add(name)
    if packed:
        raise CheckpointError(f"{path}: MXFP4 weights without their other half (_blocks and _scales): "
                              f"{[k + p for k, parts in packed.items() for p in parts][:5]}")
    if unexpected:
        raise CheckpointError(f"{path}: unexpected weights (not a {cfg.model_type} layout?): {unexpected[:5]}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{path}: missing weights: {missing[:5]}{' …' if len(missing) > 5 else ''}")
    return model.eval(), cfg

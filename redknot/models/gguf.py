"""GGUF checkpoints (llama.cpp's format) as HF-style configs, state dicts and checkpoint directories.

A GGUF file holds the model's hyperparameters and tokenizer as metadata and its tensors under
llama.cpp's names, often quantised. This module reads one through the ``gguf`` library:

- ``gguf_config(path)``: an HF ``config.json`` dict (``model_type`` llama / qwen2 / qwen3 / gemma3_text).
- ``gguf_state_dict(path, dtype)``: every tensor dequantised (Q4_0, Q4_1, Q8_0, K-quants, F16, ...)
  under its HF name, with llama.cpp's Q/K row permutation undone for the llama architecture and
  the 1 llama.cpp adds to every Gemma 3 norm weight taken off again (HF stores the offset from 1).
- ``gguf_tokenizer(path)``: the transformers fast tokenizer (and chat template) the metadata
  describes; transformers' own GGUF tokenizer conversion builds it.
- ``load_gguf(path, dtype, device)``: redknot's model straight from the file.
- ``convert_gguf(path, out_dir, dtype)``: a standard HF checkpoint directory (config.json,
  model.safetensors, tokenizer.json, tokenizer_config.json with the chat template,
  generation_config.json) that transformers and ``redknot.models.load_model`` both load.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig, UnsupportedModelError
from .rope import RotaryEmbedding

# llama.cpp architecture name -> HF model_type. Mistral GGUFs say "llama" (same layout, permuted).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
# Architectures whose q/k rows llama.cpp's convert_hf_to_gguf permutes (LlamaModel.permute).
_PERMUTED = ("llama",)

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Architectures whose layers name their norms otherwise (Gemma 3: four norms per layer).
_PER_LAYER_ARCH = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
# Architectures whose norm weights llama.cpp's converter stores plus 1 (HF's Gemma norm scales by 1 + w).
_NORM_PLUS_ONE = ("gemma3",)
# Tensors some files carry that the HF layout recomputes or has no place for.
_SKIPPED = ("rope_freqs.weight",)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class GGUFError(ValueError):
    """A GGUF file that cannot be read or mapped onto a supported architecture."""


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def dtype_name(dtype) -> str:
    return str(_torch_dtype(dtype)).removeprefix("torch.")


def _reader(path):
    try:
        from gguf import GGUFReader
    except ImportError:  # pragma: no cover - gguf is a dependency
        raise ImportError("reading GGUF files needs the gguf package: pip install 'gguf>=0.10'") from None
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError / struct errors on a bad header
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _value(field):
    """A metadata field as a Python value (str, int, float, bool or a list of those)."""
    if hasattr(field, "contents"):
        return field.contents()
    # gguf < 0.11: decode parts by hand
    from gguf import GGUFValueType

    def one(part, vtype):
        return part.tobytes().decode("utf-8") if vtype == GGUFValueType.STRING else part.tolist()[0]

    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def gguf_metadata(reader_or_path, skip_large: bool = True) -> dict:
    """The key/value metadata; the tokenizer's big arrays are left out unless asked for."""
    reader = reader_or_path if hasattr(reader_or_path, "fields") else _reader(reader_or_path)
    big = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    return {k: _value(f) for k, f in reader.fields.items()
            if not k.startswith("GGUF.") and not (skip_large and k in big)}


def _architecture(meta: dict, where) -> str:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{where}: GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})")
    return arch


def _config_from(reader, where) -> dict:
    meta = gguf_metadata(reader)
    arch = _architecture(meta, where)
    model_type = GGUF_ARCHITECTURES[arch]

    def get(key, default=None, required=False):
        full = f"{arch}.{key}"
        if full not in meta:
            if required:
                raise GGUFError(f"{where}: metadata {full!r} is missing")
            return default
        return meta[full]

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{where}: no token_embd.weight tensor")
    hidden = int(get("embedding_length", required=True))
    n_heads = int(get("attention.head_count", required=True))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise UnsupportedModelError(f"{where}: per-layer {arch}.attention.head_count_kv is not supported")
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // n_heads
    # the embedding's row count is the vocabulary the weights were trained with
    vocab = int(tensors["token_embd.weight"].shape[-1])
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[model_type]],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    rope_dim = get("rope.dimension_count")
    if rope_dim and int(rope_dim) != int(head_dim):
        raise UnsupportedModelError(f"{where}: partial rotary embeddings ({arch}.rope.dimension_count={rope_dim}, "
                                    f"head_dim={head_dim}) are not supported")
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        if scaling not in ("linear", "yarn"):
            raise UnsupportedModelError(f"{where}: {arch}.rope.scaling.type={scaling!r} is not supported")
        rs = {"rope_type": scaling, "factor": float(get("rope.scaling.factor", 1.0))}
        orig = get("rope.scaling.original_context_length")
        if orig:
            rs["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = rs
    if model_type == "qwen2":
        cfg["attention_bias"] = True  # q/k/v carry biases; transformers' Qwen2 always builds them
        cfg["use_sliding_window"] = False
    elif model_type == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    elif model_type == "gemma3_text":
        _gemma3_config(cfg, get, where)
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                      ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if name in meta:
            cfg[key] = int(meta[name])
    cfg["eos_token_ids"] = eos_token_ids(meta)
    return cfg


def _gemma3_config(cfg: dict, get, where) -> None:
    """Gemma 3's fields in the config (in place), as llama.cpp reads the file: the sliding window
    on all layers but every ``sliding_window_pattern``-th (6 unless the file says), rope.freq_base
    (and any scaling) for the global layers and rope.freq_base_swa (10000 unless the file says) for
    the sliding ones; scores scaled by 1/sqrt(head_dim), by 1/sqrt(hidden / heads) for the 62-layer
    (27B) model. The older config fields (rope_theta, rope_local_base_freq, rope_scaling) keep the
    directory readable by transformers 4 too."""
    if get("attn_logit_softcapping"):
        raise UnsupportedModelError(f"{where}: gemma3.attn_logit_softcapping is not supported")
    del cfg["hidden_act"]
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    n_layers = cfg["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer: true where the layer slides
        if len(pattern) != n_layers:
            raise GGUFError(f"{where}: gemma3.attention.sliding_window_pattern has {len(pattern)} entries "
                            f"for {n_layers} layers")
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(n_layers)]
        cfg["sliding_window_pattern"] = int(pattern)
    cfg["layer_types"] = ["sliding_attention" if x else "full_attention" for x in sliding]
    window = get("attention.sliding_window")
    if window is None and any(sliding):
        raise GGUFError(f"{where}: metadata 'gemma3.attention.sliding_window' is missing")
    cfg["sliding_window"] = int(window) if window is not None else None
    cfg["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10000.0))
    cfg.setdefault("rope_scaling", None)
    big = n_layers == 62  # llama.cpp: the 27B model scales by hidden / heads, the others by head_dim
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"]) if big else cfg["head_dim"]
    cap = get("final_logit_softcapping")
    cfg["final_logit_softcapping"] = float(cap) if cap else None
    cfg["attention_bias"] = False


def eos_token_ids(meta: dict) -> list[int]:
    """Every token that ends a turn: the EOS id, and llama.cpp's end-of-turn / end-of-message ids."""
    out = []
    for name in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if name in meta and int(meta[name]) not in out:
            out.append(int(meta[name]))
    return out


def gguf_config(path) -> dict:
    """The HF ``config.json`` dict of a GGUF file (plus ``eos_token_ids``, every end-of-turn id)."""
    return _config_from(_reader(path), path)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF parameter name of a llama.cpp tensor name of architecture ``arch`` (None for tensors the
    HF layout does not keep)."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    if gguf_name in _SKIPPED:
        return None
    parts = gguf_name.split(".")
    per_layer = {**_PER_LAYER, **_PER_LAYER_ARCH.get(arch, {})}
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in per_layer:
        return f"model.layers.{parts[1]}.{per_layer[parts[2]]}.{parts[3]}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in the HF Llama-family layout")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's ``LlamaModel.permute`` (rotary halves interleaved per head) on the
    rows of a q/k weight or bias: ``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`` was applied."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest dimension first
    if tensor.tensor_type == GGMLQuantizationType.F32:
        arr = np.asarray(tensor.data, dtype=np.float32)
    elif tensor.tensor_type == GGMLQuantizationType.F16:
        arr = np.asarray(tensor.data, dtype=np.float16).astype(np.float32)
    else:
        arr = dequantize(tensor.data, tensor.tensor_type)
    return arr.reshape(shape)


def _state_dict_from(reader, cfg: dict, dtype: torch.dtype, where):
    arch = next(a for a, t in GGUF_ARCHITECTURES.items() if t == cfg["model_type"])
    out = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        try:
            arr = _dequantize(tensor)
        except NotImplementedError as e:
            raise GGUFError(f"{where}: {tensor.name}: cannot dequantise {tensor.tensor_type.name} ({e})") from None
        if arch in _PERMUTED:
            if ".attn_q." in tensor.name:
                arr = unpermute_qk(arr, cfg["num_attention_heads"])
            elif ".attn_k." in tensor.name:
                arr = unpermute_qk(arr, cfg["num_key_value_heads"])
        if arch in _NORM_PLUS_ONE and tensor.name.endswith("norm.weight"):
            arr = arr - 1  # a new array (the memory-mapped one stays as it is)
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # F32 tensors come straight from the memory map
            arr = arr.copy()
        out[name] = torch.from_numpy(arr).to(dtype)
    return out


def gguf_state_dict(path, dtype="float32") -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantised to ``dtype``, under its HF name."""
    reader = _reader(path)
    return _state_dict_from(reader, _config_from(reader, path), _torch_dtype(dtype), path)


def gguf_tokenizer(path):
    """The transformers fast tokenizer (with the chat template) that the GGUF metadata describes."""
    from transformers import AutoTokenizer

    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError) as e:
        raise GGUFError(f"{path}: cannot build the tokenizer from the GGUF metadata ({e})") from None


def load_gguf(path, dtype="float32", device="cpu"):
    """(redknot model, ModelConfig) straight from a GGUF file, without writing a checkpoint."""
    from .registry import model_class

    reader = _reader(path)
    raw = _config_from(reader, path)
    cfg = ModelConfig.from_dict(raw)
    cfg.eos_token_ids = raw["eos_token_ids"] or cfg.eos_token_ids
    dtype = _torch_dtype(dtype)
    state = _state_dict_from(reader, raw, dtype, path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise GGUFError(f"{path}: weights do not match the {cfg.model_type} layout "
                        f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    for module in model.modules():  # built on the meta device: compute every RoPE's frequencies
        if isinstance(module, RotaryEmbedding):
            module.reset_frequencies("cpu")
    return model.to(device=device).eval(), cfg


def convert_gguf(gguf_path, out_dir, dtype="bfloat16", overwrite: bool = False) -> Path:
    """Write ``gguf_path`` as an HF checkpoint directory at ``out_dir`` (weights in ``dtype``).

    The directory is assembled next to ``out_dir`` and renamed into place, so a reader never sees a
    half-written checkpoint."""
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir}: exists and is not empty (pass overwrite=True / --overwrite)")
    torch_dtype = _torch_dtype(dtype)
    reader = _reader(gguf_path)
    raw = _config_from(reader, gguf_path)
    meta = gguf_metadata(reader)
    tokenizer = gguf_tokenizer(gguf_path)  # fail on the tokenizer before the slow part

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        state = _state_dict_from(reader, raw, torch_dtype, gguf_path)
        if raw["tie_word_embeddings"]:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del state
        eos = _turn_end_ids(raw.pop("eos_token_ids"), tokenizer)
        config = {**raw, "torch_dtype": dtype_name(torch_dtype),
                  "gguf_source": {"file": gguf_path.name, "name": meta.get("general.name"),
                                  "file_type": meta.get("general.file_type")}}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = {"bos_token_id": raw.get("bos_token_id"), "eos_token_id": eos[0] if len(eos) == 1 else eos}
        if raw.get("pad_token_id") is not None:
            gen["pad_token_id"] = raw["pad_token_id"]
        (tmp / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None},
                                                               indent=2) + "\n")
        _save_tokenizer(tokenizer, tmp)
        umask = os.umask(0)
        os.umask(umask)
        for f in [tmp, *tmp.iterdir()]:  # mkdtemp's 0700 would hide a shared cache from other users
            os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# End-of-turn tokens of the common chat formats: generation stops at these when the template uses them.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def _turn_end_ids(eos: list[int], tokenizer) -> list[int]:
    """The GGUF's EOS / EOT ids, plus the end-of-turn token its chat template writes (an instruct
    model ends its answer with it; HF's generation_config lists it beside the EOS)."""
    out = list(eos)
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab()
    for tok in _TURN_END_TOKENS:
        if tok in vocab and (tok in template or tok == tokenizer.eos_token) and vocab[tok] not in out:
            out.append(vocab[tok])
    return out


def _save_tokenizer(tokenizer, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json, with the chat template inside tokenizer_config.json
    (transformers 5 would otherwise write it to chat_template.jinja; both places are read)."""
    tokenizer.save_pretrained(str(out))
    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    template = getattr(tokenizer, "chat_template", None)
    jinja = out / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text()
    if template is not None:
        cfg["chat_template"] = template
        jinja.unlink(missing_ok=True)
    for key in ("gguf_file", "is_local", "local_files_only"):
        cfg.pop(key, None)
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name transformers 4.x knows too
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

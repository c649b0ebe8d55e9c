"""Model fingerprint: what a cached chunk's KV depends on, so it is never served to another model.

It covers the architecture and RoPE config, the dtype, the tokenizer vocabulary and the weights
(a digest of a strided sample of the embedding and LM-head rows, plus each layer's K projection,
MLA's latent one: cheap at load time, and any retrained or different checkpoint changes it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

from .config import ModelConfig


def model_fingerprint(model, cfg: ModelConfig, tokenizer=None) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode())
    h.update(str(next(model.parameters()).dtype).encode())
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    weights = [model.model.embed_tokens.weight, model.lm_head.weight]
    # each layer's key projection (MLA: its latent projection; a hybrid's linear layers: q/k/v/z)
    weights += [layer.linear_attn.in_proj_qkvz if hasattr(layer, "linear_attn")
                else getattr(layer.self_attn, "k_proj", None) or layer.self_attn.kv_a_proj_with_mqa
                for layer in model.model.layers]
    weights = [getattr(w, "weight", w) for w in weights]
    for w in weights:
        step = max(1, w.shape[0] // 256)
        h.update(w[::step].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]

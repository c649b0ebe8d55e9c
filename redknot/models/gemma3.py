"""Gemma 3 (text) on packed varlen batches: ``Gemma3ForCausalLM`` of transformers, computed alike.

What differs from the Llama family (``models/llama.py``, whose attention and MLP it reuses):

- RMSNorm scales by (1 + weight), computed in float32 and rounded once;
- q/k norms before RoPE; each decoder layer norms its attention and FFN outputs too (four norms);
- five sliding-window layers to one global layer, each kind with its own RoPE (the sliding layers a
  local base, the global ones rope_theta with any scaling): a layer rotates its queries and keys,
  and a moved document's cached keys, with its own;
- scores scale by query_pre_attn_scalar**-0.5 (``ModelConfig.attention_scale``, which the attention
  backends take);
- embeddings scale by sqrt(hidden) rounded to the model dtype; a tanh-GELU gated MLP; an optional
  final logit soft-cap.

Module names equal HF's, so checkpoint keys load as they are.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import linear as projection
from .adapter import LlamaAdapter
from .config import ModelConfig
from .llama import MLP, Attention, LlamaForCausalLM, run_recovery_layers
from .rope import RotaryEmbedding, apply_rotation


@functools.cache
def _norm_rope():
    """The fused q/k norm + RoPE kernel, or None where triton is missing (the torch path then runs)."""
    try:
        from ..kernels.rope import norm_rope
    except ImportError:
        return None
    return norm_rope


class Gemma3RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight) in float32, rounded once to x's dtype (the weight
    is stored as the offset from 1, as in HF checkpoints)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def scale(self) -> torch.Tensor:
        return 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.scale(), self.eps).to(x.dtype)


class Gemma3Attention(Attention):
    """Llama's attention (fused QKV, packed CPU GEMMs, the backend call) with Gemma's q/k norms,
    the layer's own RoPE and an output bias where the config has attention biases."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding):
        super().__init__(cfg, layer_idx, rope)
        self.q_norm = Gemma3RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, cfg.rms_norm_eps)
        if cfg.attention_bias:
            self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=True)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """q [T, Hq, D], k and v [T, Hkv, D] of normed hidden states x, q/k normed then rotated."""
        t = x.shape[0]
        nq, nkv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        if self.qkv_weight is not None:
            q, k, v = projection.linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed).split((nq, nkv, nkv), -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(t, self.n_heads, self.head_dim)
        k = k.reshape(t, self.n_kv, self.head_dim)
        v = v.reshape(t, self.n_kv, self.head_dim)
        cos, sin = self.rope.cos_sin(positions)
        fused = _norm_rope() if x.is_cuda else None
        if fused is not None:  # norm (fp32, weight 1 + w) and rotation in one pass, rounded once
            return (fused(q, cos, sin, self.rope.rot_dim, self.q_norm.scale(), self.q_norm.eps),
                    fused(k, cos, sin, self.rope.rot_dim, self.k_norm.scale(), self.k_norm.eps), v)
        q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotation(q, cos, sin, self.rope.rot_dim), apply_rotation(k, cos, sin, self.rope.rot_dim), v


class Gemma3MLP(MLP):
    """The gated MLP with tanh-approximated GELU (HF's ``gelu_pytorch_tanh``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = projection.linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_packed).chunk(2, -1)
            return self._down(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_idx, rope)
        self.mlp = Gemma3MLP(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = Gemma3RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(h, eps)

    def attention_residual(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention block, given o_proj's output."""
        return x + self.post_attention_layernorm(attn_out)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """What the FFN block adds to the residual stream x."""
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        x = self.attention_residual(x, self.self_attn(self.input_layernorm(x), positions, batch))
        return x + self.ffn(x)

    def forward_rows(self, x: torch.Tensor, positions: torch.Tensor, batch, rows):
        """The layer under a recovery's row plan (as ``llama.DecoderLayer.forward_rows``): the FFN
        runs on the rows it picks, the others keep their residual; only kept rows continue."""
        layer = self.self_attn.layer_idx
        x = self.attention_residual(x, self.self_attn(self.input_layernorm(x), positions, batch, rows))
        ffn = rows.ffn_rows(layer)
        x = x + self.ffn(x) if ffn is None else x.index_add(0, ffn, self.ffn(x[ffn]))
        keep = rows.keep_rows(layer)
        if keep is not None:
            x, positions = x[keep], positions[keep]
        return x, positions


@functools.cache
def _embed_scale(dim: int, dtype: torch.dtype) -> float:
    """sqrt(dim) rounded to fp32, then to ``dtype`` (HF's factor); a Python number, so the forward
    makes no device tensor (CUDA-graph capture allows none)."""
    return float(torch.tensor(dim ** 0.5, dtype=torch.float32).to(dtype))


class Gemma3ScaledEmbedding(nn.Embedding):
    """Token embeddings times sqrt(hidden), the factor rounded to the weights' dtype first (as HF)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * _embed_scale(self.embedding_dim, self.weight.dtype)


class Gemma3Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Gemma3ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg)  # the global layers'
        two = cfg.local_rope is not None and cfg.local_rope != cfg.rope
        self.rotary_emb_local = RotaryEmbedding(dataclasses.replace(cfg, rope=cfg.local_rope)) if two else self.rotary_emb
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, self.layer_rope(cfg, i))
                                    for i in range(cfg.num_hidden_layers))
        self.norm = Gemma3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def layer_rope(self, cfg: ModelConfig, layer: int) -> RotaryEmbedding:
        return self.rotary_emb_local if cfg.layer_rope(layer) is cfg.local_rope else self.rotary_emb

    def rope_modules(self) -> list[RotaryEmbedding]:
        """The distinct rotary embeddings (one, or the global and the local one)."""
        return [self.rotary_emb] + ([self.rotary_emb_local] if self.rotary_emb_local is not self.rotary_emb else [])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, rows=None) -> torch.Tensor:
        """As ``llama.Backbone.forward``: ``rows`` is a recovery's per-layer row plan."""
        if rows is not None:
            x = run_recovery_layers(self.layers, self.embed_tokens, input_ids, positions, batch, rows)
            return None if x is None else self.norm(x)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, batch)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's causal LM over Gemma 3's decoder layers, with final-logit soft-capping."""

    backbone = Gemma3Backbone

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3Adapter(LlamaAdapter):
    """Llama's verbs, with Gemma's layer tail (post-attention and FFN norms) and keys relocated
    with each layer's own RoPE."""

    def layer_attention(self, layer, hidden, attn_out):
        block = self._body.layers[layer]
        return block.attention_residual(hidden, block.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1)))

    def layer_ffn(self, layer, hidden, rows=None):
        ffn = self._body.layers[layer].ffn
        return hidden + ffn(hidden) if rows is None else hidden.index_add(0, rows, ffn(hidden[rows]))

    def relocate(self, k, delta, layer=None):
        ropes = self._body.rope_modules()
        if layer is None and len(ropes) > 1:
            raise ValueError("Gemma 3's sliding and global layers rotate with different RoPE bases: "
                             "relocate keys per layer (relocate(k, delta, layer) or relocate_layers)")
        rope = ropes[0] if layer is None else self._body.layers[layer].self_attn.rope
        return rope.relocate(k, delta)

    def relocate_layers(self, k, delta):
        """One rotation per distinct RoPE over the layers that use it."""
        layers = self._body.layers
        out = torch.empty_like(k)
        for rope in self._body.rope_modules():
            idx = [i for i, layer in enumerate(layers) if layer.self_attn.rope is rope]
            if not idx:  # a RoPE no layer uses (e.g. every layer sliding): nothing to rotate
                continue
            sel = torch.tensor(idx, dtype=torch.long, device=k.device)
            part = k.index_select(0, sel)
            out.index_copy_(0, sel, rope.relocate(part, delta))
        return out

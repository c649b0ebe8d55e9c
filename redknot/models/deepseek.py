"""DeepSeek-V2/V3: multi-head latent attention (MLA) with DeepSeek's mixture of experts.

Module names equal transformers' (``q_a_proj``/``q_a_layernorm``/``q_b_proj`` or ``q_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; ``mlp.gate`` with V3's
``e_score_correction_bias``, ``mlp.experts``, ``mlp.shared_experts``), so checkpoint keys load as
they are. The decoder layer, backbone and FFN are the Llama family's (``llama.py``, ``moe.py``);
only the attention differs.

MLA caches per token and layer one row ``[k_rope | c]``: the RoPE key part every head shares and
the normed latent ``c`` of ``kv_lora_rank``. Decode (and the CPU) runs absorbed: a head's query becomes
``[q_rope | q_nope @ W_UK]`` (W_UK: its key rows of ``kv_b_proj``), its scores are that query
times the cached rows, and its output the weighted latents times W_UV (its value rows), so keys
and values are never expanded per head (``models/latent_attention.py`` runs it over the pool; on a
GPU a prefill chunk expands its sequences' rows instead, where that costs fewer FLOPs).
RoPE dims that come interleaved (V2 always, V3 with ``rope_interleave``) are put in the
half-rotation layout first: queries and keys are permuted alike, so every score is unchanged.

A "head" of the head plan is a query head: the adapter's plans are [layers, query heads] and the
pool stores the one latent head per layer (what any query head of the layer still sees).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import HeadConfig, HeadConfigError
from .adapter import LlamaAdapter, StateLayout
from .config import ModelConfig
from .latent_attention import PagedLatentAttention
from .llama import Backbone, DecoderLayer, LlamaForCausalLM, RMSNorm, _ffn
from .rope import RotaryEmbedding, apply_rotation

# transformers' q_a_layernorm / kv_a_layernorm use their default epsilon, not rms_norm_eps
_LORA_NORM_EPS = 1e-6


class MLARotaryEmbedding(RotaryEmbedding):
    """RoPE over the ``qk_rope_head_dim`` dims of MLA's queries and shared key part."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(dataclasses.replace(cfg, head_dim=cfg.mla.qk_rope_head_dim))


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): the half-rotation layout."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: MLARotaryEmbedding):
        super().__init__()
        m = cfg.mla
        self.layer_idx, self.mla = layer_idx, m
        self.n_heads, hidden, bias = cfg.num_attention_heads, cfg.hidden_size, cfg.attention_bias
        q_out = self.n_heads * m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.n_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * m.v_head_dim, hidden, bias=bias)
        self.rope = rope
        self.backend: PagedLatentAttention | None = None  # set by the runner (set_backend)
        self.w_uk = self.w_uv = None  # kv_b_proj's key [H, dn, R] and value [H, R, dv] parts once fused

    def fuse(self, pack: bool = False) -> None:
        """Keep the absorbed weights contiguous: W_UK [H, dn, R] and W_UV transposed [H, R, dv]."""
        self.w_uk, self.w_uv = (w.contiguous() for w in self._kv_b())

    def _kv_b(self):
        m = self.mla
        w = self.kv_b_proj.weight.view(self.n_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:].transpose(1, 2)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """Normed hidden states x [T, hidden] -> q_nope [T, H, dn], q_rope [T, H, dr] (rotated) and the
        rows to cache [T, dr + R]: the rotated RoPE key part, then the normed latent."""
        m, t = self.mla, x.shape[0]
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.n_heads, m.qk_head_dim)
        q_nope, q_rope = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        ckv = self.kv_a_proj_with_mqa(x)
        c, k_rope = self.kv_a_layernorm(ckv[:, :m.kv_lora_rank]), ckv[:, None, m.kv_lora_rank:]
        if m.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        cos, sin = self.rope.cos_sin(positions)
        q_rope = apply_rotation(q_rope, cos, sin, m.qk_rope_head_dim)
        k_rope = apply_rotation(k_rope, cos, sin, m.qk_rope_head_dim)
        return q_nope, q_rope, torch.cat([k_rope[:, 0], c], dim=-1)

    def absorbed_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """[T, H, dr + R]: each head's query in the cached rows' space, [q_rope | q_nope @ W_UK]."""
        w_uk = self.w_uk if self.w_uk is not None else self._kv_b()[0]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)  # [T, H, R]
        return torch.cat([q_rope, q_lat], dim=-1)

    def value_out(self, latent: torch.Tensor) -> torch.Tensor:
        """Per-head attention outputs [T, H, dv] from the weighted latents [T, H, R] (through W_UV)."""
        w_uv = self.w_uv if self.w_uv is not None else self._kv_b()[1]
        return torch.bmm(latent.transpose(0, 1), w_uv.to(latent.dtype)).transpose(0, 1)

    def expanded_kv(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [T, H, dn + dr] and values [T, H, dv] of cached rows [T, dr + R] (what
        transformers computes; the profiler reads them)."""
        m, t = self.mla, rows.shape[0]
        kv = self.kv_b_proj(rows[:, m.qk_rope_head_dim:]).view(t, self.n_heads, -1)
        k_rope = rows[:, None, :m.qk_rope_head_dim].expand(t, self.n_heads, m.qk_rope_head_dim)
        return torch.cat([kv[..., :m.qk_nope_head_dim], k_rope], dim=-1), kv[..., m.qk_nope_head_dim:]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch, rows=None) -> torch.Tensor:
        q_nope, q_rope, cached = self.project(x, positions)
        o = self.backend.attention(self, q_nope, q_rope, cached, batch, rows)
        return self.o_proj(o.reshape(x.shape[0], -1))


class DeepseekDecoderLayer(DecoderLayer):
    """The Llama-family layer (forward, sparse-FFN rows, fused norms) with latent attention."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: MLARotaryEmbedding):
        nn.Module.__init__(self)
        self.self_attn = MLAttention(cfg, layer_idx, rope)
        self.mlp = _ffn(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekBackbone(Backbone):
    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = MLARotaryEmbedding(cfg)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, self.rotary_emb) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(LlamaForCausalLM):
    """deepseek_v2 / deepseek_v3: packed input_ids/positions [total_tokens] -> hidden states."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.config = cfg
        self.model = DeepseekBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head_packed = None

    def set_backend(self, backend) -> None:
        """``backend``: the runner's paged attention (its pool and kernel choice); each layer attends
        through the latent attention over that pool."""
        c = self.config
        latent = PagedLatentAttention(backend.pool, backend.kernel, c.attention_scale, c.mla.qk_rope_head_dim)
        for layer in self.model.layers:
            layer.self_attn.backend = latent


class MLAAdapter(LlamaAdapter):
    """DeepSeek's latent attention (``DeepseekForCausalLM``): the pool holds one latent head per
    layer; plans, the profiler and the FLOP counts speak of query heads. Embedding, the layer tail
    and EXECUTE are Llama's."""

    # ---- PROFILE: every head's expanded queries, keys and values, as transformers computes them
    def layer_qkv(self, layer, hidden, positions):
        attn = self._body.layers[layer].self_attn
        q_nope, q_rope, rows = attn.project(self._body.layers[layer].input_layernorm(hidden), positions)
        k, v = attn.expanded_kv(rows)
        return torch.cat([q_nope, q_rope], dim=-1), k, v

    # ---- BUILDSTATE: one [k_rope | latent] row per token and layer, as the pool's K and V halves
    def state_layout(self):
        c = self.config
        return StateLayout("kv_pages", c.num_hidden_layers, 1, c.mla.latent_dim // 2)

    def relocate(self, k, delta, layer=None):
        """K halves [N, 1, w] computed at p, as at p + delta: only their RoPE part turns (every
        layer alike)."""
        return self._body.rotary_emb.relocate(k, delta)

    # ---- SELECTVISIBLESTATE: (window, sink) per query head
    def visible_state(self, head_config):
        c = self.config
        plans = {"dense": HeadConfig.all_global(c.num_hidden_layers, c.num_attention_heads)}
        if head_config is not None:
            retrieval = [(l, h) for l, row in enumerate(head_config.effective_classes())
                         for h, cls in enumerate(row) if cls == "retrieval"]
            if retrieval:
                l, h = retrieval[0]
                raise HeadConfigError(f"kv_head_classification[{l}][{h}] = 'retrieval': {c.model_type} shares one "
                                      f"latent among its query heads, which has no per-head selection (use global "
                                      f"or local)")
            plans["headsparse"] = head_config
        return {name: plan.visibility(model_windows=c.sliding_windows) for name, plan in plans.items()}

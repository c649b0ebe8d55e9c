"""The Llama-family forward (llama, mistral, qwen2, qwen3, and the mixture-of-experts families
qwen3_moe, qwen2_moe, mixtral, olmoe, whose layers differ only in the FFN: ``models/moe.py``) on
packed varlen batches.

Module names equal HF's, so checkpoint keys load as they are. Attention is delegated to the
backend in use (see ``redknot.engine.backends``); the model only computes q, k, v and RoPE.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import linear as projection
from .config import ModelConfig
from .moe import SparseMoeBlock
from .rope import RotaryEmbedding, apply_rotation



@functools.cache
def _fused_norms():
    """(add_rms_norm, silu_mul) Triton kernels, or None where triton is missing."""
    try:
        from ..kernels.norm import add_rms_norm, silu_mul
    except ImportError:
        return None
    return add_rms_norm, silu_mul


@functools.cache
def _norm_rope():
    """The fused kernel, or None where triton is missing (the torch path then runs)."""
    try:
        from ..kernels.rope import norm_rope
    except ImportError:
        return None
    return norm_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # the same math in one op
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:  # per head, or (OLMoE) over each whole projection
            q_dim, k_dim = ((self.head_dim, self.head_dim) if cfg.qk_norm_per_head
                            else (self.n_heads * self.head_dim, self.n_kv * self.head_dim))
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.head_norm = cfg.qk_norm and cfg.qk_norm_per_head
        self.clip_qkv = cfg.clip_qkv
        # gpt-oss: a learned logit per query head in the softmax denominator, with no value
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.attention_sinks else None
        self.rope = rope
        self.backend = None  # set by the runner
        self.qkv_weight = self.qkv_bias = None  # one [Hq+2Hkv)*D, hidden] GEMM once fused
        self.qkv_packed = self.o_packed = None  # CPU: the GEMM library's layout (models/linear.py)
        self.reduce = None  # tensor parallel: the sum of the ranks' partial outputs (redknot/distributed)

    def fuse(self, pack: bool = False) -> None:
        """One QKV GEMM instead of three: q/k/v_proj's weights become views of one fused tensor,
        so the separate modules (state dict, tests that edit a weight) stay valid. ``pack``
        also prepacks the QKV and output weights for the CPU GEMM (a second copy)."""
        self.qkv_weight = _fuse_rows(self.q_proj, self.k_proj, self.v_proj)
        self.qkv_bias = _fuse_rows(self.q_proj, self.k_proj, self.v_proj, name="bias")
        if pack:
            self.qkv_packed, self.o_packed = projection.pack(self.qkv_weight), projection.pack(self.o_proj.weight)
        if self.sinks is not None:  # the kernels read them in fp32: convert once, not every step
            self.sinks.data = self.sinks.data.float()

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """q [T, Hq, D], k and v [T, Hkv, D] of normed hidden states x, RoPE applied at positions."""
        t = x.shape[0]
        if self.qkv_weight is not None:
            nq, nkv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            qkv = projection.linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed)
            if (not x.is_cuda and not self.qk_norm and self.clip_qkv is None
                    and self.rope.rot_dim == self.head_dim):
                # q and k are adjacent in the fused output: one rotation for both
                cos, sin = self.rope.cos_sin(positions)
                qk = apply_rotation(qkv[:, :nq + nkv].view(t, self.n_heads + self.n_kv, self.head_dim),
                                    cos, sin, self.head_dim)
                v = qkv[:, nq + nkv:].view(t, self.n_kv, self.head_dim)
                return qk[:, :self.n_heads], qk[:, self.n_heads:], v
            q, k, v = qkv.split((nq, nkv, nkv), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm and not self.head_norm:  # OLMoE: one norm over each whole projection
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.reshape(t, self.n_heads, self.head_dim)
        k = k.reshape(t, self.n_kv, self.head_dim)
        v = v.reshape(t, self.n_kv, self.head_dim)
        norm_rope = _norm_rope() if x.is_cuda else None  # q/k norm + RoPE fused into one kernel on CUDA
        if norm_rope is not None:
            cos, sin = self.rope.cos_sin(positions)
            qw, kw = (self.q_norm.weight, self.k_norm.weight) if self.head_norm else (None, None)
            eps = self.q_norm.eps if self.head_norm else 0.0
            return (norm_rope(q, cos, sin, self.rope.rot_dim, qw, eps),
                    norm_rope(k, cos, sin, self.rope.rot_dim, kw, eps), v)
        if self.head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, k, positions)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch, rows=None) -> torch.Tensor:
        q, k, v = self.qkv(x, positions)
        o = self.backend.attention(self.layer_idx, q, k, v, batch, rows, sink_logits=self.sinks)
        return self.project_out(o.reshape(x.shape[0], self.n_heads * self.head_dim))

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection of attention outputs [T, Hq * D] (summed over the ranks under
        tensor parallelism: each holds some heads' columns)."""
        out = projection.linear(o, self.o_proj.weight, self.o_proj.bias, self.o_packed)
        return out if self.reduce is None else self.reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        h, i, b = cfg.hidden_size, intermediate_size or cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.gate_up_weight = self.gate_up_bias = None  # one [2I, hidden] GEMM once fused
        self.gate_up_packed = self.down_packed = None  # CPU: the GEMM library's layout
        self.reduce = None  # tensor parallel: the sum of the ranks' partial outputs (redknot/distributed)

    def fuse(self, pack: bool = False) -> None:
        self.gate_up_weight = _fuse_rows(self.gate_proj, self.up_proj)
        self.gate_up_bias = _fuse_rows(self.gate_proj, self.up_proj, name="bias")
        if pack:
            self.gate_up_packed = projection.pack(self.gate_up_weight)
            self.down_packed = projection.pack(self.down_proj.weight)

    def _down(self, h: torch.Tensor) -> torch.Tensor:
        return projection.linear(h, self.down_proj.weight, self.down_proj.bias, self.down_packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._forward(x)
        return out if self.reduce is None else self.reduce(out)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate_up = projection.linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_packed)
            fused = _fused_norms() if x.is_cuda else None
            if fused is not None:
                return self._down(fused[1](gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self._down(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _fuse_rows(*linears: nn.Linear, name: str = "weight") -> torch.Tensor | None:
    """Concatenate the linears' ``name`` tensors along the output rows and make each one a view
    of the result (no second copy of the weights is kept)."""
    parts = [getattr(m, name) for m in linears]
    if parts[0] is None:
        return None
    with torch.no_grad():
        fused = torch.cat([p.detach() for p in parts], dim=0)
    start = 0
    for m, p in zip(linears, parts):
        n = p.shape[0]
        setattr(m, name, nn.Parameter(fused[start:start + n], requires_grad=False))
        start += n
    return fused


def _ffn(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """The layer's FFN: the gated MLP, or on a MoE layer the sparse MoE block (with its shared
    expert, an MLP of its own size, where the model has one)."""
    if not cfg.is_moe_layer(layer_idx):
        return MLP(cfg)
    shared = cfg.moe.shared_expert_intermediate_size
    return SparseMoeBlock(cfg.hidden_size, cfg.moe, MLP(cfg, shared) if shared else None)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, rope)
        self.mlp = _ffn(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, batch)
        return self.add_ffn(x)

    def add_ffn(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x plus the FFN of its normed rows. ``rows``: the rows the FFN runs on (a sparse FFN); the
        others keep their residual, plus the shared expert's output in a MoE block that has one
        (a skipped token skips the routed experts only)."""
        if rows is None:
            return x + self.mlp(self.post_attention_layernorm(x))
        if isinstance(self.mlp, SparseMoeBlock) and self.mlp.has_shared_expert:
            return x + self.mlp(self.post_attention_layernorm(x), routed=rows)
        return x.index_add(0, rows, self.mlp(self.post_attention_layernorm(x[rows])))

    def forward_rows(self, x: torch.Tensor, positions: torch.Tensor, batch, rows):
        """The layer under a recovery's row plan: the FFN runs on the rows it picks (the others
        keep their residual; on MoE they skip the routed experts only), and only the rows it
        keeps continue. Returns (x, positions)."""
        x = x + self.self_attn(self.input_layernorm(x), positions, batch, rows)
        x = self.add_ffn(x, rows.ffn_rows(self.self_attn.layer_idx))
        keep = rows.keep_rows(self.self_attn.layer_idx)
        if keep is not None:
            x, positions = x[keep], positions[keep]
        return x, positions

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, batch,
                      add_rms_norm):
        """The same layer with each residual add fused into the next norm (one kernel each):
        takes and returns (this block's output, the residual stream before adding it)."""
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, h = h, add_rms_norm(h, n1.weight, n1.eps)
        else:
            h, residual = add_rms_norm(h, n1.weight, n1.eps, residual)
        h = self.self_attn(h, positions, batch)
        h, residual = add_rms_norm(h, n2.weight, n2.eps, residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary_emb) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, rows=None) -> torch.Tensor:
        """``batch``: the forward's metadata (``redknot.forward_batch``) every attention layer reads.
        ``rows``: a recovery's per-layer row plan (see ``DecoderLayer.forward_rows``); the hidden
        states returned are then those of the rows computed through the last layer."""
        x = self.embed_tokens(input_ids)
        if rows is not None:
            for layer in self.layers:
                x, positions = layer.forward_rows(x, positions, batch, rows)
            return self.norm(x)
        fused = _fused_norms() if x.is_cuda else None
        if fused is None:
            for layer in self.layers:
                x = layer(x, positions, batch)
            return self.norm(x)
        add_rms_norm = fused[0]
        residual = None
        for layer in self.layers:
            x, residual = layer.forward_fused(x, residual, positions, batch, add_rms_norm)
        return add_rms_norm(x, self.norm.weight, self.norm.eps, residual)[0]


class LlamaForCausalLM(nn.Module):
    """input_ids/positions are packed [total_tokens]; returns hidden states [total_tokens, hidden].
    A family with other decoder layers subclasses it with its own ``backbone`` class."""

    backbone = Backbone
    # tensor parallel: each rank's vocabulary slice gathered (redknot/distributed); a class default
    # so families that build their own parts (DeepSeek) have it too
    gather_logits = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = self.backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head_packed = None

    def fuse_projections(self, pack: bool = False) -> "LlamaForCausalLM":
        """Fuse QKV and gate/up into single GEMMs (inference; call after loading and casting).
        ``pack``: also prepack every projection for the CPU GEMM library (``models/linear.py``;
        a weight edited in place afterwards is repacked on its next use)."""
        for layer in self.model.layers:
            layer.self_attn.fuse(pack)
            layer.mlp.fuse(pack)
        if pack:
            self.head_packed = projection.pack(self.lm_head.weight)
        return self

    def set_backend(self, backend) -> None:
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, rows=None) -> torch.Tensor:
        return self.model(input_ids, positions, batch, rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = projection.linear(hidden, self.lm_head.weight, None, self.head_packed)
        return (logits if self.gather_logits is None else self.gather_logits(logits)).float()

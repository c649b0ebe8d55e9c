"""Qwen3-Next: a hybrid decoder of Gated DeltaNet (linear attention) layers and gated full-attention
layers (three linear to one full in the released models), each followed by a sparse MoE block with
a shared expert, on packed varlen batches.

- Linear layers (``GatedDeltaNet``): one projection to q, k, v and the output gate z (grouped per key
  head, transformers' layout), one to the per-head beta and decay inputs; a depthwise causal
  convolution (SiLU) over q/k/v; the gated delta rule (``kernels/gated_delta.py``) over L2-normalised
  q/k; a gated RMSNorm (``norm(o) * silu(z)``) and the output projection. Each sequence's conv and
  recurrent state lives in the pool's ``LinearStatePool`` (``cache/linear_state.py``) at its slot,
  so chunked prefill and decode continue from where the last forward stopped.
- Full layers (``GatedAttention``): q_proj gives each head's query and a sigmoid output gate; q/k
  norms per head; RoPE on the first ``partial_rotary_factor`` of each head; K/V in the page pool
  through the attention backend, which numbers these layers 0.. in order (the pool holds pages for
  full layers only).
- Norms scale by (1 + weight) (zero-centred weights), in float32.

Module names equal transformers', so checkpoint keys load as they are (``mtp.*`` keys, the
multi-token-prediction head, are not used and skipped by the loader).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import HeadConfig
from ..kernels import gated_delta as ref
from .adapter import ModelAdapter, StateLayout
from .config import ModelConfig, UnsupportedModelError
from .llama import MLP
from .moe import SparseMoeBlock
from .rope import RotaryEmbedding


@functools.cache
def _fla():
    """flash-linear-attention's Triton kernels (the optional ``fla`` extra), or None where they do
    not import or ``REDKNOT_FLA=0`` (to compare with it): the torch reference then runs."""
    if os.environ.get("REDKNOT_FLA", "1") == "0":
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # missing, or built for another torch/triton
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), computed in float32 and cast back (weights initialised to 0)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype != torch.float64 else x
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.to(out.dtype))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * silu(gate)`` per value head (the linear layers' output norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float() if dtype != torch.float64 else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(gate.to(xf.dtype))).to(dtype)


class GatedAttention(nn.Module):
    """Full softmax attention with a sigmoid output gate per query-head channel."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, kv_layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.layer_idx, self.kv_layer = layer_idx, kv_layer  # kv_layer: the pool's (full layers only)
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.rope = rope
        self.backend = None  # set by the runner

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """q [T, Hq, D], k and v [T, Hkv, D] (norms and RoPE applied) and the output gate [T, Hq*D]."""
        t, d = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(t, self.n_heads, 2 * d).split(d, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.n_kv, d))
        v = self.v_proj(x).view(t, self.n_kv, d)
        q, k = self.rope(q, k, positions)
        return q, k, v, gate.reshape(t, -1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        q, k, v, gate = self.qkv(x, positions)
        o = self.backend.attention(self.kv_layer, q, k, v, batch).reshape(x.shape[0], -1)
        return self.o_proj(o * torch.sigmoid(gate))


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer; its state per sequence lives in ``self.state`` (the pool's
    ``LinearStatePool``, set by the runner) at index ``state_layer``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, state_layer: int):
        super().__init__()
        lc = cfg.linear
        self.layer_idx, self.state_layer = layer_idx, state_layer
        self.hk, self.hv, self.dk, self.dv = lc.num_key_heads, lc.num_value_heads, lc.key_head_dim, lc.value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = lc.key_dim, lc.value_dim, lc.conv_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, lc.conv_kernel, groups=self.conv_dim, bias=False,
                                padding=lc.conv_kernel - 1)
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.hv, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        self.state = None  # LinearStatePool, set by the runner

    def project(self, x: torch.Tensor):
        """(q/k/v channels before the convolution [T, conv_dim], z [T, HV, Dv], beta and the log
        decay g [T, HV]). The projections are grouped per key head: [q, k, v group, z group] and
        [b group, a group]."""
        t, r = x.shape[0], self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split((self.dk, self.dk, r * self.dv, r * self.dv), dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.hk, 2 * r).split((r, r), dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        beta = b.reshape(t, self.hv).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(t, self.hv).float() + self.dt_bias.float())
        return mixed, z.reshape(t, self.hv, self.dv), beta, g

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        t = x.shape[0]
        mixed, z, beta, g = self.project(x)
        slots, fresh = batch.state_slots, batch.extras["linear_fresh"]
        state = self.state.read(self.state_layer, slots, fresh)
        split = batch.extras.get("linear_split")
        capture = batch.extras.get("linear_capture")  # a chunk prefill's: each chunk's inputs (cache/linear_chunks.py)
        if split is None:
            o, state = self.mix(mixed, g, beta, state, batch.cu_seqlens_q, batch.max_q_len, capture)
        elif capture is not None:
            raise ValueError("a forward both snapshots linear states and captures chunk inputs")
        else:  # rows up to each sequence's snapshot point, then the rest from the state there
            first, second = split
            o = mixed.new_empty(t, self.hv, self.dv)
            o1, state = self.mix(mixed[first.rows], g[first.rows], beta[first.rows], state, first.cu, first.max_len)
            o[first.rows] = o1
            self.state.write(self.state_layer, batch.extras["linear_snapshot_rows"], *state)
            if second is not None:
                keep = [x.index_select(0, second.seqs) for x in state]
                o2, part = self.mix(mixed[second.rows], g[second.rows], beta[second.rows], keep, second.cu,
                                    second.max_len)
                o[second.rows] = o2
                state = [x.index_copy(0, second.seqs, y) for x, y in zip(state, part)]
        self.state.write(self.state_layer, slots, *state)
        o = self.norm(o, z).reshape(t, self.value_dim)
        return self.out_proj(o)

    def mix(self, mixed, g, beta, state, cu, max_len, capture=None):
        """The convolution and the gated delta rule over packed rows of sequences continuing from
        ``state`` (conv [B, C, W-1], recurrent [B, HV, Dk, Dv]). Returns (o [T, HV, Dv], the new state).
        ``capture(layer, conv inputs, k, v, g, beta)`` sees the rule's inputs."""
        t = mixed.shape[0]
        conv_state, rec_state = state
        conv_in = mixed
        mixed, conv_state = ref.causal_conv1d_varlen(mixed, self.conv1d.weight[:, 0], conv_state, cu)
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q, k, v = q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk), v.view(t, self.hv, self.dv)
        if capture is not None:
            capture(self.state_layer, conv_in, k, v, g, beta)
        o, rec_state = _gated_delta(q, k, v, g, beta, rec_state, cu, max_len)
        return o, [conv_state, rec_state]


def _gated_delta(q, k, v, g, beta, state, cu, max_len: int):
    """The gated delta rule over packed rows: flash-linear-attention's kernels on CUDA where they
    import (fused recurrent for decode, chunked varlen for prefill), else the torch reference."""
    fla = _fla() if q.is_cuda and q.dtype != torch.float64 else None
    if fla is None:
        return ref.varlen_gated_delta_rule(q, k, v, g, beta, state, cu, max_len)
    chunk, recurrent = fla
    state = state.float()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # views of the convolution's output
    if max_len == 1 and q.shape[0] == cu.numel() - 1:  # decode: one token per sequence, no host sync
        # by keyword: the fused recurrent function's fifth positional parameter is a per-key decay
        o, state = recurrent(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None].to(q.dtype),
                             initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o[:, 0], state
    o, state = chunk(q[None], k[None], v[None], g=g[None], beta=beta[None].to(q.dtype), initial_state=state,
                     output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())
    return o[0], state


class _Rows(NamedTuple):
    rows: torch.Tensor  # packed rows of this part, in order
    cu: torch.Tensor  # int32 [B' + 1]: its sequences' rows
    max_len: int
    seqs: torch.Tensor | None  # the batch's sequences it holds (None: all of them)


def _split_at_snapshots(batch) -> None:
    """A forward that also snapshots some sequences' state (``linear_snapshot``: per sequence the row
    offset of its snapshot point or -1, and the state row to write): each linear layer runs the rows
    before the points, writes the snapshots, then runs the rest. Sequences without a point run
    whole in the first part; the second holds only sequences with rows after their point."""
    offsets, snap_rows = batch.extras["linear_snapshot"]
    dev = batch.cu_seqlens_q.device
    first = [o if o >= 0 else n for o, n in zip(offsets, batch.q_lens)]
    rest = [n - f for n, f in zip(batch.q_lens, first)]
    seq, local = ref.row_coordinates(batch.cu_seqlens_q, sum(batch.q_lens))
    in_first = local < torch.tensor(first, device=dev)[seq]
    cu = lambda lens: torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)  # noqa: E731
    part1 = _Rows(in_first.nonzero()[:, 0], cu(first), max(first), None)
    later = [i for i, n in enumerate(rest) if n]
    part2 = (_Rows((~in_first).nonzero()[:, 0], cu([rest[i] for i in later]), max(rest),
                   torch.tensor(later, device=dev)) if later else None)
    batch.extras["linear_split"] = (part1, part2)
    batch.extras["linear_snapshot_rows"] = torch.tensor(snap_rows, device=dev)


def _ffn(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    if not cfg.is_moe_layer(layer_idx):
        return MLP(cfg)
    shared = cfg.moe.shared_expert_intermediate_size
    return SparseMoeBlock(cfg.hidden_size, cfg.moe, MLP(cfg, shared) if shared else None)


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, index: int, rope: RotaryEmbedding):
        """``index``: the layer's number among the layers of its kind (full: the pool's layer)."""
        super().__init__()
        self.is_linear = cfg.is_linear_layer(layer_idx)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx, index)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx, index, rope)
        self.mlp = _ffn(cfg, layer_idx)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        x = x + mixer(self.input_layernorm(x), positions, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg)
        counts = {True: 0, False: 0}
        layers = []
        for i in range(cfg.num_hidden_layers):
            kind = cfg.is_linear_layer(i)
            layers.append(HybridDecoderLayer(cfg, i, counts[kind], self.rotary_emb))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        # a sequence whose rows start at position 0 starts from a zero state (its slot may hold an
        # earlier owner's); computed on the device, so decode graphs capture it
        batch.extras["linear_fresh"] = positions[batch.cu_seqlens_q[:-1].long()] == 0
        if "linear_snapshot" in batch.extras:
            _split_at_snapshots(batch)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, batch)
        return self.norm(x)


class Qwen3NextForCausalLM(nn.Module):
    """input_ids/positions are packed [total_tokens]; returns hidden states [total_tokens, hidden]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = HybridBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self, pack: bool = False) -> "Qwen3NextForCausalLM":
        """Fuse each dense MLP's (and shared expert's) gate/up projections into one GEMM."""
        for layer in self.model.layers:
            layer.mlp.fuse(pack)
        return self

    def set_backend(self, backend) -> None:
        """The attention backend for the full layers, and its pool's linear state for the others."""
        state = getattr(backend.pool, "linear_state", None)
        for layer in self.model.layers:
            if layer.is_linear:
                layer.linear_attn.state = state
            else:
                layer.self_attn.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, rows=None) -> torch.Tensor:
        if rows is not None:
            raise NotImplementedError("a recovery row plan on a hybrid model: its linear layers need every row "
                                      "(documents are recomputed in the pool instead)")
        return self.model(input_ids, positions, batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.weight).float()


class HybridAdapter(ModelAdapter):
    """Qwen3-Next's adapter: K/V pages for the full-attention layers only (the pool's layer i is the
    i-th full layer), a linear state per sequence for the others. Head plans are written over every
    layer of the model (a head config lists each layer) and the full layers' rows are what the pool
    sees. The linear layers' state at a token depends on every earlier token, so cached K/V pages
    alone cannot resume a prompt: a cached prefix needs the state stored at its end
    (``cache/linear_prefix.py``), and a cached document needs its chunk's effect on the state
    (``cache/linear_chunks.py``): its transition and own state per linear layer and value head.

    Which document methods place chunks (``places_documents``): those that only read the placed
    state, ``full_reuse`` (each head's state composed exactly, or started from the chunk's own
    state where its decay is below the threshold). Methods that recompute chunk rows in place
    (``epic``, and the recovery methods: ``cacheblend``, ``redknot``, ``redknot_paper``,
    ``qrecompute``, ``redknot_exact``) recompute the whole prompt instead (the "all heads
    recompute" rule): a recomputed row's linear output needs the state just before that row,
    which a chunk's transition does not give (it maps the state across the whole chunk); that
    would need each chunk's per-token recurrence inputs cached (on Qwen3-Next-80B ~0.6 MB a token,
    ~25 times its full layers' K/V) and a rerun over every chunk row, and a row left out of a layer
    (redknot's sparse FFN) would need its cached inputs at every later linear layer."""

    document_reuse = True
    prefix_caching = False

    def __init__(self, model, config: ModelConfig):
        self.model, self.config = model, config
        self._body = model.model
        self._full = config.attention_layers

    def places_documents(self, method) -> bool:
        return method.reads_chunks and not method.recovers and not method.recompute_chunk_heads

    def embed(self, ids):
        return self._body.embed_tokens(ids)

    def layer_qkv(self, layer, hidden, positions):
        raise UnsupportedModelError("head profiling of a hybrid model (qwen3_next) is not supported: its linear "
                                    "layers have no K/V heads to classify")

    layer_attention = layer_ffn = layer_finish = layer_qkv

    def state_layout(self):
        c = self.config
        linear = c.num_hidden_layers - len(self._full)
        return StateLayout("kv_pages", len(self._full), c.num_key_value_heads, c.head_dim, linear, c.linear)

    def relocate(self, k, delta, layer=None):
        return self._body.rotary_emb.relocate(k, delta)

    def visible_state(self, head_config):
        c = self.config
        plans = {"dense": HeadConfig.all_global(c.num_hidden_layers, c.num_key_value_heads)}
        if head_config is not None:
            plans["headsparse"] = head_config
        out = {}
        for name, plan in plans.items():
            window, sink = plan.visibility(model_windows=c.sliding_windows)
            out[name] = (window[self._full], sink[self._full])
        return out

    def prepare(self, device):
        self.model.fuse_projections(pack=device.type == "cpu")

    def set_backend(self, backend):
        self.model.set_backend(backend)

    def execute(self, ids, positions, batch, rows=None):
        return self.model(ids, positions, batch, rows)

    def logits(self, hidden):
        return self.model.logits(hidden)

"""Model adapters: what the runtime asks of an architecture, in the seed's four verbs.

PROFILE             the per-layer pieces the head profiler reads: embeddings, each layer's queries,
                    keys and values for a prompt, and the rest of the layer given its attention output
BUILDSTATE          what a prefill stores per (layer, KV head) and how it is reused elsewhere: K/V
                    pages of ``head_dim`` (the pool's layout), keys relocated by a RoPE rotation when
                    a document moves (each layer's own, where layers rotate differently)
SELECTVISIBLESTATE  what each head sees: a head plan's (window, sink) per (layer, KV head) through the
                    one visibility rule, with the model's own sliding-window layers folded in
EXECUTE             the forward: token ids and positions with the batch's metadata (and a recovery's
                    row plan) in, hidden states out; logits of chosen rows

The engine, the scheduler, the pool and the profiler only talk to an adapter; a new architecture
(MoE experts, MLA latents, linear-attention state) is a new adapter, registered by ``model_type``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import HeadConfig
from .config import LinearAttentionConfig, ModelConfig


@dataclass(frozen=True)
class StateLayout:
    """What a prefill stores per (layer, KV head) (BUILDSTATE)."""
    kind: str  # "kv_pages": one K and one V row of head_dim per token
    num_layers: int  # layers with K/V pages (a hybrid's full-attention layers only)
    num_kv_heads: int
    head_dim: int
    # a hybrid model's linear-attention layers: a fixed-size state per sequence and layer beside the
    # pages (``cache/linear_state.py``)
    linear_layers: int = 0
    linear: LinearAttentionConfig | None = None


class ModelAdapter:
    """The interface; ``LlamaAdapter`` is the Llama family's (Llama, Mistral, Qwen2, Qwen3)."""

    config: ModelConfig
    model: torch.nn.Module
    # Whether a prompt's K/V can come from elsewhere: cached document chunks placed or recovered
    # (``document_reuse``, per method ``places_documents``), a cached prompt prefix
    # (``prefix_caching``). A model whose layers also carry a recurrent state over the prompt (hybrid
    # linear attention) places only what its cached state can serve.
    document_reuse: bool = True
    prefix_caching: bool = True

    def places_documents(self, method) -> bool:
        """Whether requests of ``method`` (a ``reuse.registry.MethodSpec`` reading chunks) take
        cached document K/V; if not, they prefill the whole prompt in the pool."""
        return self.document_reuse

    # ---- PROFILE
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def layer_qkv(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor):
        """q [T, Hq, D], k and v [T, Hkv, D] of layer ``layer`` for the hidden states entering it."""
        raise NotImplementedError

    def layer_attention(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The residual stream after layer ``layer``'s attention block, given its attention output [T, Hq, D]."""
        raise NotImplementedError

    def layer_ffn(self, layer: int, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream ``hidden`` after layer ``layer``'s FFN block. ``rows``: a sparse FFN's
        rows; the others keep their residual (in a MoE with a shared expert, plus its output)."""
        raise NotImplementedError

    def layer_finish(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The hidden states leaving layer ``layer``, given its attention output [T, Hq, D]."""
        return self.layer_ffn(layer, self.layer_attention(layer, hidden, attn_out))

    def layer_sink_logits(self, layer: int) -> torch.Tensor | None:
        """The learned sink logit per query head [Hq] in layer ``layer``'s softmax (gpt-oss), or None."""
        return None

    # ---- BUILDSTATE
    def state_layout(self) -> StateLayout:
        raise NotImplementedError

    def relocate(self, k: torch.Tensor, delta: int, layer: int | None = None) -> torch.Tensor:
        """Keys [N, Hkv, D] of layer ``layer`` computed at positions p, as computed at p + delta
        (``layer`` None: keys of any layer, where every layer rotates alike)."""
        raise NotImplementedError

    def relocate_layers(self, k: torch.Tensor, delta) -> torch.Tensor:
        """Keys [L, N, Hkv, D] of every layer (cached chunks) computed at positions p, as computed
        at p + delta (an int, or an int tensor [N]: each token its own move, the same in every
        layer): one rotation for all layers where they rotate alike."""
        return self.relocate(k, delta)  # the rotation broadcasts over the leading layer dimension

    # ---- SELECTVISIBLESTATE
    def visible_state(self, head_config: HeadConfig | None) -> dict:
        """Plan name -> (window, sink) int [L, Hkv]: ``dense`` (every head global), and with a head
        config ``headsparse`` (each head its class's visibility)."""
        raise NotImplementedError

    # ---- EXECUTE
    def prepare(self, device: torch.device) -> None:
        """Fusion at load (projections packed for the device)."""

    def set_backend(self, backend) -> None:
        raise NotImplementedError

    def execute(self, ids: torch.Tensor, positions: torch.Tensor, batch, rows=None) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LlamaAdapter(ModelAdapter):
    """Pre-norm decoder layers with grouped-query attention, RoPE and a gated MLP or a sparse MoE
    block (``models/llama.py``, ``models/moe.py``)."""

    def __init__(self, model, config: ModelConfig):
        self.model, self.config = model, config
        self._body = model.model

    def embed(self, ids):
        return self._body.embed_tokens(ids)

    def layer_qkv(self, layer, hidden, positions):
        block = self._body.layers[layer]
        return block.self_attn.qkv(block.input_layernorm(hidden), positions)

    def layer_sink_logits(self, layer):
        return getattr(self._body.layers[layer].self_attn, "sinks", None)

    def layer_attention(self, layer, hidden, attn_out):
        attn = self._body.layers[layer].self_attn
        out = attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        reduce = getattr(attn, "reduce", None)  # tensor parallel: each rank's heads give a partial sum
        return hidden + (out if reduce is None else reduce(out))

    def layer_ffn(self, layer, hidden, rows=None):
        return self._body.layers[layer].add_ffn(hidden, rows)

    def state_layout(self):
        c = self.config
        return StateLayout("kv_pages", c.num_hidden_layers, c.num_key_value_heads, c.head_dim)

    def relocate(self, k, delta, layer=None):
        return self._body.rotary_emb.relocate(k, delta)  # one RoPE for every layer

    def visible_state(self, head_config):
        c = self.config
        plans = {"dense": HeadConfig.all_global(c.num_hidden_layers, c.num_key_value_heads)}
        if head_config is not None:
            plans["headsparse"] = head_config
        return {name: plan.visibility(model_windows=c.sliding_windows) for name, plan in plans.items()}

    def prepare(self, device):
        self.model.fuse_projections(pack=device.type == "cpu")  # CPU: prepacked GEMM weights (models/linear.py)

    def set_backend(self, backend):
        self.model.set_backend(backend)

    def execute(self, ids, positions, batch, rows=None):
        return self.model(ids, positions, batch, rows)

    def logits(self, hidden):
        return self.model.logits(hidden)


"""The sparse mixture-of-experts FFN block: a router picks k of E experts per token, and each
token's output is the routing-weighted sum of its experts' gated MLPs (plus a shared expert where
the model has one).

Module and parameter names are transformers' (``gate`` or ``router``, ``experts.gate_up_proj``
[E, 2I, H], ``experts.down_proj`` [E, H, I], ``shared_expert``, ``shared_expert_gate``), so
checkpoint keys map onto them (``loader.expert_target`` folds per-expert keys into the 3D tensors).
On the CPU the experts run the torch reference (``kernels/moe_reference.py``); on CUDA the fused
Triton grouped GEMM (``kernels/fused_moe.py``), which never syncs with the host, so decode with
MoE layers is captured in CUDA graphs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.moe_reference import experts_reference
from .config import MoEConfig

ROUTINGS = ("softmax_topk", "topk_softmax")


@functools.cache
def _fused_experts():
    """The Triton experts forward, or None where triton is missing (the torch reference then runs)."""
    try:
        from ..kernels.fused_moe import fused_experts
    except ImportError:
        return None
    return fused_experts


def route(logits: torch.Tensor, top_k: int, routing: str = "softmax_topk",
          norm_topk_prob: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights (float32, float64 for float64 logits [T, k]) and expert ids (int64 [T, k]) from router logits [T, E].
    ``softmax_topk``: softmax over every expert, the k largest, renormalised to sum 1 when
    ``norm_topk_prob``; ``topk_softmax``: the k largest logits, softmax over them."""
    if routing == "softmax_topk":
        weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if routing == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top.to(torch.promote_types(top.dtype, torch.float32)), dim=-1), ids
    raise ValueError(f"routing={routing!r}: use one of {ROUTINGS}")


class Router(nn.Module):
    """A linear map to one logit per expert (with a bias in gpt-oss)."""

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(moe.num_experts)) if moe.router_bias else None
        nn.init.normal_(self.weight, std=0.02)
        self.top_k, self.routing, self.norm_topk_prob = moe.top_k, moe.routing, moe.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(F.linear(x, self.weight, self.bias), self.top_k, self.routing, self.norm_topk_prob)


class Experts(nn.Module):
    """E gated MLPs held as 3D tensors: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]."""

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size
        # random init (normal, 0.02) so a model built without a checkpoint routes and computes finite values
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden).normal_(std=0.02))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, i).normal_(std=0.02))
        if moe.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
            self.down_proj_bias = nn.Parameter(torch.zeros(e, hidden))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.activation, self.alpha, self.limit = moe.activation, moe.swiglu_alpha, moe.swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[T, H]: each token's routed experts summed with their weights (``weights``, ``ids`` [T, k])."""
        fused = _fused_experts() if x.is_cuda else None
        run = fused if fused is not None else experts_reference
        return run(x, self.gate_up_proj, self.down_proj, weights, ids, self.activation,
                   self.gate_up_proj_bias, self.down_proj_bias, self.alpha, self.limit)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ an optional shared expert: its MLP's output times sigmoid(shared_expert_gate(x)))."""

    def __init__(self, hidden: int, moe: MoEConfig, shared_expert: nn.Module | None = None):
        """``shared_expert``: the shared expert MLP (built by the caller, the model's own MLP class)."""
        super().__init__()
        self.router_name = moe.router_name
        self.add_module(moe.router_name, Router(hidden, moe))
        self.experts = Experts(hidden, moe)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_expert is not None else None

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert is not None

    def fuse(self, pack: bool = False) -> None:
        """Fuse the shared expert's projections (the experts are fused already)."""
        if self.shared_expert is not None and hasattr(self.shared_expert, "fuse"):
            self.shared_expert.fuse(pack)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for x [T, H]."""
        weights, ids = getattr(self, self.router_name)(x)
        return self.experts(x, weights, ids)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared_expert is None:
            return None
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def forward(self, x: torch.Tensor, routed: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. ``routed``: row indices of x that go through the routed experts (the
        sparse FFN's rows); the other rows get only the shared expert's output (zeros without one)."""
        shared = self.shared(x)
        if routed is None:
            out = self.routed(x)
            return out if shared is None else out + shared
        out = torch.zeros_like(x) if shared is None else shared
        return out.index_add(0, routed, self.routed(x[routed]))

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

ROUTINGS = ("softmax_topk", "topk_softmax", "softmax_group_topk", "sigmoid_group_topk")
_GROUPED = ("softmax_group_topk", "sigmoid_group_topk")


@functools.cache
def _fused_experts():
    """The Triton experts forward, or None where triton is missing (the torch reference then runs)."""
    try:
        from ..kernels.fused_moe import fused_experts
    except ImportError:
        return None
    return fused_experts


def route(logits: torch.Tensor, top_k: int, routing: str = "softmax_topk",
          norm_topk_prob: bool = False, n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
          correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights (float32, float64 for float64 logits [T, k]) and expert ids (int64 [T, k]) from router logits [T, E].
    ``softmax_topk``: softmax over every expert, the k largest, renormalised to sum 1 when
    ``norm_topk_prob``; ``topk_softmax``: the k largest logits, softmax over them. The grouped
    routings (DeepSeek) see ``grouped_route``."""
    if routing in _GROUPED:
        return grouped_route(logits, top_k, routing == "sigmoid_group_topk", norm_topk_prob, n_group, topk_group,
                             scaling, correction)
    if routing == "softmax_topk":
        weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if routing == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top.to(torch.promote_types(top.dtype, torch.float32)), dim=-1), ids
    raise ValueError(f"routing={routing!r}: use one of {ROUTINGS}")


def grouped_route(logits: torch.Tensor, top_k: int, sigmoid: bool, norm_topk_prob: bool, n_group: int,
                  topk_group: int, scaling: float, correction: torch.Tensor | None):
    """DeepSeek's routing. Scores: softmax (V2) or sigmoid (V3) of the logits; the experts chosen
    from the ``topk_group`` of ``n_group`` groups with the best group score (V2: its best expert; V3:
    its two best, by score + ``correction``), the k best by that same score; weights: the chosen
    experts' scores (renormalised with ``norm_topk_prob``) times ``scaling``."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    scores = x.sigmoid() if sigmoid else x.softmax(dim=-1)
    choice = scores if correction is None else scores + correction.to(scores.dtype)
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        best = grouped.topk(2, dim=-1).values.sum(-1) if sigmoid else grouped.max(dim=-1).values
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(topk_group, dim=-1).indices, True)
        # V3 rules the other groups out at -inf; V2 at 0 (below every softmax score)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf") if sigmoid else 0.0)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class Router(nn.Module):
    """A linear map to one logit per expert (with a bias in gpt-oss)."""

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(moe.num_experts)) if moe.router_bias else None
        nn.init.normal_(self.weight, std=0.02)
        self.top_k, self.routing, self.norm_topk_prob = moe.top_k, moe.routing, moe.norm_topk_prob
        self.grouping = (moe.n_group, moe.topk_group, moe.routed_scaling_factor)
        # DeepSeek routes in float32 whatever the model's dtype, as transformers does
        self.fp32 = moe.routing in _GROUPED
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
                                        if moe.score_correction_bias else None)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.fp32:  # a cast of the model leaves the router in float32
            for p in self._parameters.values():
                if p is not None and p.is_floating_point():
                    p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fp32:
            logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
            return route(logits, self.top_k, self.routing, self.norm_topk_prob, *self.grouping,
                         self.e_score_correction_bias)
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
        self.router_name, self.shared_name = moe.router_name, moe.shared_expert_name
        self.add_module(moe.router_name, Router(hidden, moe))
        self.experts = Experts(hidden, moe)
        self.add_module(moe.shared_expert_name, shared_expert)
        gated = shared_expert is not None and moe.shared_expert_gated
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if gated else None

    @property
    def has_shared_expert(self) -> bool:
        return getattr(self, self.shared_name) is not None

    def fuse(self, pack: bool = False) -> None:
        """Fuse the shared expert's projections (the experts are fused already)."""
        expert = getattr(self, self.shared_name)
        if expert is not None and hasattr(expert, "fuse"):
            expert.fuse(pack)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for x [T, H]."""
        weights, ids = getattr(self, self.router_name)(x)
        return self.experts(x, weights, ids)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        expert = getattr(self, self.shared_name)
        if expert is None:
            return None
        return expert(x) if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * expert(x)

    def forward(self, x: torch.Tensor, routed: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. ``routed``: row indices of x that go through the routed experts (the
        sparse FFN's rows); the other rows get only the shared expert's output (zeros without one)."""
        shared = self.shared(x)
        if routed is None:
            out = self.routed(x)
            return out if shared is None else out + shared
        out = torch.zeros_like(x) if shared is None else shared
        return out.index_add(0, routed, self.routed(x[routed]))

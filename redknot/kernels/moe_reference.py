"""Mixture-of-experts in plain torch: the experts forward the CPU runs, and a reference for each
step of the fused Triton kernels (``kernels/fused_moe.py``).

Experts are 3D tensors in transformers' in-memory layout: ``gate_up`` [E, 2I, H] (the gate's I rows,
then the up projection's), ``down`` [E, H, I], optional biases [E, 2I] and [E, H]. A token's k
routed experts each add ``weight * down(act(gate_up(x)))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "swiglu_clamped")


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float = 1.702,
                     limit: float = 7.0) -> torch.Tensor:
    """``silu``: silu(gate) * up. ``swiglu_clamped`` (gpt-oss): gate clamped above at ``limit``, up
    to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swiglu_clamped":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"activation={activation!r}: use one of {ACTIVATIONS}")


def experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                      down_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """x [T, H] through its routed experts (``ids`` [T, k], ``weights`` [T, k]): the token-expert pairs
    sorted by expert, one GEMM pair per expert that has tokens; each token's k outputs are summed
    in float32 (float64 for float64 x) and the sum rounded once to x's dtype. Reads the per-expert
    counts on the host."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    acc = torch.promote_types(x.dtype, torch.float32)
    pair_weight = weights.reshape(-1).to(acc)
    out = torch.zeros(t * k, x.shape[1], dtype=acc, device=x.device)
    inter = gate_up.shape[1] // 2
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        h = F.linear(x[pairs // k], gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
        a = gated_activation(h[:, :inter], h[:, inter:], activation, alpha, limit)
        y = F.linear(a, down[e], None if down_bias is None else down_bias[e])
        out[pairs] = y.to(acc) * pair_weight[pairs, None]
    return out.view(t, k, x.shape[1]).sum(1).to(x.dtype)


# ---- the fused kernels' steps


def align_reference(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-expert pairs (``ids`` [T, k] flattened: pair p = token p // k, its (p % k)-th expert)
    sorted by expert (stably) and each expert's run padded to a multiple of ``block_m``, in a buffer
    of the worst case T*k + E*(block_m - 1) slots. Returns (pair of each slot, T*k in padding slots,
    int32 [P]; expert of each block of block_m slots, -1 past the last, int32 [P // block_m]). No
    host sync."""
    n = ids.numel()
    flat = ids.reshape(-1).long()
    size = n + num_experts * (block_m - 1)
    size = -(-size // block_m) * block_m
    # counts by scatter_add, not bincount (whose size depends on the ids: a host sync on CUDA), so
    # this is also the fused path's alignment for large batches
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    first = counts.cumsum(0) - counts  # each expert's first index in the sorted pairs
    dest = starts[sorted_e] + torch.arange(n, device=ids.device) - first[sorted_e]
    slot_pair = torch.full((size,), n, dtype=torch.int32, device=ids.device)
    slot_pair[dest] = order.to(torch.int32)
    block_start = torch.arange(0, size, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return slot_pair, block_expert


def gate_up_reference(x: torch.Tensor, gate_up: torch.Tensor, slot_pair: torch.Tensor, block_expert: torch.Tensor,
                      top_k: int, activation: str, gate_up_bias: torch.Tensor | None = None, alpha: float = 1.702,
                      limit: float = 7.0) -> torch.Tensor:
    """The first grouped GEMM with the activation: [P, I] in x's dtype, a row per slot (padding and
    unused slots' rows are zero here; the kernel leaves them unspecified)."""
    block_m = slot_pair.numel() // block_expert.numel()
    inter = gate_up.shape[1] // 2
    out = torch.zeros(slot_pair.numel(), inter, dtype=x.dtype, device=x.device)
    n = x.shape[0] * top_k
    for b, e in enumerate(block_expert.tolist()):
        rows = slice(b * block_m, (b + 1) * block_m)
        pair = slot_pair[rows].long()
        ok = pair < n
        if e < 0 or not bool(ok.any()):
            continue
        h = F.linear(x[pair[ok] // top_k].float(), gate_up[e].float(),
                     None if gate_up_bias is None else gate_up_bias[e].float())
        out[rows][ok] = gated_activation(h[:, :inter], h[:, inter:], activation, alpha, limit).to(x.dtype)
    return out


def down_reference(inter: torch.Tensor, down: torch.Tensor, slot_pair: torch.Tensor, block_expert: torch.Tensor,
                   weights: torch.Tensor, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The second grouped GEMM times each pair's routing weight: [T*k, H] in inter's dtype, a row per
    pair (``weights`` [T, k])."""
    block_m = slot_pair.numel() // block_expert.numel()
    n = weights.numel()
    out = torch.zeros(n, down.shape[1], dtype=inter.dtype, device=inter.device)
    w = weights.reshape(-1).float()
    for b, e in enumerate(block_expert.tolist()):
        rows = slice(b * block_m, (b + 1) * block_m)
        pair = slot_pair[rows].long()
        ok = pair < n
        if e < 0 or not bool(ok.any()):
            continue
        y = F.linear(inter[rows][ok].float(), down[e].float(), None if down_bias is None else down_bias[e].float())
        out[pair[ok]] = (y * w[pair[ok], None]).to(inter.dtype)
    return out

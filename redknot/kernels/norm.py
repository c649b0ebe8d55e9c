"""Fused residual add + RMSNorm and SiLU-gate multiply, one pass each in Triton.

Unfused, a decoder layer's two norms are ~12 small elementwise kernels (fp32 casts, pow, mean,
rsqrt, multiplies, casts back) plus two residual adds; at decode every one of them is a launch
that moves a few KB, so they cost more than their bytes. ``add_rms_norm`` reads x and the
residual once, writes their sum (the new residual, rounded as torch's add rounds) and the normed
row (rounded to the input dtype, then scaled by the weight in fp32 and rounded once, as
``redknot.models.llama.RMSNorm`` does). The torch modules are the reference; tests compare the
two in the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, n_cols, eps,
                         stride_x, stride_r, stride_y, stride_s,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    xn = (xf * tl.rsqrt(var + eps)).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (xn * w).to(y_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of ``x + residual`` (or of ``x``) over the last dim of [T, N] rows.

    Returns (normed, x + residual) with a residual, else normed alone."""
    t, n = x.shape
    y = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else x
    if t:
        r = residual if residual is not None else x
        _add_rms_norm_kernel[(t,)](x, r, weight, y, s, n, eps, x.stride(0), r.stride(0), y.stride(0), s.stride(0),
                                   HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n),
                                   num_warps=8 if n >= 2048 else 4)
    return (y, s) if residual is not None else y


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=ok, other=0.0)
    # torch: silu(gate) rounds to the dtype, then the product rounds again
    a = (g.to(tl.float32) * tl.sigmoid(g.to(tl.float32))).to(g.dtype)
    tl.store(out_ptr + row * stride_o + cols, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [T, 2I] gate/up projection."""
    t, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out

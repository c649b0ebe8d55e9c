"""Fused mixture-of-experts on the GPU: a Triton grouped GEMM over token-expert pairs.

Three steps, each with its torch reference in ``kernels/moe_reference.py``:

1. ``align``: the T*k token-expert pairs sorted by expert and each expert's run padded to the GEMM
   block (BLOCK_M rows), in a buffer of the worst case T*k + E*(BLOCK_M-1) slots, so every shape
   is static: no host sync, and decode steps are captured in CUDA graphs. Up to
   ``ONE_PROGRAM_PAIRS`` pairs one Triton program counts, scans and scatters (one launch); more
   pairs are sorted on the device by the torch reference.
2. ``gate_up``: per block of slots (one expert), x's rows times the expert's gate and up rows, the
   activation fused (``silu`` or gpt-oss's clamped SwiGLU): [slots, I].
3. ``down``: the expert's down projection times each pair's routing weight, stored per pair
   [T*k, H]; the sum over a token's k pairs is one reduction.

Blocks past the last expert's run exit at once, so a decode step pays a launch over the worst
case only. Accumulation is float32; the intermediate and the pair outputs are rounded to x's
dtype (as transformers' bf16 experts round theirs).

A decode step with a few tokens (T*k <= ``SMALL_PAIRS``) takes ``gemv_experts`` instead: one
block-aligned GEMM tile per expert would pad each pair to BLOCK_M rows and give too few programs
to fill the SMs (one token reads Qwen3-30B-A3B's 8 experts at ~30% of an H100's bandwidth there),
so each (pair, N tile) is its own matrix-vector program and no alignment runs. Its intermediate is
rounded to x's dtype as above; its pair outputs stay float32 until the sum over k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_reference import ACTIVATIONS, align_reference

ONE_PROGRAM_PAIRS = 4096
SMALL_PAIRS = 64  # token-expert pairs up to which ``fused_experts`` takes the few-token (GEMV) path
PATHS = ("auto", "grouped", "gemv")


@triton.jit
def _align_kernel(ids_ptr, slot_pair_ptr, block_expert_ptr, n_pairs, n_slots, n_blocks,
                  E: tl.constexpr, EP: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  FILL: tl.constexpr, BLOCKS: tl.constexpr):
    experts = tl.arange(0, EP)
    counts = tl.zeros([EP], dtype=tl.int32)
    for start in range(0, n_pairs, CHUNK):  # pass 1: pairs per expert
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < n_pairs, other=EP)  # EP matches no expert
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    for s in range(0, n_slots, FILL):  # every slot padding until pass 2 writes the pairs
        offs = s + tl.arange(0, FILL)
        tl.store(slot_pair_ptr + offs, tl.full([FILL], 0, tl.int32) + n_pairs, mask=offs < n_slots)
    for b in range(0, n_blocks, BLOCKS):  # a block's expert: the first whose padded run ends past it
        blk = b + tl.arange(0, BLOCKS)
        idx = tl.sum((ends[None, :] <= (blk * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blk, tl.where(idx < E, idx, -1), mask=blk < n_blocks)
    tl.debug_barrier()  # the padding fill lands before the pairs overwrite it
    running = ends - padded  # each expert's next free slot
    for start in range(0, n_pairs, CHUNK):  # pass 2: each pair to its slot, in pair order per expert
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < n_pairs, other=EP)
        hit = (e[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit  # earlier pairs of the same expert in this chunk
        dest = tl.sum(hit * (running[None, :] + before), axis=1)
        tl.store(slot_pair_ptr + dest, offs, mask=offs < n_pairs)
        running += tl.sum(hit, axis=0)


@triton.jit
def _block_rows(slot_pair_ptr, block_expert_ptr, n_pairs, BLOCK_M: tl.constexpr):
    """The grouped kernels' routing prologue: this program's block of slots (axis 0) -> (its expert,
    -1 past the last run; its slots; the pair in each slot; which slots hold a pair, not padding)."""
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slot_pair_ptr + rows)
    return e, rows, pair, pair < n_pairs


@triton.jit
def _activate(gate, up, alpha, limit, ACT: tl.constexpr):
    """``moe_reference.gated_activation`` on float32 tiles."""
    if ACT == "silu":
        h = gate * tl.sigmoid(gate) * up
    else:  # swiglu_clamped (gpt-oss)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = (up + 1) * (gate * tl.sigmoid(gate * alpha))
    return h


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, b_ptr, out_ptr, slot_pair_ptr, block_expert_ptr, n_pairs, H, I,
                    stride_xm, stride_we, stride_wn, stride_be, stride_om, alpha, limit,
                    TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e, rows, pair, valid = _block_rows(slot_pair_ptr, block_expert_ptr, n_pairs, BLOCK_M)
    if e < 0:
        return
    tok = (pair // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok_n = cols < I
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + ks[None, :]
    g_ptrs = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BK, BN]: gate rows
    u_ptrs = g_ptrs + I * stride_wn  # the up rows
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ok_k = ks < H - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & ok_k[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=ok_k[:, None] & ok_n[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=ok_k[:, None] & ok_n[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + e * stride_be + cols, mask=ok_n, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + e * stride_be + I + cols, mask=ok_n, other=0.0).to(tl.float32)[None, :]
    h = _activate(acc_g, acc_u, alpha, limit, ACT)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & ok_n[None, :])


@triton.jit
def _down_kernel(a_ptr, w_ptr, b_ptr, out_ptr, slot_pair_ptr, block_expert_ptr, weight_ptr, n_pairs, H, I,
                 stride_am, stride_we, stride_wn, stride_be, stride_om,
                 HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e, rows, pair, valid = _block_rows(slot_pair_ptr, block_expert_ptr, n_pairs, BLOCK_M)
    if e < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok_n = cols < H
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    w_ptrs = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ok_k = ks < I - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & ok_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=ok_k[:, None] & ok_n[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * stride_be + cols, mask=ok_n, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & ok_n[None, :])



# ---- the few-token path: one program per (token-expert pair, N tile), no alignment


@triton.jit
def _gemv_gate_up_kernel(x_ptr, w_ptr, b_ptr, out_ptr, ids_ptr, H, I, stride_xm, stride_we, stride_wn, stride_be,
                         stride_om, alpha, limit, TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    tok = (pair // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok_n = cols < I
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok * stride_xm + ks
    g_ptrs = w_ptr + e * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]  # [BN, BK]: gate rows
    u_ptrs = g_ptrs + I * stride_wn  # the up rows
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # reduced over K once, after the loop
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ok_k = ks < H - k0
        a = tl.load(x_ptrs, mask=ok_k, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(g_ptrs, mask=ok_n[:, None] & ok_k[None, :], other=0.0).to(tl.float32) * a
        acc_u += tl.load(u_ptrs, mask=ok_n[:, None] & ok_k[None, :], other=0.0).to(tl.float32) * a
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if HAS_BIAS:
        gate += tl.load(b_ptr + e * stride_be + cols, mask=ok_n, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + e * stride_be + I + cols, mask=ok_n, other=0.0).to(tl.float32)
    h = _activate(gate, up, alpha, limit, ACT)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols, h.to(out_ptr.dtype.element_ty), mask=ok_n)


@triton.jit
def _gemv_down_kernel(a_ptr, w_ptr, b_ptr, out_ptr, ids_ptr, weight_ptr, H, I, stride_am, stride_we, stride_wn,
                      stride_be, stride_os, stride_om, SPLIT_LEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Axis 2 splits I into chunks of SPLIT_LEN (a multiple of BLOCK_K): each writes its float32
    partial sum to its own plane of ``out`` [splits, pairs, H], summed afterwards in a fixed order
    (deterministic, unlike atomics). The bias joins the first chunk's partial."""
    pair = tl.program_id(0)
    split = tl.program_id(2)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok_n = cols < H
    ks = tl.arange(0, BLOCK_K)
    k_start = split * SPLIT_LEN
    a_ptrs = a_ptr + pair.to(tl.int64) * stride_am + k_start + ks
    w_ptrs = w_ptr + e * stride_we + cols[:, None].to(tl.int64) * stride_wn + k_start + ks[None, :]  # [BN, BK]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, SPLIT_LEN, BLOCK_K):
        ok_k = ks < I - k_start - k0
        a = tl.load(a_ptrs, mask=ok_k, other=0.0).to(tl.float32)[None, :]
        acc += tl.load(w_ptrs, mask=ok_n[:, None] & ok_k[None, :], other=0.0).to(tl.float32) * a
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        first = (cols * 0 + split) == 0  # a tensor mask: the interpreter takes no scalar in it
        y += tl.load(b_ptr + e * stride_be + cols, mask=ok_n & first, other=0.0).to(tl.float32)
    y *= tl.load(weight_ptr + pair).to(tl.float32)
    tl.store(out_ptr + split * stride_os + pair.to(tl.int64) * stride_om + cols, y, mask=ok_n)


def block_config(n_pairs: int, num_experts: int) -> dict:
    """Tile sizes from the mean pairs per expert (static for a batch size: graph-safe): BLOCK_M,
    and (BLOCK_N, BLOCK_K, num_warps) of each GEMM. Few pairs per expert (decode): 16-row blocks
    and narrow gate_up tiles (each loads a gate and an up tile), many programs streaming weights."""
    per_expert = n_pairs / num_experts
    if per_expert <= 16:
        return dict(BLOCK_M=16, gate_up=(32, 128, 4), down=(64, 128, 4))
    if per_expert <= 64:
        return dict(BLOCK_M=32, gate_up=(64, 64, 4), down=(64, 64, 4))
    return dict(BLOCK_M=64, gate_up=(64, 64, 8), down=(128, 64, 8))


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair of each slot, int32 [P]; expert of each block of ``block_m`` slots, int32 [P // block_m]):
    as ``moe_reference.align_reference``, computed on the device without a host sync."""
    n = ids.numel()
    if n > ONE_PROGRAM_PAIRS:
        return align_reference(ids, num_experts, block_m)
    size = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    slot_pair = torch.empty(size, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    ep = triton.next_power_of_2(num_experts)
    wide = max(16, 8192 // ep)  # rows of the [rows, EP] tiles a step compares: 8K elements
    _align_kernel[(1,)](ids.reshape(-1).to(torch.int32), slot_pair, block_expert, n, size, size // block_m,
                        E=num_experts, EP=ep, BLOCK_M=block_m, CHUNK=max(16, min(triton.next_power_of_2(n), wide)),
                        FILL=1024, BLOCKS=wide, num_warps=8)
    return slot_pair, block_expert


def gate_up(x, gate_up_w, slot_pair, block_expert, top_k: int, activation: str = "silu", bias=None,
            alpha: float = 1.702, limit: float = 7.0, config: dict | None = None) -> torch.Tensor:
    """[P, I] in x's dtype: each slot's token through its expert's gate/up rows and the activation
    (rows of padding slots are left unspecified)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: use one of {ACTIVATIONS}")
    cfg = config or block_config(x.shape[0] * top_k, gate_up_w.shape[0])
    bm = slot_pair.numel() // block_expert.numel()  # the alignment's block: the GEMM's BLOCK_M
    x = x.contiguous()
    w = gate_up_w if gate_up_w.stride(-1) == 1 else gate_up_w.contiguous()
    e, two_i, h = w.shape
    inter = two_i // 2
    out = torch.empty(slot_pair.numel(), inter, dtype=x.dtype, device=x.device)
    bn, bk, warps = cfg["gate_up"]
    grid = (block_expert.numel(), triton.cdiv(inter, bn))
    _gate_up_kernel[grid](x, w, bias if bias is not None else w, out, slot_pair, block_expert,
                          x.shape[0] * top_k, h, inter, x.stride(0), w.stride(0), w.stride(1),
                          bias.stride(0) if bias is not None else 0, out.stride(0), float(alpha), float(limit),
                          TOP_K=top_k, ACT=activation, HAS_BIAS=bias is not None, PRECISION=_precision(x),
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out


def down(inter, down_w, slot_pair, block_expert, weights, bias=None, config: dict | None = None) -> torch.Tensor:
    """[T*k, H] in inter's dtype: each pair's intermediate through its expert's down projection,
    times its routing weight (``weights`` [T, k])."""
    n = weights.numel()
    cfg = config or block_config(n, down_w.shape[0])
    bm = slot_pair.numel() // block_expert.numel()
    w = down_w if down_w.stride(-1) == 1 else down_w.contiguous()
    e, h, i = w.shape
    out = torch.empty(n, h, dtype=inter.dtype, device=inter.device)
    bn, bk, warps = cfg["down"]
    grid = (block_expert.numel(), triton.cdiv(h, bn))
    _down_kernel[grid](inter, w, bias if bias is not None else w, out, slot_pair, block_expert,
                       weights.reshape(-1).contiguous(), n, h, i, inter.stride(0), w.stride(0), w.stride(1),
                       bias.stride(0) if bias is not None else 0, out.stride(0),
                       HAS_BIAS=bias is not None, PRECISION=_precision(inter),
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # float32 exact; half types ignore it


def gemv_config(n_pairs: int, hidden: int, inter: int, programs: int = 512) -> dict:
    """Tiles of the few-token path: (BLOCK_N, BLOCK_K, num_warps) of gate_up and (BLOCK_N, BLOCK_K,
    num_warps, splits of I) of down, the widest N tiles (then splits of down's K) that still give
    about ``programs`` programs, so a decode step's few pairs stream their experts from every SM.
    gate_up's K is never split: its activation needs the whole sum, so narrow N tiles (down to 8
    rows of gate and 8 of up) give it its programs instead."""
    def tiles(n):
        return next((bn for bn in (32, 16) if n_pairs * triton.cdiv(n, bn) >= programs), 8)

    bk_gu = max(16, min(128, triton.next_power_of_2(hidden)))
    bk_dn = max(16, min(128, triton.next_power_of_2(inter)))
    bn_dn = tiles(hidden)
    splits = max(1, min(triton.cdiv(programs, n_pairs * triton.cdiv(hidden, bn_dn)), triton.cdiv(inter, bk_dn)))
    return dict(gate_up=(tiles(inter), bk_gu, 4), down=(bn_dn, bk_dn, 4, splits))


def gemv_experts(x: torch.Tensor, gate_up_w: torch.Tensor, down_w: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor, activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0,
                 config: dict | None = None) -> torch.Tensor:
    """``fused_experts`` for a few tokens: a matrix-vector product per (token-expert pair, N tile),
    without the alignment or the padding of pairs to a GEMM block; the activation fused into
    gate_up, the routing weight (and bias) into down, down's K optionally split with float32
    partials. Each pair reads its expert's weights itself, so it suits T*k up to ~``SMALL_PAIRS``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: use one of {ACTIVATIONS}")
    t, k = ids.shape
    n = t * k
    x = x.contiguous()
    gu = gate_up_w if gate_up_w.stride(-1) == 1 else gate_up_w.contiguous()
    dn = down_w if down_w.stride(-1) == 1 else down_w.contiguous()
    e, two_i, h = gu.shape
    i = two_i // 2
    cfg = config or gemv_config(n, h, i)
    flat_ids = ids.reshape(-1).contiguous()
    inter = torch.empty(n, i, dtype=x.dtype, device=x.device)
    bn, bk, warps = cfg["gate_up"]
    _gemv_gate_up_kernel[(n, triton.cdiv(i, bn))](
        x, gu, gate_up_bias if gate_up_bias is not None else gu, inter, flat_ids, h, i, x.stride(0), gu.stride(0),
        gu.stride(1), gate_up_bias.stride(0) if gate_up_bias is not None else 0, inter.stride(0), float(alpha),
        float(limit), TOP_K=k, ACT=activation, HAS_BIAS=gate_up_bias is not None, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps)
    bn, bk, warps, splits = cfg["down"]
    split_len = triton.cdiv(triton.cdiv(i, splits), bk) * bk
    splits = triton.cdiv(i, split_len)
    part = torch.empty(splits, n, h, dtype=torch.float32, device=x.device)
    _gemv_down_kernel[(n, triton.cdiv(h, bn), splits)](
        inter, dn, down_bias if down_bias is not None else dn, part, flat_ids, weights.reshape(-1).contiguous(), h, i,
        inter.stride(0), dn.stride(0), dn.stride(1), down_bias.stride(0) if down_bias is not None else 0,
        part.stride(0), part.stride(1), SPLIT_LEN=split_len, HAS_BIAS=down_bias is not None, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=warps)
    return part.view(splits, t, k, h).sum((0, 2)).to(x.dtype)  # float32 over the splits and the k pairs, one rounding


def fused_experts(x: torch.Tensor, gate_up_w: torch.Tensor, down_w: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0,
                  config: dict | None = None, path: str = "auto") -> torch.Tensor:
    """x [T, H] through its routed experts (``ids``/``weights`` [T, k]): what
    ``moe_reference.experts_reference`` computes. ``path``: ``grouped`` (align, then the two grouped
    GEMMs: three launches plus the sum over k), ``gemv`` (``gemv_experts``: two launches plus the
    sum) or ``auto``: gemv at T*k <= ``SMALL_PAIRS``, where the grouped GEMM's padded blocks leave
    most SMs idle. T is static per captured batch size, so the choice is graph-safe. ``config``:
    the chosen path's tiles (``block_config`` or ``gemv_config``)."""
    t, k = ids.shape
    if t == 0:
        return torch.zeros_like(x)
    if path not in PATHS:
        raise ValueError(f"path={path!r}: use one of {PATHS}")
    if path == "gemv" or (path == "auto" and t * k <= SMALL_PAIRS):
        return gemv_experts(x, gate_up_w, down_w, weights, ids, activation, gate_up_bias, down_bias, alpha, limit,
                            config)
    cfg = config or block_config(t * k, gate_up_w.shape[0])
    slot_pair, block_expert = align(ids, gate_up_w.shape[0], cfg["BLOCK_M"])
    inter = gate_up(x, gate_up_w, slot_pair, block_expert, k, activation, gate_up_bias, alpha, limit, cfg)
    pairs = down(inter, down_w, slot_pair, block_expert, weights, down_bias, cfg)
    return pairs.view(t, k, x.shape[1]).sum(1)  # accumulated in float32 for half types, one rounding

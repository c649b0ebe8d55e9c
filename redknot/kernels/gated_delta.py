"""The gated delta rule (Gated DeltaNet's linear attention) and its short causal convolution, in
torch: the reference the model runs on the CPU, and the one the CUDA kernels are tested against.

Per value head, with a state S [Dk, Dv] carried from token to token:

    S <- exp(g_t) * S                          (gated decay, g_t <= 0)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T  (delta rule: write the part of v_t S does not predict)
    o_t = S^T q_t

q and k are L2-normalised (``use_qk_l2norm``) and q is scaled by ``scale`` (Dk^-0.5). With more
value heads than key heads, each key head serves a consecutive group of value heads.

``recurrent_gated_delta_rule`` is that loop, token by token (decode: one token per sequence);
``chunk_gated_delta_rule`` computes the same thing a chunk at a time (prefill): within a chunk the
delta updates form a unit lower-triangular system solved once, and the state is carried between
chunks. Both work in float32 (float64 inputs stay float64) and take padded batches [B, T, ...];
``varlen_gated_delta_rule`` runs packed variable-length rows through the chunked form. Trailing
padding (k = v = q = 0, beta = 0, g = 0) leaves the state unchanged, which is how sequences of
different lengths share one padded batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """Inputs in the working dtype ([B, HV, T, ...] layout), q/k expanded to the value heads,
    normalised and scaled."""
    work = torch.float64 if v.dtype == torch.float64 else torch.float32
    hv, hk = v.shape[2], k.shape[2]
    if hv != hk:
        q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    q, k, v, g, beta = (x.transpose(1, 2).to(work) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta, work


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, scale=None, use_qk_l2norm=True):
    """Token by token. q, k [B, T, H, Dk]; v [B, T, HV, Dv]; g, beta [B, T, HV]; initial_state
    [B, HV, Dk, Dv] (None: zeros). Returns (o [B, T, HV, Dv] in v's dtype, final state [B, HV, Dk, Dv]
    in the working dtype)."""
    q, k, v, g, beta, work = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    B, HV, T, dk = k.shape
    state = (torch.zeros(B, HV, dk, v.shape[-1], dtype=work, device=v.device) if initial_state is None
             else initial_state.to(work))
    out = []
    for t in range(T):
        state = state * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        delta = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", state, kt))
        state = state + kt[..., :, None] * delta[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    o = torch.stack(out, dim=2) if out else v.new_zeros(v.shape, dtype=work)
    return o.transpose(1, 2).to(v.dtype), state


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, scale=None, use_qk_l2norm=True,
                           chunk_size: int = 64):
    """The same as ``recurrent_gated_delta_rule``, a chunk of ``chunk_size`` tokens at a time.

    Within a chunk, with G_t the decay accumulated since the chunk's start and S0 the state before
    it, the delta terms u_t = beta_t (v_t - S_{t-1}^T k_t) satisfy
        u_t + beta_t sum_{s<t} exp(G_t - G_s) (k_t . k_s) u_s = beta_t (v_t - exp(G_t) S0^T k_t),
    a unit lower-triangular system; then o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s
    and the next chunk starts from exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T."""
    q, k, v, g, beta, work = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    B, HV, T, dk = k.shape
    dv = v.shape[-1]
    state = (torch.zeros(B, HV, dk, dv, dtype=work, device=v.device) if initial_state is None
             else initial_state.to(work))
    pad = (-T) % chunk_size
    if pad:  # trailing padding that leaves the state as it is (beta = 0, g = 0)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk_size
    q, k, v = (x.reshape(B, HV, n, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(B, HV, n, chunk_size) for x in (g, beta))
    cum = g.cumsum(-1)  # G_t within each chunk
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # exp(G_t - G_s), s <= t
    kk = (k @ k.transpose(-1, -2)) * decay
    system = torch.eye(chunk_size, dtype=work, device=v.device) + beta[..., None] * kk.tril(-1)
    # u = system^-1 (beta v) - system^-1 (beta exp(G) k) S0: both solves once for every chunk
    rhs = torch.cat((beta[..., None] * v, (beta * cum.exp())[..., None] * k), dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_v, u_k = sol[..., :dv], sol[..., dv:]
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()
    out = torch.empty_like(v)
    for i in range(n):
        u = u_v[:, :, i] - u_k[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + qk[:, :, i] @ u
        state = state * chunk_decay[:, :, i, None, None] + k_to_end[:, :, i].transpose(-1, -2) @ u
    o = out.reshape(B, HV, n * chunk_size, dv)[:, :, :T]
    return o.transpose(1, 2).to(v.dtype), state


def pad_rows(x: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
    """Packed rows [T, ...] of B sequences (``cu_seqlens`` [B+1]) as a zero-padded batch [B, max_len, ...]."""
    B = cu_seqlens.numel() - 1
    seq, local = row_coordinates(cu_seqlens, x.shape[0])
    out = x.new_zeros((B * max_len,) + tuple(x.shape[1:]))
    out.index_copy_(0, seq * max_len + local, x)
    return out.view((B, max_len) + tuple(x.shape[1:]))


def row_coordinates(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, index within it) of each packed row, computed on the device (no host sync)."""
    rows = torch.arange(total, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)
    return seq, rows - cu_seqlens.long()[seq]


def varlen_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, max_len: int, scale=None,
                            use_qk_l2norm=True):
    """Packed rows of B sequences: q, k [T, H, Dk], v [T, HV, Dv], g, beta [T, HV], initial_state
    [B, HV, Dk, Dv], ``cu_seqlens`` [B+1] (device), ``max_len`` the longest (host). Returns (o
    [T, HV, Dv], final states [B, HV, Dk, Dv]). One token per sequence takes the recurrent form."""
    if max_len == 1 and q.shape[0] == cu_seqlens.numel() - 1:
        o, state = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                              initial_state, scale, use_qk_l2norm)
        return o[:, 0], state
    padded = [pad_rows(x, cu_seqlens, max_len) for x in (q, k, v, g, beta)]
    chunk = min(64, 1 << (max_len - 1).bit_length())  # short rows (chunked prefill steps): a small chunk
    o, state = chunk_gated_delta_rule(*padded, initial_state=initial_state, scale=scale,
                                      use_qk_l2norm=use_qk_l2norm, chunk_size=chunk)
    seq, local = row_coordinates(cu_seqlens, q.shape[0])
    return o.reshape((-1,) + tuple(o.shape[2:]))[seq * max_len + local], state


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution (SiLU after it) over packed rows of B sequences, each
    continuing from its state: x [T, C], weight [C, W], conv_state [B, C, W-1] (the sequence's last
    W-1 inputs, zeros for a fresh one). Returns (out [T, C], the new states [B, C, W-1]). Vectorised
    over sequences: every sequence's state rows are laid before its inputs in one buffer."""
    T, C = x.shape
    B, width = conv_state.shape[0], weight.shape[1]
    hist = width - 1
    seq, _ = row_coordinates(cu_seqlens, T)
    rows = torch.arange(T, device=x.device) + (seq + 1) * hist  # each row's place in the buffer
    starts = cu_seqlens[:-1].long() + torch.arange(B, device=x.device) * hist  # where each state goes
    state_rows = (starts[:, None] + torch.arange(hist, device=x.device)).reshape(-1)
    buf = x.new_zeros(T + B * hist, C, dtype=weight.dtype)
    buf.index_copy_(0, state_rows, conv_state.transpose(1, 2).reshape(-1, C).to(weight.dtype))
    buf.index_copy_(0, rows, x.to(weight.dtype))
    out = buf[rows - hist] * weight[:, 0]
    for j in range(1, width):  # one shifted gather per tap: no [T, W, C] buffer
        out = out + buf[rows - hist + j] * weight[:, j]
    ends = cu_seqlens[1:].long() + torch.arange(1, B + 1, device=x.device) * hist
    new_state = buf[ends[:, None] - hist + torch.arange(hist, device=x.device)]  # [B, W-1, C]
    return F.silu(out).to(x.dtype), new_state.transpose(1, 2).to(conv_state.dtype)


# ---------------------------------------------------------------- a chunk as an affine map of the state
#
# Per value head the recurrence is affine in the state: S_t = M_t S_{t-1} + beta_t k_t v_t^T with
# M_t = exp(g_t) (I - beta_t k_t k_t^T). Over a chunk of tokens, whatever state S_in comes before it,
# the state after it is A S_in + S_own, where A = M_T ... M_1 is the chunk's transition and S_own the
# state the chunk reaches from zero. With beta in [0, 1] (a sigmoid) and |k| <= 1 (L2-normalised),
# I - beta k k^T is symmetric with eigenvalues in [0, 1], so |A S_in| <= exp(sum g) |S_in|: a chunk
# whose decay exp(sum g) is tiny forgets what came before it.

def chunk_transition(k, v, g, beta, use_qk_l2norm: bool = True):
    """One chunk's effect on the state: k [T, H, Dk], v [T, HV, Dv], g, beta [T, HV] (the
    convolution's output and the per-token gates, as the rule takes them). Returns (transition A
    [HV, Dk, Dk], own state S_own [HV, Dk, Dv], log decay sum(g) [HV]) in the working dtype. One run
    of the chunked rule over values widened by Dk zero columns, from the state [I | 0]: those columns
    carry A = M_T ... M_1 I, the others S_own."""
    T, hv, dv = v.shape
    dk = k.shape[-1]
    work = torch.float64 if v.dtype == torch.float64 else torch.float32
    wide = torch.cat((v.new_zeros(T, hv, dk), v), dim=-1)
    eye = torch.eye(dk, dtype=work, device=v.device).expand(1, hv, dk, dk)
    start = torch.cat((eye, eye.new_zeros(1, hv, dk, dv)), dim=-1)
    chunk = min(64, 1 << max(T - 1, 0).bit_length())
    _, state = chunk_gated_delta_rule(k[None], k[None], wide[None], g[None], beta[None], initial_state=start,
                                      use_qk_l2norm=use_qk_l2norm, chunk_size=chunk)
    return state[0, :, :, :dk], state[0, :, :, dk:], g.to(work).sum(0)


def compose_state(state, transition, own, log_decay, threshold: float):
    """The state after a chunk placed after ``state`` [..., HV, Dk, Dv]: ``transition @ state + own``
    per value head (exact), except heads whose decay exp(log_decay) is at most ``threshold``: ``own``
    alone, the carried part (at most exp(log_decay) |state| in norm) dropped. Returns (the state,
    composed bool [..., HV]: the heads that applied the transition)."""
    composed = log_decay > math.log(threshold) if threshold > 0 else torch.ones_like(log_decay, dtype=torch.bool)
    out = own.clone()
    heads = composed.nonzero(as_tuple=True)  # only these pay the product (2 Dk^2 Dv FLOPs each)
    out[heads] += transition[heads] @ state[heads].to(transition.dtype)
    return out, composed

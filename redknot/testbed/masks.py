"""The attention rule of a packed batch (query q sees key k iff k is not after q, both are in one
group, and k is context or in q's own QA block), as a FlexAttention ``mask_mod``, a dense SDPA mask
and a FlexAttention block mask. FlexAttention (CUDA) skips the blocks between a row's contexts and
QA blocks; masked SDPA (CPU) computes every pair of a row."""

from __future__ import annotations

import torch


def visibility(seg: torch.Tensor, qa: torch.Tensor):
    """The one attention rule of a packed batch, as a FlexAttention ``mask_mod``: query q sees key k
    iff k is not after q, both are in the same group, and k is context or in q's own QA block.
    Padding (seg -1, qa 0) sees earlier padding, so no query is left with nothing to attend to."""

    def mask_mod(b, h, q, k):
        return (q >= k) & (seg[b, q] == seg[b, k]) & ((qa[b, k] == 0) | (qa[b, q] == qa[b, k]))

    return mask_mod


def dense_mask(seg: torch.Tensor, qa: torch.Tensor) -> torch.Tensor:
    """``visibility`` materialised for SDPA: [B, 1, L, L] bool, True = attend."""
    B, L = seg.shape
    i = torch.arange(L, device=seg.device)
    b = torch.arange(B, device=seg.device)[:, None, None]
    return visibility(seg, qa)(b, None, i[None, :, None], i[None, None, :])[:, None]


def block_mask(seg: torch.Tensor, qa: torch.Tensor, block: int = 128):
    """``visibility`` as a FlexAttention BlockMask, built from the rows' structure at block level:
    blocks that no query sees are skipped, blocks that every query sees entirely run without the
    mask, the rest apply ``visibility`` per pair. Sound by construction (a block holding a visible
    pair is never skipped; "full" is only claimed when every pair is visible); it may leave a
    full block marked partial, which costs time, not correctness.

    Not ``create_block_mask``: compiled (``_compile=True``) it does not get through ``ptxas`` on an
    H200 (torch 2.11, triton 3.6); eager it evaluates every (query, key) pair, ~12 ms for 3 rows of
    8,832 tokens."""
    from torch.nn.attention.flex_attention import BlockMask

    B, L = seg.shape
    if L % block:
        raise ValueError(f"row length {L} is not a multiple of the {block}-token block")
    nb = L // block
    # padding (-1, at the end of a row) sees only padding: as one more group after the others
    s = torch.where(seg < 0, torch.iinfo(torch.int32).max, seg).view(B, nb, block)
    a = qa.view(B, nb, block)
    s_lo, s_hi, a_lo, a_hi = s.amin(-1), s.amax(-1), a.amin(-1), a.amax(-1)  # [B, nb] per block
    i = torch.arange(nb, device=seg.device)

    def pairs(lo, hi):  # per (q block, kv block): value ranges overlap; both hold one and the same value
        one = lo == hi
        return ((lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None]),
                one[:, :, None] & one[:, None, :] & (lo[:, :, None] == lo[:, None, :]))

    (group_meet, one_group), (qa_meet, one_qa) = pairs(s_lo, s_hi), pairs(a_lo, a_hi)
    # a visible pair needs a key not after the query, a shared group and a context key or a shared QA block
    meet = (i[None, :] <= i[:, None])[None] & group_meet & ((a_lo == 0)[:, None, :] | qa_meet)
    # every pair visible: all keys before all queries, one group, and context keys or one QA block
    full = (i[None, :] < i[:, None])[None] & one_group & ((a_hi == 0)[:, None, :] | one_qa)
    partial = meet & ~full

    def indices(m):  # [B, nb, nb] bool -> counts [B, 1, nb], the True columns first [B, 1, nb, nb]
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)
        return m.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(*indices(partial), *indices(full), BLOCK_SIZE=block,
                                    mask_mod=visibility(seg, qa), seq_lengths=(L, L))


def attention_mask(seg, qa, attn: str):
    return block_mask(seg, qa) if attn == "flex" else dense_mask(seg, qa)

"""Latent attention kernels (DeepSeek MLA) over pool pages: the torch reference against a dense
float64 oracle, the CPU decode layout and the Triton decode (interpreter on a CPU) against the
reference, on random shapes with per-query-head windows and sinks and pages a head no longer keeps."""

import os

import pytest
import torch

from redknot.kernels.mla_reference import mla_attention_ref, mla_decode_masked
from redknot.kernels.reference import decode_layout
from redknot.visibility import GLOBAL_WINDOW, visibility_mask

ROPE, RANK = 16, 32
W = (ROPE + RANK) // 2


def _pool(lens, page_size, n_pages=48, seed=0, dropped=()):
    """Random K/V halves and block tables [B, 1, P] for sequences of ``lens`` (pages ``dropped``
    (sequence, logical page) not stored)."""
    g = torch.Generator().manual_seed(seed)
    kp, vp = torch.randn(n_pages, page_size, W, generator=g), torch.randn(n_pages, page_size, W, generator=g)
    pages = max(-(-n // page_size) for n in lens) + 1
    bt = torch.full((len(lens), 1, pages), -1, dtype=torch.int32)
    free = torch.randperm(n_pages, generator=g).tolist()
    for b, n in enumerate(lens):
        for lp in range(-(-n // page_size)):
            bt[b, 0, lp] = free.pop()
    for b, lp in dropped:
        bt[b, 0, lp] = -1
    return kp, vp, bt


def _dense_oracle(q, q_pos, kp, vp, table, n, window, sink, scale):
    """float64, one sequence: rows gathered one position at a time, an explicit mask per head."""
    ps = kp.shape[1]
    rows, stored = [], []
    for j in range(n):
        phys = int(table[j // ps])
        stored.append(phys >= 0)
        rows.append(torch.cat([kp[phys, j % ps], vp[phys, j % ps]]).double() if phys >= 0
                    else torch.zeros(2 * W, dtype=torch.float64))
    rows, stored = torch.stack(rows), torch.tensor(stored)
    out = torch.zeros(q.shape[0], q.shape[1], RANK, dtype=torch.float64)
    for h in range(q.shape[1]):
        mask = visibility_mask(q_pos, torch.arange(n), int(window[h]), int(sink[h])) & stored[None]
        s = (q[:, h].double() @ rows.T * scale).masked_fill(~mask, float("-inf"))
        p = torch.nan_to_num(s.softmax(-1), nan=0.0)
        out[:, h] = p @ rows[:, ROPE:]
    return out


WINDOW = torch.tensor([GLOBAL_WINDOW, 9, 20, GLOBAL_WINDOW, 3], dtype=torch.int32)
SINK = torch.tensor([0, 4, 17, 0, 2], dtype=torch.int32)


@pytest.mark.parametrize("page_size", [8, 16])
def test_reference_equals_a_dense_oracle_with_explicit_positions(page_size):
    lens = [37, 70]
    kp, vp, bt = _pool(lens, page_size, dropped=[(1, 1)])
    g = torch.Generator().manual_seed(1)
    q_pos = [torch.tensor([0, 5, 6, 30, 36]), torch.tensor([3, 40, 41, 60, 69])]
    q = torch.randn(10, 5, 2 * W, generator=g)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    out = mla_attention_ref(q, kp, vp, bt, cu, torch.tensor(lens), WINDOW, SINK, 0.2, ROPE, q_pos=torch.cat(q_pos),
                            block_elems=64)  # a few query rows per block
    for b in range(2):
        ref = _dense_oracle(q[5 * b:5 * b + 5], q_pos[b], kp, vp, bt[b, 0], lens[b], WINDOW, SINK, 0.2)
        torch.testing.assert_close(out[5 * b:5 * b + 5].double(), ref, rtol=1e-5, atol=1e-5)


def test_cpu_decode_layout_equals_the_reference():
    lens, ps = [37, 5, 70], 16
    kp, vp, bt = _pool(lens, ps, dropped=[(2, 1)])
    q = torch.randn(3, 5, 2 * W, generator=torch.Generator().manual_seed(2))
    seq = torch.tensor(lens, dtype=torch.int32)
    lay = decode_layout(bt[None], seq, WINDOW[None], SINK[None], ps, max(lens))
    out = mla_decode_masked(q, kp, vp, lay["pages"][0], lay["bias"][0], 0.3, ROPE)
    ref = mla_attention_ref(q, kp, vp, bt, torch.arange(4, dtype=torch.int32), seq, WINDOW, SINK, 0.3, ROPE)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(os.environ.get("REDKNOT_TEST_DEVICE", "cpu") != "cpu" and not torch.cuda.is_available(),
                    reason="needs triton's interpreter or a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n,tiles_per_split", [(16, 1), (16, 3), (32, None)])
def test_triton_decode_equals_the_reference(dtype, block_n, tiles_per_split):
    pytest.importorskip("triton")
    from redknot.kernels.mla_decode import mla_decode

    dev = "cuda" if os.environ.get("REDKNOT_TEST_DEVICE") == "cuda" else "cpu"
    lens, ps = [37, 5, 70, 1], 16
    kp, vp, bt = _pool(lens, ps, dropped=[(2, 1)])
    heads = 18  # two blocks of query heads, the second partly masked
    window = torch.cat([WINDOW, WINDOW, WINDOW, WINDOW[:3]])
    sink = torch.cat([SINK, SINK, SINK, SINK[:3]])
    q = torch.randn(4, heads, 2 * W, generator=torch.Generator().manual_seed(3))
    seq = torch.tensor(lens, dtype=torch.int32)
    kp, vp, q = kp.to(dev, dtype), vp.to(dev, dtype), q.to(dev, dtype)
    out = mla_decode(q, kp, vp, bt.to(dev), seq.to(dev), window.to(dev), sink.to(dev), 0.3, ROPE,
                     block_n=block_n, tiles_per_split=tiles_per_split)
    ref = mla_attention_ref(q.float(), kp.float(), vp.float(), bt.to(dev), torch.arange(5, dtype=torch.int32),
                            seq.to(dev), window, sink, 0.3, ROPE)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)

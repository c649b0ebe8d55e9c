"""Learned attention sinks (gpt-oss) outside the kernels: the recovery forward's attention paths,
the attention masses its policies observe, and the head profiler all put the sink logit in the
softmax denominator. The kernels' own sink tests are in test_segpaged_kernels.py."""

import os

import pytest
import torch

from redknot.kernels.reference import dense_masked_attention, softmax_with_sinks
from redknot.profile import profiler
from redknot.reuse import recovery

G = 1 << 30


def _case(n, hkv, g, d, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = recovery.kv_buffer(n, hkv, d, torch.float32, "cpu")
    values = recovery.kv_buffer(n, hkv, d, torch.float32, "cpu")
    keys.copy_(torch.randn(n, hkv, d, generator=gen))
    values.copy_(torch.randn(n, hkv, d, generator=gen))
    q = torch.randn(n, hkv * g, d, generator=gen)
    sinks = torch.randn(hkv * g, generator=gen) * 3
    return q, keys, values, sinks


def _oracle(q, keys, values, window, sink, sinks, pos):
    """Every row of the full prefill from the dense oracle, then the rows at ``pos``."""
    return dense_masked_attention(q, keys, values, window, sink, sink_logits=sinks)[pos]


def test_softmax_with_sinks_is_the_eager_formula():
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64)
    s[0, 1, :] = float("-inf")  # a row that sees nothing: all mass on the sink
    sinks = torch.randn(3, 1, 1, generator=gen, dtype=torch.float64)
    got = softmax_with_sinks(s, sinks)
    e = torch.exp(s)
    want = e / (e.sum(-1, keepdim=True) + torch.exp(sinks))
    torch.testing.assert_close(got, want)
    assert (got[0, 1] == 0).all()


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("skip,full", [(0, [1, 1]), (0, [1, 0]), (9, [0, 1]), (40, [1, 0])])
def test_recovery_attention_with_sinks_equals_the_oracle(kernel, skip, full):
    """Sink logits take every path of the recovery attention: the causal SDPA shortcut is left for
    the masked softmax (CPU) or the SegPaged kernel, which both carry the sink."""
    if kernel == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("CPU tensors through Triton need the interpreter (TRITON_INTERPRET=1)")
    n, g, d, hkv = 96, 2, 16, len(full)
    q, keys, values, sinks = _case(n, hkv, g, d, seed=skip + sum(full))
    pos = torch.arange(skip, n)
    is_full = torch.tensor(full, dtype=torch.bool)
    window, sink = torch.where(is_full, G, 24), torch.where(is_full, 0, 4)
    out, mass = recovery._attend(q[pos], pos, keys, values, window, sink, d**-0.5, 3, full=is_full,
                                 paged=kernel == "triton", sink_logits=sinks)
    want = _oracle(q, keys, values, window, sink, sinks, pos)
    assert (out - want).abs().max() < 1e-5
    plain, _ = recovery._attend(q[pos], pos, keys, values, window, sink, d**-0.5, 0, full=is_full,
                                paged=kernel == "triton")
    assert (plain - want).abs().max() > 1e-2  # the sinks matter
    # the mass the last 3 queries give each key: the same probabilities in float64
    k64, q64 = keys.double(), q[pos][-3:].double()
    p = pos[-3:]
    want_mass = torch.zeros(n, dtype=torch.float64)
    for h in range(hkv * g):
        kv = h // g
        s = (q64[:, h] @ k64[:, kv].T) * d**-0.5
        j = torch.arange(n)[None, :]
        seen = (j <= p[:, None]) & ((j < sink[kv]) | (p[:, None] - j < window[kv]))
        want_mass += softmax_with_sinks(s.masked_fill(~seen, float("-inf")), sinks[h].double()).sum(0)
    torch.testing.assert_close(mass.double(), want_mass, atol=1e-5, rtol=1e-4)


def test_cross_chunk_mass_with_sinks_matches_a_direct_softmax():
    """With sink logits the full-context heads' mass is the materialised softmax with the sink."""
    torch.manual_seed(0)
    n, hkv, g, d = 12, 2, 2, 8
    keys, q = torch.randn(n, hkv, d), torch.randn(n, hkv * g, d)
    sinks = torch.tensor([1.5, -0.5, 0.3, 2.0])
    chunk_id = torch.tensor([-1, -1, 0, 0, 0, 1, 1, 1, 2, 2, -1, -1])
    window, sink = torch.tensor([n, 3]), torch.tensor([0, 1])  # head 0 sees everything, head 1 does not
    pos = torch.arange(n)
    got = recovery.cross_chunk_mass(q, pos, keys, window, sink, 0.5, chunk_id, sinks)
    plain = recovery.cross_chunk_mass(q, pos, keys, window, sink, 0.5, chunk_id)
    for r in range(5, 10):
        p = softmax_with_sinks(q[r, :g] @ keys[:r + 1, 0].T * 0.5, sinks[:g, None])  # KV head 0's query heads
        other = (chunk_id[:r + 1] >= 0) & (chunk_id[:r + 1] != chunk_id[r])
        torch.testing.assert_close(got[r], (p * other).sum(-1).mean())
    assert (got[5:10] < plain[5:10]).all()  # the sink takes its share


def test_profiler_attention_with_sinks():
    """The profiler's forward equals the oracle, and its coverage counts the learned sink's mass as
    kept (a local head keeps its sink logit): at the widest bucket every query is fully covered."""
    n, hkv, g, d = 80, 2, 2, 16
    q, keys, values, sinks = _case(n, hkv, g, d, seed=5)
    acc = profiler._Accumulator(hkv * g, 2, "cpu", window_error=True, sink=4, ref_window=16, page_size=64,
                                retrieval_k=4)
    out = profiler._attend(q, 0, keys, values, d**-0.5, stats=[(acc, 20)], block_elems=2000, sink_logits=sinks)
    want = dense_masked_attention(q, keys, values, [G, G], [0, 0], sink_logits=sinks)
    assert (out - want).abs().max() < 1e-5
    queries = n - 20
    assert acc.queries == queries
    torch.testing.assert_close(acc.covered[:, -1], torch.full((hkv * g,), float(queries), dtype=torch.float64))
    assert (acc.covered[:, 0] < queries).all() and (acc.edge > 0).all()


def test_selection_attention_mass_with_sinks_equals_float64():
    """The retrieval / H2O scorers' mass: each row's own sink logit in its denominator."""
    from redknot.cache.selection import attention_mass, attention_mass_ref

    gen = torch.Generator().manual_seed(7)
    r, m, n, d = 3, 4, 20, 8
    q, k = torch.randn(r, m, d, generator=gen), torch.randn(r, n, d, generator=gen)
    q_pos = torch.tensor([5, 9, 19, 19])
    visible = torch.rand(r, m, n, generator=gen) > 0.3
    sinks = torch.randn(r, m, generator=gen) * 2
    got = attention_mass(q, k, q_pos, 0.4, visible, sinks)
    torch.testing.assert_close(got.double(), attention_mass_ref(q, k, q_pos, 0.4, visible, sinks), atol=1e-5, rtol=1e-5)
    assert (got.sum(-1) < attention_mass(q, k, q_pos, 0.4, visible).sum(-1)).all()  # the sinks take their share

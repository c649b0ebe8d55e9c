"""The gated delta rule and its short convolution (kernels/gated_delta.py) against transformers'
torch implementations (float32 inside, whatever the input) and each other in float64: chunked and recurrent, grouped value heads, carried states,
packed variable-length rows, and on a GPU flash-linear-attention's kernels against them."""

import os

import pytest
import torch
import torch.nn.functional as F

from redknot.kernels import gated_delta as gd

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _inputs(B, T, H, HV, DK, DV, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, DK, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, DK, generator=g, dtype=dtype)
    v = torch.randn(B, T, HV, DV, generator=g, dtype=dtype)
    beta = torch.rand(B, T, HV, generator=g, dtype=dtype)
    decay = -torch.rand(B, T, HV, generator=g, dtype=dtype) * 2  # log decays in (-2, 0]
    h0 = torch.randn(B, HV, DK, DV, generator=g, dtype=dtype)
    return q, k, v, decay, beta, h0


@pytest.mark.parametrize("T,chunk", [(1, 64), (37, 16), (64, 64), (150, 64)])
def test_chunked_and_recurrent_equal_transformers(T, chunk):
    """transformers' functions compute in float32 whatever the input: against them at float32's
    precision; ours keep float64, where the chunked and the recurrent forms agree to 1e-10."""
    q, k, v, g, beta, h0 = _inputs(2, T, 2, 4, 8, 12)
    want, want_state = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, initial_state=h0,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_rec, want_rec_state = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                                   output_final_state=True,
                                                                   use_qk_l2norm_in_kernel=True)
    o, state = gd.chunk_gated_delta_rule(q, k, v, g, beta, h0, chunk_size=chunk)
    o_rec, state_rec = gd.recurrent_gated_delta_rule(q, k, v, g, beta, h0)
    assert o.dtype == state.dtype == torch.float64
    for got, ref in ((o, want), (state, want_state), (o_rec, want_rec), (state_rec, want_rec_state)):
        torch.testing.assert_close(got, ref.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o, o_rec, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, state_rec, rtol=1e-10, atol=1e-10)
    o32, state32 = gd.chunk_gated_delta_rule(*(x.float() for x in (q, k, v, g, beta, h0)), chunk_size=chunk)
    torch.testing.assert_close(o32, want.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state32, want_state.float(), rtol=1e-4, atol=1e-4)


def test_a_prompt_in_chunks_carries_the_state():
    q, k, v, g, beta, _ = _inputs(1, 90, 2, 4, 8, 8, seed=1)
    whole, state = gd.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)
    parts, s = [], None
    for a, b in ((0, 33), (33, 34), (34, 90)):
        o, s = gd.chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], s, chunk_size=16)
        parts.append(o)
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, state, rtol=1e-10, atol=1e-10)


def test_varlen_rows_equal_each_sequence_alone():
    lens = [5, 1, 23, 9]
    cu = torch.tensor([0] + lens).cumsum(0)
    T = sum(lens)
    q, k, v, g, beta, _ = _inputs(1, T, 2, 4, 8, 8, seed=2)
    h0 = torch.randn(len(lens), 4, 8, 8, dtype=torch.float64)
    o, states = gd.varlen_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], h0, cu, max(lens))
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        want, want_state = gd.recurrent_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                                         h0[i:i + 1])
        torch.testing.assert_close(o[a:b], want[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(states[i], want_state[0], rtol=1e-10, atol=1e-10)
    one = torch.arange(len(lens) + 1)  # one token each: the recurrent step
    o1, s1 = gd.varlen_gated_delta_rule(q[0, :4], k[0, :4], v[0, :4], g[0, :4], beta[0, :4], h0, one, 1)
    want, want_state = gd.recurrent_gated_delta_rule(q[0, :4, None], k[0, :4, None], v[0, :4, None], g[0, :4, None],
                                                     beta[0, :4, None], h0)
    torch.testing.assert_close(o1, want[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s1, want_state, rtol=1e-12, atol=1e-12)


def test_varlen_convolution_equals_transformers_conv_over_each_whole_sequence():
    """Each sequence split in two forwards (the state carried) equals the causal conv over all of it."""
    C, W = 6, 4
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(C, W, generator=gen, dtype=torch.float64)
    seqs = [torch.randn(n, C, generator=gen, dtype=torch.float64) for n in (7, 2, 12)]
    state = torch.zeros(3, C, W - 1, dtype=torch.float64)
    outs = [[] for _ in seqs]
    for cut in ((0, 1), (1, None)):  # first forward: each sequence's first row(s), then the rest
        parts = [s[cut[0]:cut[1]] for s in seqs]
        cu = torch.tensor([0] + [len(p) for p in parts]).cumsum(0)
        out, state = gd.causal_conv1d_varlen(torch.cat(parts), weight, state, cu)
        for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            outs[i].append(out[a:b])
    for i, (s, o) in enumerate(zip(seqs, outs)):
        want = hf.causal_conv1d_fn(s.t()[None], weight, None, activation="silu")[0].t()
        torch.testing.assert_close(torch.cat(o), want, rtol=1e-12, atol=1e-12)
        assert torch.equal(state[i], F.pad(s.t(), (W - 1, 0))[:, -(W - 1):])  # its last W-1 inputs


@pytest.mark.skipif(os.environ.get("REDKNOT_TEST_DEVICE", "cpu") != "cuda" or not torch.cuda.is_available(),
                    reason="flash-linear-attention's kernels need a GPU")
def test_fla_kernels_equal_the_reference_on_packed_rows():
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    lens = [300, 1, 77, 64]
    cu = torch.tensor([0] + lens).cumsum(0).cuda()
    q, k, v, g, beta, _ = (x.cuda().float() for x in _inputs(1, sum(lens), 4, 8, 128, 128, seed=4))
    h0 = torch.randn(len(lens), 8, 128, 128, device="cuda") * 0.1
    want, want_state = gd.varlen_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], h0, cu, max(lens))
    o, state = fla.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())
    torch.testing.assert_close(o[0], want, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(state, want_state, rtol=2e-3, atol=2e-3)
    B = len(lens)  # one token each of B sequences (decode); g and beta by keyword (gk is the 5th parameter)
    q1, k1, v1, g1, b1 = (x[0, :B, None].contiguous() for x in (q, k, v, g, beta))
    o, state = fla.fused_recurrent_gated_delta_rule(q1, k1, v1, g=g1, beta=b1, initial_state=h0,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    want, want_state = gd.recurrent_gated_delta_rule(q1, k1, v1, g1, b1, h0)
    torch.testing.assert_close(o, want, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(state, want_state, rtol=2e-3, atol=2e-3)

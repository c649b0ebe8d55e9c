"""A chunk of the gated delta rule as an affine map of the state (kernels/gated_delta.py), in
float64: the transition and own state equal the explicit product of the per-token maps, the
composition ``A S_in + S_own`` equals the sequential recurrence over the chunks, and heads below
the decay threshold drop the carried state with an error of at most exp(sum g) |S_in|."""

import pytest
import torch

from redknot.kernels import gated_delta as gd


def _chunk(T, H=2, HV=4, DK=8, DV=6, seed=0, decay=2.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, DK, generator=g, dtype=torch.float64)
    v = torch.randn(T, HV, DV, generator=g, dtype=torch.float64)
    beta = torch.rand(T, HV, generator=g, dtype=torch.float64)
    log_g = -torch.rand(T, HV, generator=g, dtype=torch.float64) * decay
    return k, v, log_g, beta


def _sequential(chunks, state):
    """The token-by-token rule over the chunks one after another, from ``state`` [HV, DK, DV]."""
    for k, v, g, beta in chunks:
        _, state = gd.recurrent_gated_delta_rule(k[None], k[None], v[None], g[None], beta[None], state[None])
        state = state[0]
    return state


@pytest.mark.parametrize("T", [1, 5, 64, 100])
def test_transition_is_the_product_of_the_token_maps(T):
    k, v, g, beta = _chunk(T)
    A, own, log_decay = gd.chunk_transition(k, v, g, beta)
    kn = gd.l2norm(k.repeat_interleave(2, dim=1))  # [T, HV, DK]
    want = torch.eye(8, dtype=torch.float64).repeat(4, 1, 1)
    for t in range(T):
        m = g[t].exp()[:, None, None] * (torch.eye(8, dtype=torch.float64)
                                         - beta[t][:, None, None] * kn[t][:, :, None] * kn[t][:, None, :])
        want = m @ want
    torch.testing.assert_close(A, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(own, _sequential([(k, v, g, beta)], torch.zeros(4, 8, 6, dtype=torch.float64)))
    torch.testing.assert_close(log_decay, g.sum(0))


def test_composed_chunks_equal_the_sequential_recurrence():
    chunks = [_chunk(T, seed=i) for i, T in enumerate((30, 7, 65))]
    s_in = torch.randn(4, 8, 6, dtype=torch.float64)
    state = s_in
    for c in chunks:
        state, composed = gd.compose_state(state, *gd.chunk_transition(*c), threshold=0.0)
        assert composed.all()
    torch.testing.assert_close(state, _sequential(chunks, s_in), rtol=1e-10, atol=1e-10)


def test_short_memory_heads_drop_the_carried_state_within_the_decay_bound():
    """Heads whose chunk decay is at most the threshold start from the chunk's own state: the error
    is the dropped A S_in, at most exp(sum g) |S_in| (each token's map is a contraction times its
    decay); the other heads stay exact."""
    k, v, g, beta = _chunk(12, decay=2.0)
    g[:, :2] *= 0.05  # heads 0, 1: long memory (decay ~ exp(-0.6)); heads 2, 3: ~ exp(-12)
    s_in = torch.randn(4, 8, 6, dtype=torch.float64) * 10
    A, own, log_decay = gd.chunk_transition(k, v, g, beta)
    threshold = 1e-3
    state, composed = gd.compose_state(s_in, A, own, log_decay, threshold)
    assert composed.tolist() == [True, True, False, False]
    exact = _sequential([(k, v, g, beta)], s_in)
    err = (state - exact).flatten(1).norm(dim=1)
    bound = log_decay.exp() * s_in.flatten(1).norm(dim=1)
    assert (err[:2] < 1e-10).all()
    assert (err[2:] <= bound[2:]).all() and (err[2:] > 0).all()
    assert (bound[2:] <= threshold * s_in.flatten(1).norm(dim=1)[2:]).all()

"""The reuse policies' row ranking (redknot.reuse.policies.rank_descending): a fixed tie rule that
rounding differences between devices cannot move."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from redknot.reuse.policies import rank_descending, tie_robust


def test_scores_equal_up_to_rounding_tie_and_the_later_row_wins():
    # 0.49999997 is a float32 softmax's 0.5 on some CPUs; 3e-7 and 2e-7 are noise next to 1.0
    assert rank_descending(torch.tensor([0.5, 0.49999997, 0.1])).tolist() == [1, 0, 2]
    assert rank_descending(torch.tensor([0.49999997, 0.5, 0.1])).tolist() == [1, 0, 2]
    assert rank_descending(torch.tensor([3e-7, 2e-7, 1.0])).tolist() == [2, 1, 0]


def test_scores_apart_by_more_than_the_grid_rank_by_value():
    assert rank_descending(torch.tensor([0.5, 0.4999, 0.1])).tolist() == [0, 1, 2]
    assert rank_descending(torch.tensor([2e-5, 1e-5, 1.0])).tolist() == [2, 0, 1]
    # each row of a batch on its own scale
    s = torch.tensor([[1e-3, 2e-3, 0.0], [1000.0, 2000.0, 0.0]])
    assert rank_descending(s).tolist() == [[1, 0, 2], [1, 0, 2]]


def test_infinities_keep_their_places():
    s = torch.tensor([float("-inf"), 0.3, float("inf"), 0.3])
    assert rank_descending(s).tolist() == [2, 3, 1, 0]
    assert torch.equal(tie_robust(torch.full((3,), float("-inf"))), torch.full((3,), float("-inf")))
    assert torch.equal(tie_robust(torch.zeros(4)), torch.zeros(4))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1, width=32), min_size=2, max_size=64), st.integers(0, 2 ** 31 - 1))
def test_a_perturbation_at_float32_rounding_does_not_move_the_ranking(values, seed):
    """Two devices' scores differ by a few ulps of the row's largest: the ranking is the same
    unless a score sits on a grid point's boundary (the grid is 2**-20 of the largest, the
    perturbation 2**-24 of it, so at most a sliver of scores can straddle)."""
    s = torch.tensor(values, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    noise = (torch.rand(s.shape, generator=g) - 0.5) * 2.0 ** -24 * float(s.abs().max())
    step = float(s.abs().max()) * 2.0 ** -20
    if step == 0:
        return
    frac = torch.remainder(s.double() / step, 1.0)
    if ((frac - 0.5).abs() < 2.0 ** -3).any():
        return  # a score near a rounding boundary of the grid may go either way
    assert torch.equal(rank_descending(s), rank_descending(s + noise))

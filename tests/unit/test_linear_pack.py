"""Prepacked CPU projections equal F.linear, at every row count, with and without bias."""

import pytest
import torch
import torch.nn.functional as F

from redknot.models import linear as projection


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(2, rows, 40, generator=g)
    packed = projection.pack(w)
    if packed is None:
        pytest.skip("oneDNN's packed GEMM is not available in this torch build")
    got = projection.linear(x, w, b, packed)
    assert got.shape == (2, rows, 96)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_pack_declines_what_it_cannot_run():
    w = torch.randn(8, 8)
    assert projection.pack(None) is None
    assert projection.pack(w.bfloat16()) is None  # only float32 weights are packed
    x = torch.randn(3, 8).bfloat16()
    torch.testing.assert_close(projection.linear(x, w.bfloat16(), None, None), F.linear(x, w.bfloat16()))



def test_a_weight_changed_in_place_is_repacked():
    w = torch.randn(32, 16)
    packed = projection.pack(w)
    if packed is None:
        pytest.skip("oneDNN's packed GEMM is not available in this torch build")
    x = torch.randn(4, 16)
    with torch.no_grad():
        w.mul_(2.0)
    torch.testing.assert_close(projection.linear(x, w, None, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)

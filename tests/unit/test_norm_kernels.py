"""The fused add + RMSNorm and SiLU-gate kernels against the torch modules they replace."""

import os

import pytest
import torch
import torch.nn.functional as F

from redknot.kernels.norm import add_rms_norm, silu_mul
from redknot.models.llama import RMSNorm

DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")


@pytest.mark.parametrize("t,n,dtype", [(1, 64, torch.float32), (5, 96, torch.float32), (3, 256, torch.bfloat16),
                                       (0, 64, torch.float32)])
def test_add_rms_norm_equals_the_torch_norm(t, n, dtype):
    g = torch.Generator().manual_seed(t * n)
    x = torch.randn(t, n, generator=g).to(DEVICE, dtype)
    r = torch.randn(t, n, generator=g).to(DEVICE, dtype)
    norm = RMSNorm(n, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=g) + 0.5)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(add_rms_norm(x, norm.weight, 1e-5), norm(x), **tol)
        y, s = add_rms_norm(x, norm.weight, 1e-5, r)
        # the residual rounds as torch's add (the CPU interpreter's bf16 casts truncate: one ulp)
        exact = dtype == torch.float32 or DEVICE == "cuda"
        torch.testing.assert_close(s, x + r, **(dict(atol=0, rtol=0) if exact else dict(atol=0, rtol=8e-3)))
        torch.testing.assert_close(y, norm(x + r), **tol)


@pytest.mark.parametrize("t,n", [(1, 40), (4, 1500)])
def test_silu_mul_equals_torch(t, n):
    gu = torch.randn(t, 2 * n, generator=torch.Generator().manual_seed(n)).to(DEVICE)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gu), F.silu(gate) * up, atol=1e-6, rtol=1e-5)

"""The fused q/k norm + RoPE Triton kernel against the torch path it replaces (interpreter on CPU;
with REDKNOT_TEST_DEVICE=cuda compiled on a GPU)."""

import os

DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.rope import norm_rope  # noqa: E402
from redknot.models.config import ModelConfig  # noqa: E402
from redknot.models.llama import RMSNorm  # noqa: E402
from redknot.models.rope import RotaryEmbedding, apply_rotation  # noqa: E402


def _cfg(head_dim, partial=1.0, rope_scaling=None):
    return ModelConfig.from_dict({"model_type": "llama", "vocab_size": 32, "hidden_size": 4 * head_dim,
                                  "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": head_dim, "max_position_embeddings": 4096,
                                  "partial_rotary_factor": partial, "rope_scaling": rope_scaling})


@pytest.mark.parametrize("t,h,d,partial,norm,dtype", [
    (7, 3, 16, 1.0, False, torch.float32),
    (33, 2, 32, 1.0, True, torch.float32),
    (5, 4, 24, 1.0, True, torch.float32),      # head dim not a power of two
    (9, 2, 32, 0.5, False, torch.float32),     # partial rotary: the rest passes through
    (9, 2, 32, 0.5, True, torch.bfloat16),
    (64, 3, 64, 1.0, True, torch.bfloat16),    # several programs
])
def test_norm_rope_matches_the_torch_path(t, h, d, partial, norm, dtype):
    torch.manual_seed(t * h + d)
    rope = RotaryEmbedding(_cfg(d, partial)).to(DEVICE)
    x = torch.randn(t, h, d, device=DEVICE).to(dtype)
    positions = torch.randint(0, 3000, (t,), device=DEVICE)
    cos, sin = rope.cos_sin(positions)
    weight = None
    ref_in = x
    if norm:
        rms = RMSNorm(d, 1e-6).to(DEVICE)
        with torch.no_grad():
            rms.weight.copy_(torch.rand(d) + 0.5)
        weight = rms.weight.detach().to(dtype)
        # the reference in fp32 throughout: the kernel rounds once, at the end
        xf = x.float()
        ref_in = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)) * weight.float()
    ref = apply_rotation(ref_in.float(), cos, sin, rope.rot_dim).to(dtype)
    out = norm_rope(x, cos, sin, rope.rot_dim, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_norm_rope_reads_a_strided_view_and_empty_input():
    """q/k come as views of a projection's output; an empty batch is a no-op."""
    rope = RotaryEmbedding(_cfg(16)).to(DEVICE)
    base = torch.randn(6, 5, 16, device=DEVICE)
    x = base[:, 1:4]  # heads 1..3: not contiguous over (T, H)
    positions = torch.arange(6, device=DEVICE)
    cos, sin = rope.cos_sin(positions)
    torch.testing.assert_close(norm_rope(x, cos, sin, 16), apply_rotation(x, cos, sin, 16), rtol=1e-5, atol=1e-5)
    assert norm_rope(x[:0], cos[:0], sin[:0], 16).shape == (0, 3, 16)


def test_cos_sin_are_computed_once_per_positions_tensor():
    rope = RotaryEmbedding(_cfg(16))
    p = torch.arange(5)
    a = rope.cos_sin(p)
    assert rope.cos_sin(p)[0] is a[0]  # the same positions object: cached
    p.add_(1)  # edited in place: recomputed
    b = rope.cos_sin(p)
    assert b[0] is not a[0]
    torch.testing.assert_close(b[0], rope.cos_sin(torch.arange(1, 6))[0])


def test_cos_sin_of_inference_positions():
    """Positions made under inference_mode have no version counter: still cached, still right."""
    rope = RotaryEmbedding(_cfg(16))
    with torch.inference_mode():
        p = torch.arange(4)
        a = rope.cos_sin(p)
        assert rope.cos_sin(p)[0] is a[0]
    torch.testing.assert_close(a[0], rope.cos_sin(torch.arange(4))[0])

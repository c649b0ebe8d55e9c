"""RoPE relocation: keys computed at [0, L) and rotated by delta equal keys computed at [delta, delta + L)."""

import pytest
import torch

from redknot.models.config import ModelConfig
from redknot.models.rope import RotaryEmbedding
from redknot.tiny import ROPE_VARIANTS


def config(rope: str, partial: float = 1.0) -> ModelConfig:
    raw = {"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
           "max_position_embeddings": 4096, "rope_parameters": {"rope_theta": 10000.0, **ROPE_VARIANTS[rope],
                                                                "partial_rotary_factor": partial}}
    return ModelConfig.from_dict(raw)


@pytest.mark.parametrize("rope,partial", [("default", 1.0), ("linear", 1.0), ("llama3", 1.0), ("yarn", 1.0),
                                          ("default", 0.5), ("yarn", 0.25)])
@pytest.mark.parametrize("delta", [1, 37, 1000])
def test_relocation_equals_computing_at_the_new_offset(rope, partial, delta):
    rot = RotaryEmbedding(config(rope, partial))
    gen = torch.Generator().manual_seed(delta)
    raw = torch.randn(50, 3, 32, generator=gen)
    pos = torch.arange(50)
    at_zero = rot.rotate(raw, pos)
    direct = rot.rotate(raw, pos + delta)
    moved = rot.relocate(at_zero, delta)
    torch.testing.assert_close(moved, direct, atol=1e-5, rtol=1e-5)
    if partial < 1:
        assert torch.equal(moved[..., rot.rot_dim:], raw[..., rot.rot_dim:])  # pass-through dims untouched


def test_relocation_per_token_deltas_and_back():
    rot = RotaryEmbedding(config("llama3"))
    k = rot.rotate(torch.randn(20, 2, 32), torch.arange(20))
    deltas = torch.arange(20) * 7
    there = rot.relocate(k, deltas)
    torch.testing.assert_close(rot.relocate(there, -deltas), k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_relocation_broadcasts_over_leading_layers(partial):
    """Keys of every layer [L, T, H, D] moved at once, each token by its own delta, equal each
    layer moved alone (the pieces of a prompt placed in one rotation)."""
    rot = RotaryEmbedding(config("yarn", partial))
    k = torch.randn(4, 20, 2, 32, generator=torch.Generator().manual_seed(0))
    deltas = torch.tensor([5] * 8 + [-2] * 12)
    moved = rot.relocate(k, deltas)
    for layer in range(4):
        torch.testing.assert_close(moved[layer], rot.relocate(k[layer], deltas), atol=0, rtol=0)
    torch.testing.assert_close(rot.relocate(k, 5)[1], rot.relocate(k[1], 5), atol=0, rtol=0)

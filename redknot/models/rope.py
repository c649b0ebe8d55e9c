"""Rotary position embeddings for every variant the runner supports.

Rotations are computed in float32 from integer positions, so the same function serves the
forward pass and the relocation of cached keys (a rotation by a position delta).
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rot_dim/2] (float32) and the cos/sin scaling (yarn's attention factor)."""
    rc = cfg.rope
    dim = int(cfg.head_dim * rc.partial_rotary_factor)
    inv_freq = 1.0 / (rc.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = 1.0
    if rc.rope_type == "linear":
        inv_freq = inv_freq / rc.factor
    elif rc.rope_type == "llama3":
        old_len = rc.original_max_position_embeddings
        low_wavelen, high_wavelen = old_len / rc.low_freq_factor, old_len / rc.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rc.factor, inv_freq)
        smooth = (old_len / wavelen - rc.low_freq_factor) / (rc.high_freq_factor - rc.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rc.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rc.rope_type == "yarn":
        inv_freq, scaling = _yarn(rc, dim)
    return inv_freq, scaling


def _yarn(rc, dim: int) -> tuple[torch.Tensor, float]:
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rc.attention_factor is not None:
        attn_factor = float(rc.attention_factor)
    elif rc.mscale and rc.mscale_all_dim:
        attn_factor = mscale(rc.factor, rc.mscale) / mscale(rc.factor, rc.mscale_all_dim)
    else:
        attn_factor = mscale(rc.factor)

    def correction_dim(n_rot):
        return dim * math.log(rc.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(rc.theta))

    low, high = correction_dim(rc.beta_fast), correction_dim(rc.beta_slow)
    if rc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rc.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rc.factor * pos_freqs)
    keep = 1 - ramp  # share of the original (extrapolated) frequency per dim
    return interpolation * (1 - keep) + extrapolation * keep, attn_factor


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE (NeoX half-rotation, as HF Llama) to the first ``rot_dim`` dims of each head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        inv_freq, self.scaling = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rot_dim = inv_freq.numel() * 2
        self._last = None  # (positions, its version, cos, sin): every layer of a forward asks for the same

    def reset_frequencies(self, device=None) -> None:
        """Recompute ``inv_freq`` (a model built on the meta device and materialised with
        ``to_empty`` has it uninitialised)."""
        with torch.device("cpu"):
            inv_freq = rope_frequencies(self.config)[0]
        self.inv_freq = inv_freq.to(device if device is not None else self.inv_freq.device)
        self._last = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # inference tensors keep no version counter (and cannot be edited outside inference mode)
        version = None if positions.is_inference() else positions._version
        last = self._last
        if last is not None and last[0] is positions and last[1] == version:
            return last[2], last[3]
        cos, sin = self._cos_sin(positions)
        self._last = (positions, version, cos, sin)
        return cos, sin

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in float64: position * inv_freq in fp32 is off by ~ulp(position) radians (6e-5 at
        # 1K, 8e-3 at 128K), which would also make relocated keys differ from directly computed ones.
        freqs = positions.double()[:, None] * self.inv_freq.double()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).float(), (emb.sin() * self.scaling).float()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D], positions: [T] (absolute; may be negative for a relocation delta)."""
        cos, sin = self.cos_sin(positions)
        return apply_rotation(x, cos, sin, self.rot_dim)

    def relocate(self, k: torch.Tensor, delta) -> torch.Tensor:
        """Move keys rotated at positions p to p + delta: one fp32 rotation by delta, one rounding.

        k: [..., T, H, D] (leading dimensions broadcast, e.g. layers); delta: an int or an int
        tensor [T]. Yarn's cos/sin scaling is already in the
        keys, so the delta rotation is a pure rotation (unscaled)."""
        delta = torch.as_tensor(delta, device=k.device)
        # one shared delta (a whole chunk moving): one row of cos/sin, broadcast over the tokens
        delta = delta.reshape(1) if delta.dim() == 0 else delta
        freqs = delta.double()[:, None] * self.inv_freq.double()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return apply_rotation(k, emb.cos().float(), emb.sin().float(), self.rot_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.cos_sin(positions)
        return apply_rotation(q, cos, sin, self.rot_dim), apply_rotation(k, cos, sin, self.rot_dim)


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    # fp32 rotation, one rounding back to the input dtype.
    xr = x[..., :rot_dim].float()
    half = rot_dim // 2
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    if rot_dim == x.shape[-1]:
        return out.to(x.dtype)
    return torch.cat((out.to(x.dtype), x[..., rot_dim:]), dim=-1)

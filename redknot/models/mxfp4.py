"""MXFP4 expert weights (gpt-oss checkpoints on the Hub) dequantised at load.

OpenAI's gpt-oss checkpoints store each MoE expert matrix as ``<name>_blocks`` uint8
[E, rows, G, 16] (two 4-bit e2m1 values a byte, the low nibble first: 32 values a block) and
``<name>_scales`` uint8 [E, rows, G] (one power-of-two exponent a block, biased by 127). A row's
G * 32 values are its inputs: the dequantised tensor is [E, G * 32, rows], the layout of the
bf16 checkpoints' ``gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H]. The forward then runs
on the dequantised weights (bf16 on the GPU): exact values, no fp4 arithmetic.
"""

from __future__ import annotations

import torch

# The 16 values of a 4-bit e2m1 code (sign, 2 exponent bits, 1 mantissa bit).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[E, rows, G, 16] codes and [E, rows, G] exponents -> [E, G * 32, rows] in ``dtype``. Every
    value is exact in bf16 (a 2-bit mantissa times a power of two within its exponent range)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[:3] != scales.shape:
        raise ValueError(f"MXFP4 blocks [E, rows, G, B] must match scales [E, rows, G]: got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    e, rows, g, b = blocks.shape
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(e, g * 2 * b, rows, dtype=dtype, device=blocks.device)
    for x in range(e):  # one expert at a time: the fp32 temporaries stay small
        vals = torch.empty(rows, g, 2 * b, dtype=torch.float32, device=blocks.device)
        vals[..., 0::2] = lut[(blocks[x] & 0x0F).int()]
        vals[..., 1::2] = lut[(blocks[x] >> 4).int()]
        vals = torch.ldexp(vals, (scales[x].to(torch.int32) - SCALE_BIAS)[..., None].float())
        out[x] = vals.reshape(rows, g * 2 * b).T
    return out

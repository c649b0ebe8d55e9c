"""Attention kernels: SegPagedAttention (Triton) and its torch references.

The references import only torch. The Triton kernels are imported on first use, so
``import redknot.kernels`` works on machines without triton.
"""

from ..visibility import GLOBAL_WINDOW
from .reference import (
    dense_masked_attention,
    segpaged_attention_ref,
    segpaged_store_ref,
    visibility_mask,
)

__all__ = [
    "GLOBAL_WINDOW",
    "dense_masked_attention",
    "segpaged_attention",
    "segpaged_attention_ref",
    "segpaged_store",
    "segpaged_store_ref",
    "visibility_mask",
]

_TRITON_NAMES = ("segpaged_attention", "segpaged_store")


def __getattr__(name):
    # Lazy: triton (and its import cost) is only needed when a Triton kernel is asked for.
    if name in _TRITON_NAMES:
        try:
            from . import segpaged
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"redknot.kernels.{name} needs triton (pip install 'redknot[triton]'); "
                "the torch references in redknot.kernels.reference work without it"
            ) from e
        return getattr(segpaged, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The recurrent state of a hybrid model's linear-attention layers, one slot per pool sequence.

A Gated DeltaNet layer carries, per running sequence, the last ``conv_kernel - 1`` inputs of its
short convolution ([conv_dim, W-1], in the model's dtype) and its recurrent state per value head
([HV, Dk, Dv], float32: it accumulates over the whole context). Its size does not depend on the
context length, so it lives beside the page pool rather than in pages: slot i belongs to whoever
holds the pool's sequence slot i (``PagePool.slot``), and slot 0 (the padding rows of a captured
decode batch) is scratch. A sequence whose forward starts at position 0 reads zeros instead of
its slot (``fresh``), so a slot needs no clearing when its sequence ends, is aborted or preempted.

The bytes are reserved once for every slot; ``bytes_per_slot`` is what each running sequence holds
beside its pages, and the memory profile counts the whole allocation (``engine/memory.py``).

``num_snapshots`` more rows after the sequence slots hold snapshots: the state at the end of a
cached prompt prefix (``cache/linear_prefix.py``), copied into a sequence's slot when a request
resumes from that prefix.
"""

from __future__ import annotations

import torch

from ..models.config import LinearAttentionConfig


class LinearStatePool:
    def __init__(self, num_layers: int, spec: LinearAttentionConfig, num_slots: int, dtype: torch.dtype,
                 device, state_dtype: torch.dtype = torch.float32, num_snapshots: int = 0):
        """``num_layers`` linear layers, ``num_slots`` slots (the pool's sequence slots, padding slot 0
        included) and ``num_snapshots`` snapshot rows after them."""
        if num_layers < 1 or num_slots < 1 or num_snapshots < 0:
            raise ValueError(f"num_layers and num_slots must be >= 1, num_snapshots >= 0; got {num_layers}, "
                             f"{num_slots}, {num_snapshots}")
        self.num_layers, self.num_slots, self.spec = num_layers, num_slots, spec
        self.snapshot_rows = list(range(num_slots, num_slots + num_snapshots))
        if dtype == torch.float64:
            state_dtype = torch.float64
        rows = num_slots + num_snapshots
        self.conv = torch.zeros(num_layers, rows, spec.conv_dim, spec.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(num_layers, rows, spec.num_value_heads, spec.key_head_dim,
                                     spec.value_head_dim, dtype=state_dtype, device=device)

    @property
    def bytes_per_slot(self) -> int:
        """Device bytes one sequence's state takes over every linear layer."""
        return (self.conv[:, 0].numel() * self.conv.element_size()
                + self.recurrent[:, 0].numel() * self.recurrent.element_size())

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot * (self.num_slots + len(self.snapshot_rows))

    def copy(self, src: int, dst: int) -> None:
        """Every layer's state of row ``src`` into row ``dst`` (a snapshot into a sequence's slot)."""
        self.conv[:, dst].copy_(self.conv[:, src])
        self.recurrent[:, dst].copy_(self.recurrent[:, src])

    def read(self, layer: int, slots: torch.Tensor, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [B, C, W-1], recurrent [B, HV, Dk, Dv]) of the batch's slots at ``layer``; zeros
        where ``fresh`` (bool [B]: the sequence starts at position 0)."""
        keep = ~fresh
        conv = self.conv[layer].index_select(0, slots) * keep[:, None, None].to(self.conv.dtype)
        rec = self.recurrent[layer].index_select(0, slots) * keep[:, None, None, None].to(self.recurrent.dtype)
        return conv, rec

    def write(self, layer: int, slots: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv[layer].index_copy_(0, slots, conv.to(self.conv.dtype))
        self.recurrent[layer].index_copy_(0, slots, recurrent.to(self.recurrent.dtype))

    def put(self, slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Every layer's state of one row: conv [layers, C, W-1], recurrent [layers, HV, Dk, Dv]."""
        self.conv[:, slot].copy_(conv)
        self.recurrent[:, slot].copy_(recurrent)

"""What one forward computes: the batch's metadata, passed down the model's one layer loop.

The runner describes the batch once (which sequences, how many new tokens each, where their KV
lives, the head plan's windows and sinks) and passes it with the token ids; every attention layer
reads it. Tensors and plain values only: the model code never sees scheduling objects, and a
backend adds its own per-batch metadata under ``extras``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class ForwardMode(str, Enum):
    EXTEND = "extend"  # prompt tokens (chunked prefill), possibly mixed with decodes
    DECODE = "decode"  # one new token per sequence (CUDA-graph replayable)
    RECOVER = "recover"  # rows at explicit positions under a recovery's row plan (reused chunk KV)


@dataclass
class ForwardBatch:
    mode: ForwardMode = ForwardMode.EXTEND
    seq_ids: list[int] = field(default_factory=list)  # host: sequence ids in batch order
    q_lens: list[int] = field(default_factory=list)  # host: new tokens per sequence
    seq_lens: list[int] | None = field(default_factory=list)  # host: length after this step (None in a graph)
    max_q_len: int = 0
    cu_seqlens_q: torch.Tensor | None = None  # device int32 [B+1]
    seq_lens_t: torch.Tensor | None = None  # device int32 [B]
    # device int64 [total_q]; under RECOVER each row's own position (sorted per sequence), else the
    # last q_len positions of its sequence
    positions: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None  # device int32 [L, B, Hkv, max_pages] (paged KV)
    state_slots: torch.Tensor | None = None  # device int64 [B]: each sequence's pool slot (its linear state)
    window: torch.Tensor | None = None  # device int32 [L, Hkv]: the batch's head plan
    sink: torch.Tensor | None = None  # device int32 [L, Hkv]
    sel_pos: torch.Tensor | None = None  # device int32 [L, B, Hkv, max_sel]: selected sets (sorted, -1 padded)
    sel_lens: torch.Tensor | None = None  # device int32 [L, B, Hkv]
    # Query recording (head selection reads a forward's queries): every layer's queries of all rows
    # into ``q_record`` [L, B, Hq, D] (decode graphs), or of the rows ``capture_rows`` picks into
    # ``captured[layer]``.
    q_record: torch.Tensor | None = None
    capture_rows: torch.Tensor | None = None
    captured: list = field(default_factory=list)
    extras: dict = field(default_factory=dict)  # backend-owned per-batch metadata (tensors)

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    @property
    def explicit_positions(self) -> bool:
        return self.mode is ForwardMode.RECOVER

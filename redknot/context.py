"""The per-batch attention context.

The engine describes the batch once (which sequences, how many new tokens each, where their KV
lives) and sets it here before the forward; attention layers and backends read it. The model code
never sees scheduling details, so a new backend plugs in without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Context:
    is_prefill: bool = False
    seq_ids: list[int] = field(default_factory=list)  # host: sequence ids in batch order
    q_lens: list[int] = field(default_factory=list)  # host: new tokens per sequence
    seq_lens: list[int] = field(default_factory=list)  # host: length after this step
    max_q_len: int = 0
    cu_seqlens_q: torch.Tensor | None = None  # device int32 [B+1]
    seq_lens_t: torch.Tensor | None = None  # device int32 [B]
    positions: torch.Tensor | None = None  # device int64 [total_q]
    block_tables: torch.Tensor | None = None  # device int32 [L, B, Hkv, max_pages] (paged KV)
    window: torch.Tensor | None = None  # device int32 [L, Hkv]: the batch's head plan
    sink: torch.Tensor | None = None  # device int32 [L, Hkv]
    # Rows at explicit positions: ``positions`` holds each row's position (sorted per sequence),
    # not the last q_len positions of its sequence (a recovery computes rows anywhere in a prompt).
    explicit_positions: bool = False
    rows: Any = None  # a recovery batch's per-layer row policy (engine.recovery_batch.RecoveryRows)
    sel_pos: torch.Tensor | None = None  # device int32 [L, B, Hkv, max_sel]: selected sets (sorted, -1 padded)
    sel_lens: torch.Tensor | None = None  # device int32 [L, B, Hkv]
    # A decode graph of a plan with budget checks writes every layer's queries here (device
    # [L, B, Hq, D]), so a check step replays the graph instead of running eagerly to record them.
    q_record: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)  # backend-owned per-batch metadata

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(ctx: Context) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def reset_context() -> None:
    set_context(Context())

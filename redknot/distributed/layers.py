"""Tensor-parallel layers of the Llama family, as index maps from the full weights to one rank's.

Column-parallel (output rows split): the fused QKV split by KV-head groups, so a rank holds whole
KV heads with the query heads that read them; gate and up split alike, so a rank's SiLU(gate)*up
needs nothing from another rank. Row-parallel (input columns split): o_proj and down_proj; each
rank's product is a partial sum, all-reduced after (the bias added once, by rank 0). The
vocabulary is split by rows for the embedding (each rank looks up the ids it holds, zeros elsewhere,
all-reduced) and the LM head (each rank's logits slice, gathered).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def head_rows(heads: list[int], rows_per_head: int) -> torch.Tensor:
    """Row indices [len(heads) * rows_per_head] of the given heads in a projection laid out head by head."""
    return torch.cat([torch.arange(h * rows_per_head, (h + 1) * rows_per_head) for h in heads])


def query_heads(kv_heads: list[int], group: int) -> list[int]:
    """The query heads reading the given KV heads (grouped-query attention: ``group`` per KV head)."""
    return [q for h in kv_heads for q in range(h * group, (h + 1) * group)]


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """(first id, rows) of a rank's vocabulary shard; every shard has ceil(vocab / world) rows (the
    last one padded with zero rows past the vocabulary)."""
    rows = -(-vocab // world)
    return rank * rows, rows


def vocab_rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A rank's rows of an embedding / LM-head matrix [vocab, hidden], zero-padded to the shard size."""
    start, rows = vocab_range(full.shape[0], rank, world)
    out = full.new_zeros(rows, *full.shape[1:])
    part = full[start:start + rows]
    out[:part.shape[0]] = part
    return out


class VocabParallelEmbedding(nn.Module):
    """The rows [start, start + rows) of an embedding; other ids look up zeros. ``reduce``: the sum
    over ranks (None: this rank's partial lookup, for tests that add the shards themselves)."""

    def __init__(self, rows: int, hidden: int, start: int, reduce=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start, self.reduce = start, reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return out if self.reduce is None else self.reduce(out)


class GatherLogits:
    """The LM head's per-rank logits slices [T, rows] gathered into [T, vocab]."""

    def __init__(self, group, vocab: int):
        self.group, self.vocab = group, vocab

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(logits)[..., :self.vocab]

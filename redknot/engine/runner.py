"""One forward step over a packed batch: build the context once, run the model, take logits."""

from __future__ import annotations

import torch

from ..context import Context, reset_context, set_context
from ..models.llama import LlamaForCausalLM
from .backends import AttentionBackend
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, device: torch.device):
        self.model, self.device = model, device

    @torch.inference_mode()
    def step(self, backend: AttentionBackend, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Compute KV for the next ``n`` pending tokens of each sequence; float32 logits [B, V] of each last one."""
        ids, positions, q_lens, seq_lens = [], [], [], []
        for seq, n in batch:
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            q_lens.append(n)
            seq_lens.append(start + n)
        dev = self.device
        cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        ctx = Context(
            is_prefill=any(n > 1 or s.num_computed == 0 for s, n in batch),
            seq_ids=[s.seq_id for s, _ in batch],
            q_lens=q_lens,
            seq_lens=seq_lens,
            max_q_len=max(q_lens),
            cu_seqlens_q=cu.to(dev, non_blocking=True),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True),
        )
        set_context(ctx)
        try:
            backend.begin(ctx)
            self.model.set_backend(backend)
            hidden = self.model(torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True), ctx.positions)
            backend.end(ctx)
        finally:
            reset_context()
        for seq, n in batch:
            seq.num_computed += n
        return self.model.logits(hidden[cu[1:].to(dev).long() - 1])

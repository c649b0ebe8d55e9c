"""Sampling parameters (vLLM-shaped) and the batched sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # also return the float32 logits of the first generated position (RequestOutput.first_token_logits):
    # quality scoring compares them with dense's without a second prefill
    return_first_logits: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: float32 [B, V]. Greedy rows take argmax; the rest sample after temperature/top-k/top-p."""
    out = logits.argmax(dim=-1)
    stochastic = [i for i, p in enumerate(params) if not p.greedy]
    if stochastic:
        rows = logits[stochastic]
        temps = torch.tensor([params[i].temperature for i in stochastic], device=rows.device)
        probs = _filter(rows / temps[:, None], [params[i] for i in stochastic]).softmax(dim=-1)
        for j, i in enumerate(stochastic):  # per-row generators keep seeded requests reproducible
            out[i] = torch.multinomial(probs[j], 1, generator=generators[i]).squeeze(0)
    return out.tolist()


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device).clamp(max=vocab)
    ps = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = rank >= ks[:, None]
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop |= (cum - sorted_logits.softmax(dim=-1)) >= ps[:, None]  # keep the smallest set reaching top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

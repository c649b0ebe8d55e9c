"""A request's token state as the engine advances it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams

_ids = itertools.count()


@dataclass
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    finish_reason: str | None = None
    text: str = ""
    generator: torch.Generator | None = None
    first_token_time: float | None = None  # time.perf_counter() when the first output token was sampled

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not yet computed (the prompt remainder, or the last sampled token)."""
        return len(self.token_ids) - self.num_computed

"""Sampling parameters (vLLM-shaped) and the batched sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .structured import StructuredOutputs, apply_grammars

# Temperatures below this sample as greedy (as vLLM does): dividing logits by them overflows.
_GREEDY_BELOW = 1e-5
# The most top logprobs a request may ask for per token (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1  # seeds a JSON client and every generator agree on


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
    # None: no logprobs; k >= 0: each generated token's logprob and the k most likely tokens' (of the
    # raw model output, before temperature, top-k/p or a grammar mask: vLLM's default)
    logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None  # a grammar the output must follow

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature)
                or self.temperature < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < _GREEDY_BELOW:  # logits / T would overflow: as good as greedy
            self.temperature = 0.0
        if (not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p)
                or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed <= MAX_SEED):
            # a negative seed would alias a large one (torch takes seeds modulo 2**64)
            raise ValueError(f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def needs_each_sample(seq) -> bool:
    """Whether the host must see a sequence's every sample before the next step is sampled (its
    grammar advances with each token, or its logprobs are recorded): no decode launched ahead."""
    return seq.grammar is not None or seq.params.logprobs is not None


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           grammars: list | None = None) -> torch.Tensor:
    """logits: float32 [B, V] -> int64 [B] on the same device, with no host sync (but for the
    grammar bitmasks of ``grammars``' rows, which mask ``logits`` in place first).

    Greedy rows take the argmax. The rest sample after temperature, top-k and top-p, by the
    exponential race (argmax of p / E with E ~ Exp(1) drawn per row), which draws from
    the filtered distribution without torch.multinomial's sync; a seeded row draws its noise
    from its own generator, so it is reproducible whatever else is in the batch."""
    if grammars is not None and any(g is not None for g in grammars):
        apply_grammars(logits, grammars)
    greedy = logits.argmax(dim=-1)
    stochastic = [i for i, p in enumerate(params) if not p.greedy]
    if not stochastic:
        return greedy
    dev = logits.device
    rows = logits[stochastic] if len(stochastic) < len(params) else logits
    sub = [params[i] for i in stochastic]
    # capped so that no temperature becomes inf in float32 (finite logits / inf is 0, -inf / inf NaN)
    temps = torch.tensor([min(p.temperature, 1e30) for p in sub], device=dev, dtype=logits.dtype)
    rows = rows / temps[:, None]
    if any(p.top_k > 0 or p.top_p < 1 for p in sub):
        rows = _filter(rows, sub)
    probs = rows.softmax(dim=-1)
    noise = torch.empty_like(probs)
    seeded = [j for j, i in enumerate(stochastic) if generators[i] is not None]
    if len(seeded) < len(stochastic):
        noise.exponential_()
    for j in seeded:
        noise[j].exponential_(generator=generators[stochastic[j]])
    drawn = (probs / noise).argmax(dim=-1)
    if len(stochastic) == len(params):
        return drawn
    idx = torch.tensor(stochastic, device=dev)
    return greedy.index_copy(0, idx, drawn)


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=logits.device)
    ps = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = rank >= ks[:, None]
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop |= (cum - sorted_logits.softmax(dim=-1)) >= ps[:, None]  # keep the smallest set reaching top_p
    drop[:, 0] = False  # the most likely token always stays (a top_p that rounds to 0 in float32 included)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Logprobs:
    """Log-softmax (float32) of the rows whose requests ask for logprobs, taken from the logits
    the sampler gets, before it masks or scales them; ``record`` appends each sampled token's
    (logprob, [(token, logprob)] top-k) to its sequence once the tokens are on the host."""

    def __init__(self, logits: torch.Tensor, params: list[SamplingParams]):
        self.rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.lp = self.top = None
        if self.rows:
            idx = torch.tensor(self.rows, device=logits.device)
            self.lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
            k = max(params[i].logprobs for i in self.rows)
            if k > 0:
                self.top = self.lp.topk(min(k, self.lp.shape[-1]), dim=-1)

    def record(self, seqs: list, tokens: list) -> None:
        """Append to each row's ``seq.logprobs``; also advance each sequence's grammar by its token."""
        for s, t in zip(seqs, tokens):
            if s.grammar is not None and t is not None:
                s.grammar.accept(t)
        if not self.rows:
            return
        chosen = [tokens[i] if tokens[i] is not None else 0 for i in self.rows]
        picked = self.lp.gather(1, torch.tensor(chosen, device=self.lp.device)[:, None])[:, 0].tolist()
        top_v = self.top.values.tolist() if self.top is not None else None
        top_i = self.top.indices.tolist() if self.top is not None else None
        for j, i in enumerate(self.rows):
            s = seqs[i]
            if tokens[i] is None:
                continue
            k = s.params.logprobs
            top = list(zip(top_i[j][:k], top_v[j][:k])) if k else []
            if s.logprobs is None:
                s.logprobs = []
            s.logprobs.append((picked[j], top))

"""FLOPs of what a prefill actually executed: projections, attention and FFN, per layer.

Counts are exact for the visibility rule (visible (query, key) pairs per head), so a method is
charged for what it ran, not for an analytic model of it. Multiply-adds count as 2 FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


from ..models.config import ModelConfig
from ..visibility import visible_pairs  # noqa: F401  (callers import it from here too)


@dataclass
class FlopReport:
    proj: list[int] = field(default_factory=list)  # per layer
    attention: list[int] = field(default_factory=list)
    ffn: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # tokens through the layer's projections
    ffn_tokens: list[int] = field(default_factory=list)
    lm_head: int = 0
    # hybrid models, counted over (linear layer, value head) pairs: heads that ran the recurrence over
    # every prompt row (the "all heads recompute" rule), heads whose state over placed document
    # chunks is exact (each chunk's transition applied), heads that started from a chunk's own state
    # at least once (short memory: the incoming state dropped)
    linear_heads_recomputed: int = 0
    scoring: int = 0  # attention masses a policy reads (the observed queries' q·k over every key)
    linear_heads_composed: int = 0
    linear_heads_decayed: int = 0

    def add_layer(self, cfg: ModelConfig, n_tokens: int, pairs: int, n_ffn: int) -> None:
        per_row, per_pair = cfg.attention_flops()  # projections; q·k and p·v
        self.proj.append(n_tokens * per_row)
        self.attention.append(per_pair * pairs)
        self._add_ffn(cfg, n_tokens, n_ffn)

    def add_linear_layer(self, cfg: ModelConfig, n_tokens: int, n_ffn: int,
                         placed: tuple[int, int] | None = None) -> None:
        """A Gated DeltaNet layer over ``n_tokens`` rows: its projections (q/k/v/z, beta/decay, out),
        the short convolution, and the recurrence (per value head and token: decay, read, rank-1
        write, output, four Dk x Dv multiply-adds). ``placed``: the layer's state came from placed
        chunks (``LinearReuse``): (transitions applied, value heads exact over every chunk); each
        transition is a Dk x Dk by Dk x Dv product. None: the rows are the whole prompt."""
        lc, h = cfg.linear, cfg.hidden_size
        self.proj.append(2 * n_tokens * h * (2 * lc.key_dim + 3 * lc.value_dim + 2 * lc.num_value_heads))
        recurrence = 8 * lc.num_value_heads * lc.key_head_dim * lc.value_head_dim
        work = n_tokens * (2 * lc.conv_dim * lc.conv_kernel + recurrence)
        if placed is None:
            self.linear_heads_recomputed += lc.num_value_heads if n_tokens else 0
        else:
            applied, exact = placed
            work += applied * 2 * lc.key_head_dim ** 2 * lc.value_head_dim
            self.linear_heads_composed += exact
            self.linear_heads_decayed += lc.num_value_heads - exact
        self.attention.append(work)
        self._add_ffn(cfg, n_tokens, n_ffn)

    def _add_ffn(self, cfg: ModelConfig, n_tokens: int, n_ffn: int) -> None:
        sparse, every = cfg.ffn_flops_per_row(len(self.ffn))  # MoE: routed experts, shared expert
        self.ffn.append(n_ffn * sparse + n_tokens * every)
        self.tokens.append(n_tokens)
        self.ffn_tokens.append(n_ffn)

    def add_scoring(self, cfg: ModelConfig, n_queries: int, n_keys: int) -> None:
        """A policy's ranking pass: ``n_queries`` queries' scores over ``n_keys`` keys, every query
        head, computed again to read their softmax (the attention itself does not return it)."""
        self.scoring += 2 * n_queries * n_keys * cfg.num_attention_heads * cfg.head_dim

    def add_lm_head(self, cfg: ModelConfig, rows: int = 1) -> None:
        self.lm_head += 2 * rows * cfg.hidden_size * cfg.vocab_size

    def totals(self) -> dict:
        out = {"proj": sum(self.proj), "attention": sum(self.attention), "ffn": sum(self.ffn),
               "lm_head": self.lm_head, "scoring": self.scoring}
        out["total"] = sum(out.values())
        linear = {"linear_heads_recomputed": self.linear_heads_recomputed,
                  "linear_heads_composed": self.linear_heads_composed,
                  "linear_heads_decayed": self.linear_heads_decayed}
        if any(linear.values()):
            out.update(linear)
        return out

    def merge(self, other: "FlopReport") -> "FlopReport":
        """Layer-wise sum (e.g. a chunk's offline prefill plus the request's recovery)."""
        if not self.proj:
            return other
        return FlopReport([a + b for a, b in zip(self.proj, other.proj)],
                          [a + b for a, b in zip(self.attention, other.attention)],
                          [a + b for a, b in zip(self.ffn, other.ffn)],
                          [a + b for a, b in zip(self.tokens, other.tokens)],
                          [a + b for a, b in zip(self.ffn_tokens, other.ffn_tokens)],
                          self.lm_head + other.lm_head,
                          linear_heads_recomputed=self.linear_heads_recomputed + other.linear_heads_recomputed,
                          scoring=self.scoring + other.scoring,
                          linear_heads_composed=self.linear_heads_composed + other.linear_heads_composed,
                          linear_heads_decayed=self.linear_heads_decayed + other.linear_heads_decayed)


@dataclass(frozen=True)
class LinearReuse:
    """Placed document chunks on a hybrid's linear layers, per linear layer: transitions applied
    ((chunk, head) pairs), carried states dropped (short-memory heads), value heads exact over
    every chunk (``cache/linear_chunks.compose``)."""
    composed: list[int]
    dropped: list[int]
    exact: list[int]


def prefill_flops(cfg: ModelConfig, positions, window, sink, linear: LinearReuse | None = None) -> dict:
    """Totals of a prefill that computed ``positions`` (every layer, every row through the FFN)
    under a plan's ``window``/``sink`` [L, Hkv] (a hybrid's: one row per full-attention layer);
    ``linear``: a hybrid's linear state placed from document chunks before those rows."""
    import torch

    window, sink = torch.as_tensor(window), torch.as_tensor(sink)
    q_pos = torch.as_tensor(positions, dtype=torch.int64)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    report = FlopReport()
    kv_layer = linear_layer = 0
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_linear_layer(layer):
            placed = None if linear is None else (linear.composed[linear_layer], linear.exact[linear_layer])
            report.add_linear_layer(cfg, q_pos.numel(), q_pos.numel(), placed)
            linear_layer += 1
            continue
        pairs = visible_pairs(q_pos, window[kv_layer], sink[kv_layer], group)
        report.add_layer(cfg, q_pos.numel(), pairs, q_pos.numel())
        kv_layer += 1
    report.add_lm_head(cfg)
    return report.totals()

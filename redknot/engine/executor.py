"""Running a step's forwards: recovery batches and one forward per head plan.

The scheduler has laid out the batch and ensured its pages; this runs it through the model runner
and does what follows a forward on the pool side (trim to the plan, offer exact prompt KV to the
prefix cache, count executed FLOPs, the head selection around the forward). Sampling is the
engine's postprocess.
"""

from __future__ import annotations

import sys

import torch

from ..reuse.flops import prefill_flops
from .phases import phase
from .recovery_batch import RecoveryRows
from .sequence import Sequence


class Executor:
    def __init__(self, runner, pool, config, prefix_cache, timings: dict, recovery_share: dict):
        self.runner, self.pool, self.config, self.prefix_cache = runner, pool, config, prefix_cache
        self.timings, self.recovery_share = timings, recovery_share
        self.selection = None  # HeadSelection: records queries around a forward, selects after it
        self.tp = None  # tensor parallel: the group whose ranks hold the other KV heads

    def recover(self, seqs: list[Sequence]) -> torch.Tensor:
        """One batched recovery forward for requests of one method (their chunks already in their
        pages); each request's pages are then trimmed to its plan. Returns their logits."""
        prompts = [s.token_ids[:s.num_prompt] for s in seqs]
        with phase(self.timings, "recover"):
            rows = RecoveryRows(self.config, [s.recovery[0] for s in seqs], [len(p) for p in prompts],
                                [s.recovery[1] for s in seqs], self.pool.device, self.tp)
            logits = self.runner.recover([s.seq_id for s in seqs], prompts, rows)
        for s, report, r in zip(seqs, rows.flops(), rows.requests):
            prev = self.recovery_share.get(s.method)
            self.recovery_share[s.method] = r.row_share if prev is None else (prev + r.row_share) / 2
            s.reuse.recovery = None
            s.num_computed = s.num_prompt
            s.flops = report.totals()
            self.pool.trim(s.seq_id)
        return logits

    def forward(self, plan: str, items: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """One forward of a plan's batch ((request, new tokens) each). Returns the requests whose
        prompt it completed (or that decoded) and their logits rows."""
        with phase(self.timings, "forward"):
            record = self.selection.begin(plan, items) if self.selection is not None else None
            captured = [None] * self.config.num_hidden_layers if record is not None else None
            # spans placed requests recompute in place (epic: each chunk's first tokens) join the
            # batch after every request's own rows: each layer stores every row before any attends
            spans = [(s, a, m) for s, _ in items if s.reuse is not None for a, m in s.reuse.spans]
            # a hybrid's prefix cache: the linear state at page boundaries the prompt chunks cross
            snapshots = getattr(self.prefix_cache, "snapshot_requests", None)
            extras, pending = snapshots(plan, items, len(spans)) if snapshots is not None else (None, [])
            try:
                logits = self.runner.forward(plan, [s.seq_id for s, _ in items] + [s.seq_id for s, _, _ in spans],
                                             [s.token_ids[s.num_computed:s.num_computed + n] for s, n in items]
                                             + [s.token_ids[a:a + m] for s, a, m in spans],
                                             [s.num_computed for s, _ in items] + [a for _, a, _ in spans],
                                             record, captured, extras)[:len(items)]
            finally:
                if pending:
                    self.prefix_cache.commit(pending, ok=sys.exc_info()[0] is None)
            for s, _, _ in spans:
                s.reuse.spans = []
        done = []
        for i, (s, n) in enumerate(items):
            s.num_computed += n
            self.pool.trim(s.seq_id)
            if n > 1 and self.prefix_cache is not None and s.exact_kv:
                m = min(s.num_computed, s.num_prompt)
                self.prefix_cache.insert(plan, s.token_ids[:m], self.pool.table(s.seq_id), s.cache_salt)
            if s.num_pending == 0:
                done.append(i)
                if s.flops is None and s.prefill_start is not None:
                    recomputed = s.reuse.recomputed if s.reuse is not None else []
                    s.flops = prefill_flops(self.config, recomputed + list(range(s.prefill_start, s.num_prompt)),
                                            *self.pool.head_window_sink(s.plan),
                                            linear=s.reuse.linear if s.reuse is not None else None)
        if self.selection is not None:
            with phase(self.timings, "select"):
                self.selection.end(captured)
        rows = logits if len(done) == len(items) else logits[torch.tensor(done, device=logits.device, dtype=torch.long)]
        return [items[i][0] for i in done], rows

"""Running a step's forwards: recovery batches and one forward per head plan.

The scheduler has laid out the batch and ensured its pages; this runs it through the model runner
and does what follows a forward on the pool side (trim to the plan, offer exact prompt KV to the
prefix cache, count executed FLOPs, the head selection around the forward). Sampling is the
engine's postprocess.
"""

from __future__ import annotations

import math
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
        # recoveries split over steps: seq_id -> (its batch's requests, their RecoveryRows), while paused
        self._jobs: dict[int, tuple[list[Sequence], RecoveryRows]] = {}
        self.row_layers: int | None = None  # row-layers recoveries may still run this step (None: no limit)

    def recovering(self, seq: Sequence) -> bool:
        """Is the request's recovery under way (paused between layers): its pages are being written."""
        return seq.seq_id in self._jobs

    def reserved_tokens(self, recovering: list[Sequence] = ()) -> int:
        """Tokens of the step's budget the recoveries may still need: those under way (rows times
        layers left, over the layer count: an upper bound, as rows only shrink) and the requests of
        ``recovering`` not yet started (their prompts)."""
        total = sum(rows.remaining() for _, rows in {id(j[1]): j for j in self._jobs.values()}.values())
        fresh = sum(s.num_prompt for s in recovering if s.seq_id not in self._jobs)
        return -(-total // self.config.num_hidden_layers) + fresh

    def drop_recovery(self, seq: Sequence) -> list[Sequence]:
        """Forget the recovery under way that ``seq`` is in; returns its batch's requests ([] when none)."""
        job = self._jobs.get(seq.seq_id)
        if job is None:
            return []
        for s in job[0]:
            self._jobs.pop(s.seq_id, None)
        return job[0]

    def recovery_charge(self, seq: Sequence) -> int:
        """Tokens of a step's budget a new recovery is charged: the share of a dense prefill's row
        work its method's last recoveries computed (every row until one is measured)."""
        return math.ceil(self.recovery_share.get(seq.method, 1.0) * len(seq.token_ids))

    def recovery_batches(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """The step's recovery batches, the least work left first, so the step's budget
        (``row_layers``) goes to a short recovery before a long one: those under way, then the
        new requests of each method, shortest first, in one batch while their charges fit the
        budget the recoveries under way leave; the rest in a second batch, after every other.
        A request arriving beside others then gets its first token this step instead of waiting
        for a batch the budget spreads over two (a new batch's work: its rows through every layer)."""
        out, rest, new, seen = [], [], {}, set()
        for s in seqs:
            job = self._jobs.get(s.seq_id)
            if job is None:
                new.setdefault(s.method, []).append(s)
            elif s.seq_id not in seen:
                seen.update(x.seq_id for x in job[0])
                out.append((job[1].remaining(), job[0]))
        layers = self.config.num_hidden_layers
        free = None if self.row_layers is None else self.row_layers // layers - self.reserved_tokens()
        for batch in new.values():
            batch.sort(key=lambda s: s.num_prompt)
            fit, charged = [], 0
            for s in batch:
                charged += self.recovery_charge(s)
                if fit and free is not None and 0 < free < charged:  # (nothing fits: one batch, as far as it runs)
                    break
                fit.append(s)
            out.append((sum(s.num_prompt for s in fit) * layers, fit))
            if len(fit) < len(batch):
                rest.append(batch[len(fit):])
        return [batch for _, batch in sorted(out, key=lambda x: x[0])] + rest

    def recover(self, seqs: list[Sequence]) -> tuple[list[Sequence], torch.Tensor | None]:
        """Run a recovery batch (requests of one method, their chunks already in their pages) for
        the step: whole, or as many layers as ``row_layers`` allows (at least one), resuming where
        it paused. Once its last layer has run, each request's pages are trimmed to its plan and
        (the requests, their logits) come back; until then ([], None)."""
        job = self._jobs.get(seqs[0].seq_id)
        if job is None:
            prompts = [s.token_ids[:s.num_prompt] for s in seqs]
            scored = self._scoring_pass(seqs, prompts)
            rows = RecoveryRows(self.config, [s.recovery[0] for s in seqs], [len(p) for p in prompts],
                                [s.recovery[1] for s in seqs], self.pool.device, self.tp, scored)
        else:
            seqs, rows = job
            prompts = [s.token_ids[:s.num_prompt] for s in seqs]
        rows.budget, rows.spent = self.row_layers, 0
        try:
            with phase(self.timings, "recover"):
                logits = self.runner.recover([s.seq_id for s in seqs], prompts, rows)
        except BaseException:
            for s in seqs:
                self._jobs.pop(s.seq_id, None)
            raise
        if self.row_layers is not None:
            self.row_layers = max(self.row_layers - rows.spent, 0)
        if logits is None:  # paused between layers: the next step resumes it
            for s in seqs:
                self._jobs[s.seq_id] = (seqs, rows)
            return [], None
        for s in seqs:
            self._jobs.pop(s.seq_id, None)
        for s, report, r in zip(seqs, rows.flops(), rows.requests):
            prev = self.recovery_share.get(s.method)
            self.recovery_share[s.method] = r.row_share if prev is None else (prev + r.row_share) / 2
            s.reuse.recovery = None
            s.num_computed = s.num_prompt
            s.flops = report.totals()
            self.pool.trim(s.seq_id)
        return seqs, logits

    def _scoring_pass(self, seqs: list[Sequence], prompts: list[list[int]]) -> RecoveryRows | None:
        """Run the batch's scoring pass whole where its method has one (``Policy.scoring_pass``: the
        question alone over the placed K/V), before its rows are chosen; its row-layers come out of
        the step's budget. Returns its rows (their FLOPs join the recovery's), or None."""
        scorers = [s.recovery[0].scoring_pass() for s in seqs]
        if all(p is None for p in scorers):
            return None
        if any(p is None for p in scorers):
            raise ValueError("a recovery batch mixes policies with and without a scoring pass")
        rows = RecoveryRows(self.config, scorers, [len(p) for p in prompts], [s.recovery[1] for s in seqs],
                            self.pool.device, self.tp)
        with phase(self.timings, "recover"):
            self.runner.recover([s.seq_id for s in seqs], prompts, rows)
        if self.row_layers is not None:
            self.row_layers = max(self.row_layers - rows.spent, 0)
        return rows

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

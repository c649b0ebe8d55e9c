"""The engine of one tensor-parallel rank, kept in lockstep with the others.

Rank 0 owns the requests: the fronts (``LLM``, the server) add, abort and step its engine as on
one device. Each of its steps first broadcasts what changed since the last one (requests added
with their prompt, params and documents; aborts; cache clears), so every worker's engine replays
the same calls in the same order; the engines are deterministic, so each schedules the same
batch, and the model's collectives keep the forwards in step. Before each forward the ranks
agree on a digest of the batch (request ids, positions, tokens): a rank that scheduled anything
else fails the step loudly on every rank instead of feeding mismatched tensors to a collective.
Rank 0 samples and broadcasts the tokens, so every rank appends the same ones.
"""

from __future__ import annotations

import hashlib

import torch

from ..engine.engine_state import clear_caches
from ..engine.engine import Engine
from ..engine.executor import Executor
from ..engine.sequence import Sequence


class TensorParallelDivergence(RuntimeError):
    """The ranks' engines scheduled different batches (their lockstep is broken)."""


def batch_digest(kind: str, plan: str, rows) -> int:
    """A digest of a forward's batch: (request id, first position, tokens) per row."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{kind}|{plan}|".encode())
    for seq_id, start, tokens in rows:
        h.update(f"{seq_id}:{start}:{len(tokens)}:".encode())
        h.update(torch.as_tensor(tokens, dtype=torch.int64).numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


class CheckedExecutor(Executor):
    """The executor with the ranks' agreement on each forward's batch checked first."""

    def __init__(self, inner: Executor, engine: "LockstepEngine"):
        super().__init__(inner.runner, inner.pool, inner.config, inner.prefix_cache, inner.timings,
                         inner.recovery_share)
        self.engine = engine
        self.tp = engine.group  # recovery scores sum over every rank's heads

    def _check(self, kind: str, plan: str, rows) -> None:
        if not self.engine.group.agree(batch_digest(kind, plan, rows)):
            err = TensorParallelDivergence(
                f"tensor-parallel rank {self.engine.group.rank} scheduled a different {kind} batch than the other "
                f"ranks (plan {plan!r}, requests {[r[0] for r in rows]}): their engines left lockstep")
            self.engine.diverged = err
            raise err

    def forward(self, plan, items):
        self._check("forward", plan, [(s.seq_id, s.num_computed, s.token_ids[s.num_computed:s.num_computed + n])
                                      for s, n in items])
        return super().forward(plan, items)

    def recover(self, seqs):
        self._check("recover", seqs[0].method, [(s.seq_id, 0, s.token_ids[:s.num_prompt]) for s in seqs])
        return super().recover(seqs)


def request_spec(seq: Sequence) -> dict:
    """What a worker needs to rebuild a prepared request exactly."""
    return {"seq_id": seq.seq_id, "prompt_token_ids": seq.prompt_token_ids, "params": seq.params,
            "method": seq.method, "budget": seq.budget, "chunked_prompt": seq.chunked_prompt,
            "cache_salt": seq.cache_salt, "stream": seq.stream}


class LockstepEngine(Engine):
    """``group``: the rank's ``TPGroup``; ``watch``: rank 0's check that every worker still runs
    (raises with the worker's exit code); ``grammars``: the structured-output matchers' factory."""

    def __init__(self, *args, group, watch=None, grammars=None, **kwargs):
        self.group, self.watch, self.grammars = group, watch, grammars
        self.pending: list[tuple] = []  # rank 0: calls the workers have not replayed yet
        self.diverged: TensorParallelDivergence | None = None
        self.replayed: dict[int, Sequence] = {}  # workers: request id -> its replica
        super().__init__(*args, **kwargs)

    def _build(self, num_pages, plans=None):
        super()._build(num_pages, plans)
        self.executor = CheckedExecutor(self.executor, self)
        self.selection = self._selection  # attached to the checked executor

    def resize_pool(self, num_pages: int) -> None:
        """Every rank's pool gets the smallest size any rank profiled: equal pools admit and evict
        alike, which keeps the engines in lockstep (each rank's free memory may differ)."""
        super().resize_pool(self.group.agree_min(num_pages))

    # ---- rank 0: the calls the fronts make, recorded for the workers
    def add_request(self, seq: Sequence) -> None:
        if seq.kv_import is not None or seq.kv_export is not None:
            raise ValueError("prefill/decode disaggregation (kv_import/kv_export) is not supported with "
                             "tensor_parallel_size > 1")
        super().add_request(seq)
        self.pending.append(("add", request_spec(seq)))

    def abort(self, seq: Sequence) -> None:
        super().abort(seq)
        if self.group.is_driver:
            self.pending.append(("abort", seq.seq_id))

    def clear_caches(self) -> None:
        clear_caches(self)
        if self.group.is_driver:
            self.pending.append(("clear",))

    def step(self):
        if self.group.is_driver:
            if self.watch is not None:
                self.watch()
            pending, self.pending = self.pending, []
            self.group.broadcast_object(("step", pending))
        outputs = super().step()
        if self.diverged is not None:
            raise self.diverged
        return outputs

    def sampler(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Rank 0 samples, every rank gets its tokens (-1 everywhere: rank 0's sampling failed)."""
        if not self.group.is_driver:
            tokens = self.group.broadcast(torch.empty(len(seqs), dtype=torch.int64, device=logits.device))
            if bool((tokens < 0).all()):
                raise RuntimeError("sampling failed on tensor-parallel rank 0")
            return tokens
        try:
            tokens = super().sampler(logits, seqs).to(torch.int64)
        except Exception:
            self.group.broadcast(torch.full((len(seqs),), -1, dtype=torch.int64, device=logits.device))
            raise
        return self.group.broadcast(tokens)

    # ---- workers
    def serve(self) -> None:
        """A worker's loop: replay rank 0's calls, step when it steps, return when it closes."""
        while True:
            kind, pending = self.group.broadcast_object()
            for call in pending:
                self._replay(call)
            if kind == "close":
                return
            self.step()

    def close(self) -> None:
        """Rank 0: tell the workers to return (the calls still pending are dropped)."""
        self.pending = []
        self.group.broadcast_object(("close", []))

    def _replay(self, call: tuple) -> None:
        if call[0] == "add":
            spec = dict(call[1])
            seq_id, stream = spec.pop("seq_id"), spec.pop("stream")
            seq = Sequence(**spec)
            seq.seq_id, seq.stream = seq_id, stream
            if seq.params.structured_outputs is not None and self.grammars is not None:
                seq.grammar = self.grammars().matcher(seq.params.structured_outputs)
            self.prepare_plan(seq)  # its chunked prompt as rank 0 packed it (Engine.prepare): no fit check
            seq.prepared = True
            Engine.add_request(self, seq)
            self.replayed[seq_id] = seq
        elif call[0] == "abort":
            seq = self.replayed.pop(call[1], None)
            if seq is not None:
                Engine.abort(self, seq)
        elif call[0] == "clear":
            clear_caches(self)
        for i in [i for i, s in self.replayed.items() if s.finished]:
            del self.replayed[i]

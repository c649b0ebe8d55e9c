"""The engine: ``step()`` is schedule → run → postprocess.

Every method runs on one per-(layer, KV head) page pool, under the head plan its spec names
(``reuse.registry``). A step admits waiting requests (the scheduler decides; requests that read
documents get their chunks computed or found in the chunk cache and copied in, relocated), lays out
one token for every decoding request and prompt chunks for prefilling ones under the token budget
(chunked prefill mixed with decode), makes room (evicting cached prefixes and chunks, then
preempting the newest request), runs the forwards (a recovery forward per recovery method, one
forward per head plan; a decode-only batch replays a CUDA graph) and samples.

``LLM`` (offline) and ``AsyncLLMEngine`` (serving) are thin fronts that add requests and call ``step()``.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..cache.chunk_cache import ChunkCache
from ..cache.linear_prefix import StatePrefixCache
from ..cache.prefix_cache import PrefixCache
from ..models.registry import adapter_for
from ..pd.lease import LeaseStore
from ..reuse.registry import get_method
from . import engine_state as state
from .admission import admit
from .detokenizer import IncrementalDetokenizer
from .documents import DocumentKV
from .executor import Executor
from .kv_loading import build_loader
from . import handoff, kv_loading
from .engine_config import EngineConfig
from .lookahead import Ahead, TokensToHost, finish_ahead, launch_ahead, may_look_ahead
from .memory import initial_pages, profile_pages
from .output import OutputProcessor, StepOutput
from .phases import phase
from .plans import build_pool, build_runner
from .sampling import Logprobs, sample
from .scheduler import RequestTooLarge, Scheduler  # noqa: F401  (RequestTooLarge: the fronts import it here)
from .selective import HeadSelection
from .sequence import ReuseState, Sequence

__all__ = ["Engine", "EngineConfig", "RequestTooLarge", "StepOutput"]

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model, config, tokenizer, fingerprint: str, head_config, sparse_ffn, device: torch.device,
                 cfg: EngineConfig | None = None):
        self.cfg = cfg = cfg or EngineConfig()
        self.model, self.config, self.tokenizer, self.device = model, config, tokenizer, device
        self.head_config, self.fingerprint = head_config, fingerprint
        self.dtype = next(model.parameters()).dtype
        self.max_model_len = min(cfg.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.adapter = adapter_for(model, config)
        self.adapter.prepare(device)
        layout = self.adapter.state_layout()  # what a prefill stores per (layer, KV head) and token
        if cfg.enable_prefix_caching and not self.adapter.prefix_caching and not (layout.linear and cfg.linear_state_snapshots):
            log.info("prefix caching is off for %s: its linear-attention layers carry a state over the whole "
                     "prompt, which a cached prefix's pages do not hold (linear_state_snapshots=0)", config.model_type)
            self.cfg = cfg = dataclasses.replace(cfg, enable_prefix_caching=False)
        page_bytes = 2 * cfg.page_size * layout.head_dim * self.dtype.itemsize
        pages, profile = initial_pages(cfg, layout.num_layers, layout.num_kv_heads, page_bytes,
                                       self.max_model_len, device)
        self.documents = DocumentKV(self.adapter, config, fingerprint, head_config, sparse_ffn, cfg.reuse_options, device,
                                    cfg.max_num_batched_tokens)
        self.outputs = OutputProcessor(config.eos_token_ids, self.max_model_len)
        self.honours_cache_salt = True  # Sequence.cache_salt namespaces every cache key it touches
        self.timings = {"schedule": 0.0, "forward": 0.0, "recover": 0.0, "select": 0.0, "sample": 0.0, "steps": 0}
        # per recovery method: the share of a dense prefill's row work its recoveries compute (each
        # measurement weighs half of the mean; 1.0 until one is measured): what admission charges
        self.recovery_share: dict[str, float] = {}
        self._ahead: Ahead | None = None
        self._selection = None
        self.leases = LeaseStore()  # prefilled requests' pages kept for a decode instance to pull
        self.kv_events = cfg.kv_events.build() if cfg.kv_events is not None else None
        self.kv_tiers = cfg.kv_offload.build(pin=device.type == "cuda") if cfg.kv_offload is not None else None
        self._build(pages)
        self.async_decode = self.runner.cuda_graphs if cfg.async_decode is None else cfg.async_decode
        if cfg.selection is not None and cfg.selection.active:
            if self.adapter.state_layout().linear is not None:
                raise ValueError(f"retrieval heads and decode KV budgets (selection) are not supported on "
                                 f"{config.model_type}: its linear-attention layers keep no per-token K/V")
            self.selection = HeadSelection.for_engine(self, cfg.selection)
        if profile:
            pages, memory = profile_pages(self)
            self.resize_pool(pages)
            self.memory = memory

    def _build(self, num_pages: int, plans=None) -> None:
        """The pool of ``num_pages`` pages and everything over it: runner, caches, scheduler."""
        scheduler = getattr(self, "scheduler", None)
        self.pool = build_pool(self.adapter, self.head_config, num_pages, self.cfg.page_size, self.dtype, self.device,
                               self.cfg.max_num_seqs + self.documents.chunk_slots,
                               self.max_model_len, plans,
                               self.cfg.linear_state_snapshots if self.cfg.enable_prefix_caching else 0)
        self.runner = build_runner(self.adapter, self.pool, self.cfg)
        prefix_cache = StatePrefixCache if self.pool.linear_state is not None else PrefixCache  # hybrid: + state
        self.prefix_cache = (prefix_cache(self.pool, self.fingerprint, self.kv_events)
                             if self.cfg.enable_prefix_caching else None)
        self.chunk_cache = ChunkCache(self.pool, self.fingerprint, self.cfg.chunk_cache_bytes, self.kv_tiers,
                                      self.kv_events)
        self.scheduler = Scheduler(self.pool, self.cfg, self.max_model_len, (self.prefix_cache, self.chunk_cache))
        self.kv_loader = build_loader(self.chunk_cache, self.cfg.kv_offload, getattr(self, "kv_loader", None))
        if scheduler is not None:
            self.scheduler.max_num_seqs, self.scheduler.num_preemptions = scheduler.max_num_seqs, scheduler.num_preemptions
        self.documents.attach(self.pool, self.runner, self.chunk_cache, self.prefix_cache, self.scheduler.reclaim)
        self.executor = Executor(self.runner, self.pool, self.config, self.prefix_cache, self.timings,
                                 self.recovery_share)
        self.memory = {"kv_pages": self.pool.num_pages, "kv_bytes": self.pool.num_pages * self.pool.bytes_per_page}
        self.selection = self._selection  # (re)attached to the new pool and runner

    # ------------------------------------------------------------------ requests

    def check_method(self, method: str) -> str:
        spec = get_method(method)
        if spec.needs_head_config and self.head_config is None:
            raise ValueError(f"method={method!r} needs a head_config (a JSON file or HeadConfig)")
        return spec.name

    def prepare_plan(self, seq: Sequence) -> None:
        """Resolve the request's method, its head plan and its document state."""
        seq.method = self.check_method(seq.method)
        spec = get_method(seq.method)
        # a request that starts from another instance's prefill lives under the plan its pages came in
        seq.plan = spec.plan if seq.kv_import is None else seq.kv_import.header.plan
        # a method whose document K/V the model cannot take from elsewhere (a hybrid's recovery methods)
        # prefills the whole prompt in the pool under the method's plan: as after a preemption
        seq.reuse = (ReuseState(seq.chunked_prompt, done=not self.adapter.places_documents(spec))
                     if spec.reads_chunks and seq.kv_import is None else None)

    def prepare(self, seq: Sequence) -> None:
        """``prepare_plan`` and check it can ever run; raises before anything is queued. Documents
        too many to take a page per (layer, KV head) each are packed: runs of those shorter than a
        page share one chunk (and its pages)."""
        self.prepare_plan(seq)
        try:
            self.scheduler.check_fits(seq)
        except RequestTooLarge:
            packed = seq.reuse.prompt.packed(self.pool.page_size) if seq.reuse is not None else None
            if packed is None or packed is seq.reuse.prompt:
                raise
            seq.chunked_prompt, seq.reuse = packed, ReuseState(packed, done=seq.reuse.done)
            self.scheduler.check_fits(seq)
        seq.prepared = True

    def add_request(self, seq: Sequence) -> None:
        """Queue a request (prompt ids, params, method and chunked prompt already set)."""
        if not seq.prepared:
            self.prepare(seq)
        seq.detok = IncrementalDetokenizer(self.tokenizer, lazy=not (seq.stream or seq.params.stop))
        seq.arrival = time.perf_counter()
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        if self.executor.recovering(seq):  # its batch still writes its pages: they go back once it ends
            seq.finish("abort")
            return
        self.scheduler.abort(seq)
        kv_loading.abort(self, seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[StepOutput]:
        """Advance every running request by one scheduled piece of work; returns what changed."""
        if self._ahead is not None:
            outputs = finish_ahead(self)
            if outputs is not None:
                return outputs
        outputs: list[StepOutput] = []
        self.collect_leases()
        with phase(self.timings, "schedule"):
            decode, prefill = self.scheduler.split_running()
            budget = admit(self, self.cfg.max_num_batched_tokens - len(decode), prefill, outputs)
            recovering = [s for s in prefill if s.recovery is not None]
            chunks = self._prompt_chunks([s for s in prefill if s.recovery is None], budget, recovering,
                                         busy=bool(decode))
            batch = self.scheduler.make_room([(s, 1) for s in decode] + chunks, self._preempt,
                                             pinned=self.executor.recovering)
        self.timings["steps"] += 1
        # recoveries take the step's token budget left by decode and prompt chunks, as row-layers
        # (a token through every layer): a long one runs some layers per step, mixed with decode
        left = self.cfg.max_num_batched_tokens - len(decode) - sum(n for _, n in chunks)
        self.executor.row_layers = max(left, 0) * self.config.num_hidden_layers
        # those make_room did not preempt
        recoveries = self.executor.recovery_batches([s for s in recovering if s.recovery is not None])
        groups: dict[str, list[tuple[Sequence, int]]] = {}
        for s, n in batch:
            groups.setdefault(s.plan, []).append((s, n))
        # a decode of every running request and nothing else: its next step can start at once
        ahead = not recoveries and not chunks and len(groups) == 1 and may_look_ahead(self, len(batch))
        for seqs in recoveries:
            self._guarded(seqs, outputs, lambda: self._recover(seqs, outputs))
        for plan, items in groups.items():
            self._guarded([s for s, _ in items], outputs, lambda: self._forward(plan, items, outputs, ahead))
        return outputs

    def _prompt_chunks(self, prompts: list[Sequence], budget: int, recovering: list[Sequence],
                       busy: bool) -> list[tuple[Sequence, int]]:
        """The step's prompt chunks, short prompts first, then the budget the recoveries (under way
        or starting) still need (kept for them), then long prompts: a long dense prompt does not
        slow a recovery down to a few layers a step, and a long recovery does not hold a short
        prompt back. With other work in the step (``busy``: decode) a long prompt's chunk is capped
        (``long_prefill_token_threshold``), so the step stays short for requests arriving during it."""
        short = [s for s in prompts if self.scheduler.short_prompt(s)]
        chunks = self.scheduler.prompt_chunks(short, budget, self._selection_rows)
        budget -= sum(n for _, n in chunks) + self.executor.reserved_tokens(recovering)
        rest = [s for s in prompts if not self.scheduler.short_prompt(s)]
        cap = self.scheduler.prompt_chunk_cap(busy or bool(chunks) or bool(recovering))
        return chunks + self.scheduler.prompt_chunks(rest, budget, self._selection_rows, cap)

    def _recover(self, seqs: list[Sequence], outputs: list[StepOutput]) -> None:
        """The step's piece of a recovery batch; once it ends, its requests sample their first
        token (those aborted while it ran give their pages back instead)."""
        done, logits = self.executor.recover(seqs)
        if not done:
            return
        live = [i for i, s in enumerate(done) if not s.finished]
        for s in done:
            if s.finished:
                self.scheduler.free(s)
        if live:
            rows = logits if len(live) == len(done) else logits[torch.tensor(live, device=logits.device)]
            self._sample([done[i] for i in live], rows, outputs)

    def _guarded(self, seqs: list[Sequence], outputs: list[StepOutput], run) -> None:
        """A failing forward fails its requests, never the engine."""
        try:
            run()
        except Exception as e:
            for s in seqs:
                self._fail(s, e, outputs)

    def _selection_rows(self, seq: Sequence) -> int:
        """Prompt rows the forward completing ``seq``'s prompt must compute (its selection's
        observation window; 0 without one)."""
        return self.selection.prompt_rows(seq.plan) if self.selection is not None else 0

    def _preempt(self, seq: Sequence) -> None:
        # a recovery under way: every request of its batch goes (their pages hold some layers
        # recomputed, the batch cannot resume without it); each re-prefills in the pool
        for other in self.executor.drop_recovery(seq):
            if other is not seq and other.seq_id in self.pool:
                self._requeue(other)
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        if seq.finished:  # aborted while its recovery ran: its pages go back, nothing re-runs
            self.scheduler.free(seq)
            return
        self.scheduler.preempt(seq)
        if self.selection is not None:  # it re-prefills under its plan, and selects again
            seq.plan = self.selection.base_plan(seq.plan)

    # ------------------------------------------------------------------ run

    def _forward(self, plan: str, items: list[tuple[Sequence, int]], outputs: list[StepOutput], ahead: bool) -> None:
        """``ahead``: the batch decodes every running request; its next step is launched from its
        samples before the host reads them."""
        done, logits = self.executor.forward(plan, items)
        if done:
            self._sample(done, logits, outputs, plan if ahead else None)

    # ------------------------------------------------------------------ postprocess

    def sampler(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Token ids [B] sampled on the device, one per request, by its params."""
        return sample(logits, [s.params for s in seqs], [s.generator for s in seqs], [s.grammar for s in seqs])

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, outputs: list[StepOutput],
                plan: str | None = None) -> None:
        """``plan``: the batch decodes every running request under it; the next step's forward is
        launched from the samples before the host reads them (async decode)."""
        with phase(self.timings, "sample"):
            for s, row in zip(seqs, logits):
                if s.params.return_first_logits and s.first_logits is None:
                    s.first_logits = row.float().cpu()
            logprobs = Logprobs(logits, [s.params for s in seqs])  # before the sampler masks the logits
            try:
                sampled = self.sampler(logits, seqs)
                on_way = sampled
                if plan is not None:  # copy these out first, so reading them does not wait for the next step
                    on_way = TokensToHost(sampled)
                    self._ahead = launch_ahead(self, plan, seqs, sampled)
                tokens = on_way.tolist()
            except Exception:  # find the rows that fail and fail only those requests
                tokens = []
                for s, row in zip(seqs, logits):
                    try:
                        tokens.append(self.sampler(row[None], [s]).item())
                    except Exception as e:
                        self._fail(s, e, outputs)
                        tokens.append(None)
            logprobs.record(seqs, tokens)
            self._take_tokens(seqs, tokens, outputs)

    def _take_tokens(self, seqs: list[Sequence], tokens: list, outputs: list[StepOutput]) -> None:
        """Append each request's sampled token (None: its sampling failed), freeing those it ends."""
        now = time.perf_counter()
        for s, t in zip(seqs, tokens):
            if t is None:
                continue
            if s.first_token_time is None:
                s.first_token_time = now
            outputs.append(self.outputs.append(s, t))
            if s.finished:
                if s.kv_export is not None:  # a prefill instance's request: its pages wait for the decode's pull
                    handoff.export(self, s)
                self.scheduler.free(s)

    def _fail(self, seq: Sequence, error: Exception, outputs: list[StepOutput]) -> None:
        seq.error = error.with_traceback(None)  # its frames would keep the failed step's tensors alive
        if isinstance(error, torch.OutOfMemoryError) and self.device.type == "cuda":
            torch.cuda.empty_cache()
        seq.finish("error")
        self.scheduler.free(seq)
        outputs.append(StepOutput(seq))

    @property
    def selection(self) -> HeadSelection | None:
        """Selected sets of retrieval heads and decode budgets, run around each forward (None: off)."""
        return self._selection

    @selection.setter
    def selection(self, value: HeadSelection | None) -> None:
        self._selection = self.executor.selection = value
        if value is not None:
            value.attach(self.pool, self.runner)

    # the scheduler's queues, as the fronts read them
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    num_preemptions = property(lambda self: self.scheduler.num_preemptions)
    max_num_seqs = property(lambda self: self.scheduler.max_num_seqs,
                            lambda self, n: setattr(self.scheduler, "max_num_seqs", n))

    kv_bytes, request_kv_bytes, stats, capacity, capture_graphs = (
        state.kv_bytes, state.request_kv_bytes, state.stats, state.capacity, state.capture_graphs)
    resize_pool, clear_caches, idle = state.resize_pool, state.clear_caches, state.idle
    collect_leases = handoff.collect_leases
    pages_for, pool_pages_for = state.pages_for, state.pool_pages_for

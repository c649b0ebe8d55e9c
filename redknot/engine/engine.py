"""The engine: one scheduler, one model runner, one page pool, one ``step()`` loop.

Every method runs on the same per-(layer, KV head) page pool: ``dense`` and the exact-KV reuse
methods under the all-global head plan, ``headsparse``/``redknot``/``redknot_kv`` under the
model's head config. A step

1. admits waiting requests while sequence slots and pages allow (FIFO), mapping the longest
   cached prompt prefix's pages into each (automatic prefix caching). Chunk-reuse methods first
   have every document they name in the chunk cache (missing ones are prefilled at their
   canonical positions, batched, as short-lived pool sequences whose pages the cache keeps);
   every chunk method then copies the chunks' KV, keys relocated, into the request's pages;
   ``full_reuse``/``epic`` leave the question to the batched prefill (``epic`` recomputes each
   chunk's first tokens), the head-aware recovery methods run their recovery as a row policy in
   one batched forward of the model (``recovery_batch``);
2. schedules one token for every decoding sequence and prompt chunks of prefilling ones under
   the token budget (chunked prefill mixed with decode);
3. makes room: pages for every scheduled token, evicting cached prefixes first and preempting
   the newest running request (recompute: its pages go back, it re-queues, and later re-prefills
   from whatever prefix is still cached) when the pool runs short;
4. runs one forward per head plan in the batch (a decode-only batch replays a CUDA graph),
   samples, and finishes requests on EOS, stop strings or length.

``LLM`` (offline) and ``AsyncLLMEngine`` (serving) are thin fronts that add requests and call
``step()``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..cache import PagePool, PoolExhausted
from ..cache.chunk_cache import ChunkCache, ChunkPages
from ..cache.chunk_store import chunk_key
from ..cache.prefix_cache import PrefixCache
from ..config import GLOBAL_WINDOW, HeadConfig, SparseFFNConfig
from ..models.config import ModelConfig
from ..models.llama import LlamaForCausalLM
from ..reuse.flops import FlopReport, visible_pairs
from ..reuse.methods import REUSE_METHODS, ReuseEngine, ReuseOptions
from .detokenizer import IncrementalDetokenizer
from .model_runner import ModelRunner
from .recovery_batch import RecoveryRows
from .sampling import Logprobs, needs_each_sample, sample
from .selective import HeadSelection, SelectionOptions
from .sequence import Sequence

METHODS = ("dense", "headsparse") + tuple(m for m in REUSE_METHODS if m != "dense")
# The head plan each method's KV lives under in the pool.
PLAN_OF = {m: "headsparse" if m in ("headsparse", "redknot", "redknot_kv") else "dense" for m in METHODS}

# Default pool size when none is given: on a GPU, what is left of gpu_memory_utilization x the
# device's memory once weights, the activations of the largest step (measured) and the CUDA-graph
# reserve are counted (vLLM's rule); on the CPU this many bytes.
CPU_POOL_BYTES = 256 << 20
GRAPH_RESERVE_BYTES = 1 << 30


# Chunk KV copied (relocated) into the request's pages; the rest of the prompt prefills in the pool.
PLACED_METHODS = ("full_reuse", "epic")
# Chunk KV copied into the request's pages, then recomputed in part by a recovery policy.
RECOVERY_METHODS = ("cacheblend", "redknot", "redknot_kv", "redknot_exact")
# Pool sequences set aside for prefilling missing chunks (beside max_num_seqs requests).
CHUNK_SLOTS = 32


def prefills_through_reuse(method: str) -> bool:
    """Methods whose prefill is a recovery forward over the whole prompt at once (the others
    prefill in token-budget chunks)."""
    return method in RECOVERY_METHODS


def uses_chunks(method: str) -> bool:
    """Methods that read document KV from the chunk cache."""
    return method in PLACED_METHODS or method in RECOVERY_METHODS


def _pages_of(entries: dict) -> np.ndarray:
    """Every page id of a set of chunk entries (one entry per reference)."""
    return np.concatenate([e.pages.ravel() for e in entries.values()] + [np.zeros(0, np.int32)])


class RequestTooLarge(ValueError):
    """The request can never fit the pool or the context, whatever else is running."""


@dataclass
class EngineConfig:
    page_size: int = 64
    kv_pages: int | None = None  # None: sized from gpu_memory_utilization (GPU) / CPU_POOL_BYTES
    gpu_memory_utilization: float = 0.9
    # Admit a request only when the pool holds every running request at its full length (no
    # preemption unless sharing or EOS estimates are off); False admits on the first prompt
    # chunk's pages and preempts when decode growth runs short (vLLM's optimistic admission:
    # more requests at once when most stop well before max_tokens).
    reserve_full_length: bool = True
    # ... counting at most this many generated tokens: a request that leaves max_tokens to "what the
    # context has left" does not hold a whole context's pages it will rarely fill (growth past it
    # may preempt, as with optimistic admission).
    reserve_decode_tokens: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Rows one recovery forward starts with at most (every row of each prompt: recovery reads the
    # whole prompt at layer 0), beside the token budget that charges what it computes over all
    # layers; the memory profile sizes the activations for it. None: 4 x max_num_batched_tokens.
    # A prompt longer than this still recovers, alone.
    max_recovery_rows: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    # Launch each decode-only step's next forward, fed by its samples on the device, before the
    # host reads them: the host's bookkeeping then overlaps the GPU's next step (a token a
    # finishing sequence did not need is discarded). None: on where decode replays CUDA graphs.
    async_decode: bool | None = None
    kernel: str = "auto"  # "triton" on CUDA, "torch" (the reference) on CPU
    chunk_cache_bytes: int | None = None  # cap on the pool bytes cached chunks hold (None: the pool)
    reuse_options: ReuseOptions | None = None
    # Retrieval heads' selected sets and per-head decode budgets (H2O); None: retrieval heads global
    selection: SelectionOptions | None = None


class _TokensToHost:
    """Sampled token ids on their way to the host. On CUDA the copy goes into pinned memory as
    soon as it is enqueued, with its own event, so reading it waits for the step that sampled
    them and not for a step launched after it (a plain ``tolist`` would wait for the stream)."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens
        self.host = self.event = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def tolist(self) -> list[int]:
        if self.event is None:
            return self.tokens.tolist()
        self.event.synchronize()
        return self.host.tolist()


@dataclass
class _Ahead:
    """A decode forward launched before the host has read the tokens it continues from."""
    plan: str
    seqs: list[Sequence]
    tokens: _TokensToHost  # what it samples, on the device [len(seqs)], on its way to the host


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""


class Engine:
    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, tokenizer, fingerprint: str,
                 head_config: HeadConfig | None, sparse_ffn: SparseFFNConfig, device: torch.device,
                 cfg: EngineConfig | None = None):
        self.cfg = cfg = cfg or EngineConfig()
        self.model, self.config, self.tokenizer, self.device = model, config, tokenizer, device
        self.head_config = head_config
        self.dtype = next(model.parameters()).dtype
        self.max_model_len = min(cfg.max_model_len or config.max_position_embeddings,
                                 config.max_position_embeddings)
        model.fuse_projections(pack=device.type == "cpu")  # CPU: prepacked GEMM weights (models/linear.py)
        L, hkv = config.num_hidden_layers, config.num_key_value_heads
        plans = {"dense": HeadConfig.all_global(L, hkv)}
        if head_config is not None:
            plans["headsparse"] = head_config
        if not 0 < cfg.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")
        num_pages = cfg.kv_pages
        page_bytes = 2 * cfg.page_size * config.head_dim * self.dtype.itemsize
        profile = num_pages is None and device.type == "cuda"
        self.max_recovery_rows = cfg.max_recovery_rows or 4 * cfg.max_num_batched_tokens
        if self.max_recovery_rows < 1:
            raise ValueError(f"max_recovery_rows must be >= 1, got {cfg.max_recovery_rows}")
        if profile:  # a pool for one largest step, measured below and then resized
            rows = max(cfg.max_num_batched_tokens, self.max_recovery_rows)
            num_pages = L * hkv * (-(-rows // cfg.page_size) + -(-rows // self.max_model_len))
        elif num_pages is None:
            num_pages = max(int(CPU_POOL_BYTES // page_bytes), 1)
        vis = {name: plan.visibility(model_windows=config.sliding_windows) for name, plan in plans.items()}
        self.pool = PagePool(num_pages, cfg.page_size, config.head_dim, *vis["dense"], dtype=self.dtype,
                             device=device)
        self.pool.add_plan("dense", *vis["dense"])
        if "headsparse" in vis:
            self.pool.add_plan("headsparse", *vis["headsparse"])
        self.pool.attach_device_tables(cfg.max_num_seqs + CHUNK_SLOTS, self.max_model_len)
        plan_tensors = {name: (torch.as_tensor(w, dtype=torch.int32).to(device),
                               torch.as_tensor(s, dtype=torch.int32).to(device)) for name, (w, s) in vis.items()}
        self.runner = ModelRunner(model, self.pool, plan_tensors, cfg.max_num_seqs, cfg.cuda_graphs, cfg.kernel)
        self.async_decode = self.runner.cuda_graphs if cfg.async_decode is None else cfg.async_decode
        self._ahead: _Ahead | None = None
        self.prefix_cache = PrefixCache(self.pool, fingerprint) if cfg.enable_prefix_caching else None
        self.fingerprint = fingerprint
        self.honours_cache_salt = True  # Sequence.cache_salt namespaces every cache key it touches
        self.chunk_cache = ChunkCache(self.pool, fingerprint, cfg.chunk_cache_bytes)
        self.reuse = ReuseEngine(model, config, fingerprint, head_config, sparse_ffn, self.chunk_cache,
                                 self.chunk_cache, device, cfg.reuse_options)
        self.reuse.kernel = cfg.kernel  # the recovery oracle attends like the engine
        self._chunk_seq_ids = iter(range(-1, -(1 << 62), -1))  # pool ids of chunk prefills
        self.max_num_seqs = cfg.max_num_seqs  # a front may lower it (never above the slots)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._committed = 0  # pages admission has promised the running requests (their full lengths)
        self._heads = L * hkv
        self._local_heads = max(int((self.pool.window_sink(p)[0] < GLOBAL_WINDOW).sum()) for p in self.pool.plans)
        # host seconds per phase ("select": selected sets and budget checks after a forward)
        self.timings = {"schedule": 0.0, "forward": 0.0, "select": 0.0, "sample": 0.0, "steps": 0}
        # per recovery method: the share of a dense prefill's row work its recoveries compute
        # (RecoveryRows measures it; each measurement weighs half of the mean; 1.0 until one is measured)
        self.recovery_share: dict[str, float] = {}
        self.memory = {"kv_pages": self.pool.num_pages, "kv_bytes": self.pool.num_pages * self.pool.bytes_per_page}
        self.selection = HeadSelection(self, cfg.selection) if cfg.selection is not None and cfg.selection.active else None
        if profile:
            self._size_pool_from_memory()

    def _size_pool_from_memory(self) -> None:
        """Run the largest step once (random token ids: as many rows as a prefill step or a
        recovery forward holds, in prompts of at most max_model_len), measure its activation
        peak, and give the pages what is left of gpu_memory_utilization x the device's memory
        after the weights, everything else on the device, that peak and the CUDA-graph reserve."""
        dev = self.device
        tokens = max(self.cfg.max_num_batched_tokens, self.max_recovery_rows)
        lens = [self.max_model_len] * (tokens // self.max_model_len) + [tokens % self.max_model_len]
        lens = [n for n in lens if n][:self.cfg.max_num_seqs + CHUNK_SLOTS]
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        sids = []
        try:
            for n in lens:
                sid = next(self._chunk_seq_ids)
                self.pool.add_sequence(sid, "dense")
                sids.append(sid)
                self.pool.ensure(sid, n)
            ids = [torch.randint(0, self.config.vocab_size, (n,)).tolist() for n in lens]
            self.runner.forward("dense", sids, ids, [0] * len(sids))
            torch.cuda.synchronize(dev)
        finally:
            for sid in sids:
                self.pool.free_sequence(sid)
        tokens = sum(lens)
        activations = torch.cuda.max_memory_allocated(dev) - base
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        pool_bytes = self.pool.num_pages * self.pool.bytes_per_page
        cached_free = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        others = total - free - cached_free - pool_bytes  # weights, buffers, context, other processes
        graphs = GRAPH_RESERVE_BYTES if self.runner.cuda_graphs else 0
        budget = total * self.cfg.gpu_memory_utilization - others - activations - graphs
        num_pages = int(budget // self.pool.bytes_per_page)
        if num_pages < self.pool.num_pages:
            raise RuntimeError(
                f"gpu_memory_utilization={self.cfg.gpu_memory_utilization} leaves {max(budget, 0) / 2**30:.2f} GiB "
                f"for KV pages after {others / 2**30:.2f} GiB in use and {activations / 2**30:.2f} GiB of "
                f"activations: not even one {tokens}-token step fits; raise it or lower max_num_batched_tokens "
                f"and max_recovery_rows")
        self.resize_pool(num_pages)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.memory = {"gpu_memory_utilization": self.cfg.gpu_memory_utilization, "total_bytes": total,
                       "weights_bytes": weights, "other_bytes": others - weights, "activation_bytes": activations,
                       "graph_reserve_bytes": graphs, "kv_pages": num_pages,
                       "kv_bytes": num_pages * self.pool.bytes_per_page}

    def capacity(self, lengths=(8192, 32768, 131072), new_tokens: int = 256) -> dict:
        """Sessions of each context length (prompt + ``new_tokens``) the whole pool holds at
        once, per head plan: the analytic bound admission works against."""
        out = {}
        for plan in self.pool.plans:
            if plan == "default" or plan.endswith("+sel"):  # selected twins hold what their selection keeps
                continue
            per = {}
            for n in lengths:
                if n + new_tokens > self.max_model_len:
                    continue
                pages = self.pool.peak_pages(n + new_tokens, 1, plan)
                per[n] = {"pages_per_session": pages, "bytes_per_session": pages * self.pool.bytes_per_page,
                          "sessions": self.pool.num_pages // pages}
            out[plan] = per
        return out

    # ------------------------------------------------------------------ requests

    def check_method(self, method: str) -> str:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r} (available: {', '.join(METHODS)})")
        if PLAN_OF[method] == "headsparse" and self.head_config is None:
            raise ValueError(f"method={method!r} needs a head_config (a JSON file or HeadConfig)")
        return method

    def pages_for(self, seq: Sequence) -> int:
        """Pages the request needs at its largest: its whole context under its plan, and while a
        prompt chunk is stored, that chunk's pages for every head; a chunk-reuse request also holds
        its chunks' cached pages (and one chunk prefill's prefix pages) while they are copied in."""
        total = len(seq.token_ids) + seq.params.max_tokens
        chunk = len(seq.token_ids) if seq.method in RECOVERY_METHODS else self.cfg.max_num_batched_tokens
        need = self.pool.peak_pages(total, chunk, seq.plan)
        if uses_chunks(seq.method) and seq.chunked_prompt is not None:
            ps, cp = self.pool.page_size, seq.chunked_prompt
            p = len(cp.prefix)
            per_head = sum(-(-(p % ps + len(c)) // ps) for c in cp.chunks) + 2 * (-(-p // ps)) + 1
            need += per_head * self._heads
        return need

    def _steady_pages(self, seq: Sequence) -> int:
        """Pages the request holds at its full length (prompt + max_tokens, at most
        reserve_decode_tokens of them) once decoding under its plan: what admission commits for it,
        so running requests do not outgrow the pool."""
        decode = min(seq.params.max_tokens, self.cfg.reserve_decode_tokens)
        return self.pool.peak_pages(len(seq.token_ids) + decode, 1, seq.plan)

    def _headroom(self, capped: bool = True) -> int:
        """Pages kept out of the commitments for what prefill holds only for a while: local heads'
        pages of one token budget, stored before trim drops them (at most an eighth of the pool)."""
        per_head = -(-self.cfg.max_num_batched_tokens // self.pool.page_size) + 1
        need = self._local_heads * per_head
        return min(need, self.pool.num_pages // 8) if capped else need

    def _admission_pages(self, seq: Sequence, budget: int | None = None) -> int:
        """Free pages admission asks for a request's first step: its first prompt chunk under its
        plan (the whole prompt for a recovery, the suffix for a chunk-reuse request, else what
        the step's token ``budget`` takes), plus one page per head for the token after it."""
        chunked = uses_chunks(seq.method) and not seq.reuse_done
        if chunked and seq.method in RECOVERY_METHODS:
            first = len(seq.token_ids)
        elif chunked:
            if seq.chunked_prompt is None:  # laid out later (check_fits before it): pages_for counts it
                return 0
            first = seq.chunked_prompt.suffix_start
        else:
            first = min(seq.num_pending, self.cfg.max_num_batched_tokens if budget is None else budget)
        return self.pool.pages_needed(first, plan=seq.plan).peak + self._heads

    def pool_pages_for(self, seq: Sequence) -> int:
        """The smallest pool that admits this request on its own (``check_fits`` on a pool of that
        size, and admission's first step in it): what a harness that runs one request at a time
        sizes its pool by (``resize_pool``). The headroom grows with the pool (an eighth of it, up
        to its uncapped size)."""
        steady, headroom = self._steady_pages(seq), self._headroom(capped=False)
        pages = max(self.pages_for(seq), steady, self._admission_pages(seq))
        while pages < steady + min(headroom, pages // 8):
            pages += 1
        return pages

    def check_fits(self, seq: Sequence) -> None:
        n = len(seq.token_ids)
        if n + seq.params.max_tokens > self.max_model_len:
            raise RequestTooLarge(f"prompt ({n} tokens) + max_tokens ({seq.params.max_tokens}) exceeds the "
                                  f"model's {self.max_model_len} (max_model_len)")
        need = max(self.pages_for(seq), self._steady_pages(seq) + self._headroom())
        if need > self.pool.num_pages:
            raise RequestTooLarge(f"the request needs {need} KV pages ({need * self.pool.bytes_per_page} bytes) "
                                  f"under plan {seq.plan!r}; the pool has {self.pool.num_pages}")

    def prepare(self, seq: Sequence) -> None:
        """Set the request's head plan and check it can ever run; raises before anything is queued."""
        self.check_method(seq.method)
        seq.plan = PLAN_OF[seq.method]
        self.check_fits(seq)
        seq.prepared = True

    def add_request(self, seq: Sequence) -> None:
        """Queue a request (prompt ids, params, method and chunked prompt already set)."""
        if not seq.prepared:
            self.prepare(seq)
        seq.detok = IncrementalDetokenizer(self.tokenizer, lazy=not (seq.stream or seq.params.stop))
        seq.arrival = time.perf_counter()
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self._free(seq)
        if seq.finish_reason is None:
            seq.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[StepOutput]:
        """Advance every running request by one scheduled piece of work; returns what changed."""
        if self._ahead is not None:
            outputs = self._step_ahead()
            if outputs is not None:
                return outputs
        t0 = time.perf_counter()
        outputs: list[StepOutput] = []
        budget = self.cfg.max_num_batched_tokens
        decode, prefill = [], []
        for s in self.running:
            (decode if s.num_pending == 1 and s.num_computed > 0 else prefill).append(s)
        budget -= len(decode)
        budget = self._admit(budget, prefill, outputs)
        recovering = [s for s in prefill if s.recovery is not None]
        prefill = [s for s in prefill if s.recovery is None]
        chunks = []
        for s in prefill:
            if budget <= 0:
                break
            n = min(s.num_pending, budget)
            tail = min(self._selection_rows(s), self.cfg.max_num_batched_tokens)  # a budget that fits it
            if n < s.num_pending < n + tail:  # the last chunk keeps the selection's rows
                n = s.num_pending - tail
                if n <= 0:
                    continue  # all of it in one later step, with more budget
            chunks.append((s, n))
            budget -= n
        batch = self._make_room([(s, 1) for s in decode] + chunks)
        self.timings["schedule"] += time.perf_counter() - t0
        self.timings["steps"] += 1
        by_method: dict[str, list[Sequence]] = {}
        for s in recovering:  # not preempted by _make_room
            if s.recovery is not None:
                by_method.setdefault(s.method, []).append(s)
        for seqs in by_method.values():
            try:
                self._recover(seqs, outputs)
            except Exception as e:
                for s in seqs:
                    self._fail(s, e, outputs)
        groups: dict[str, list[tuple[Sequence, int]]] = {}
        for s, n in batch:
            groups.setdefault(s.plan, []).append((s, n))
        # a decode of every running request and nothing else: its next step can start at once
        ahead = not by_method and not chunks and len(groups) == 1 and self._may_look_ahead(len(batch))
        for plan, items in groups.items():
            try:
                self._forward(plan, items, outputs, ahead)
            except Exception as e:  # a failing forward fails its requests, never the engine
                for s, _ in items:
                    self._fail(s, e, outputs)
        return outputs

    def _admit(self, budget: int, prefill: list[Sequence], outputs: list[StepOutput]) -> int:
        recovery_rows = 0  # rows the step's recovery forwards start with
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.abandoned:  # its client has gone: nothing it would compute is read
                self.waiting.popleft()
                seq.finish_reason = seq.finish_reason or "abort"
                outputs.append(StepOutput(seq))
                continue
            chunked = uses_chunks(seq.method) and not seq.reuse_done
            recovers = chunked and seq.method in RECOVERY_METHODS
            if recovers and recovery_rows and recovery_rows + len(seq.token_ids) > self.max_recovery_rows:
                break  # its layer-0 rows would push the recovery forward past its activation size
            steady = self._steady_pages(seq)
            if self.cfg.reserve_full_length and self._committed + steady + self._headroom() > self.pool.num_pages:
                break  # the running requests' full contexts leave no room for this one's yet
            need = self._admission_pages(seq, budget)
            keep, kept_pages, missing = set(), 0, 0
            if chunked:  # its cached chunks must stay, its missing chunks' prefills need pages too
                specs = self._chunk_specs(seq)
                keep, kept_pages, missing = self._chunk_needs(specs)
            if need + missing > self.pool.num_free_pages + self._cached_pages() - kept_pages:
                if self._cannot_wait(seq, outputs):
                    continue
                break  # even emptying the caches would not make room: keep them and wait
            if need + missing > self.pool.num_free_pages:
                self._reclaim(need + missing - self.pool.num_free_pages, keep)
            if need + missing > self.pool.num_free_pages:
                if self._cannot_wait(seq, outputs):
                    continue
                break  # wait for pages (FIFO: nobody overtakes); nothing computed for it yet
            pinned = None
            if chunked:
                try:
                    pinned, computed = self._ensure_chunks(seq, specs, need)
                except PoolExhausted:
                    if self._cannot_wait(seq, outputs):
                        continue
                    break  # its missing chunks do not fit beside the running requests yet
                except Exception as e:
                    self.waiting.popleft()
                    self._fail(seq, e, outputs)
                    continue
                budget -= computed
            self.waiting.popleft()
            self.pool.add_sequence(seq.seq_id, seq.plan)
            self.running.append(seq)
            if seq.scheduled_time is None:
                seq.scheduled_time = time.perf_counter()
            seq.committed_pages = steady
            self._committed += steady
            if chunked:
                try:
                    self._place_chunks(seq, specs, pinned)
                except Exception as e:
                    self._fail(seq, e, outputs)
                finally:
                    self.pool.release(_pages_of(pinned))
                if seq.finished:
                    continue
                if seq.recovery is not None:
                    n = len(seq.token_ids)
                    recovery_rows += n
                    budget -= math.ceil(self.recovery_share.get(seq.method, 1.0) * n)
                    prefill.append(seq)
                    continue
            elif self.prefix_cache is not None and seq.num_computed == 0:
                limit = len(seq.token_ids) - max(1, self._selection_rows(seq))
                n, table = self.prefix_cache.match(seq.plan, seq.token_ids, limit, seq.cache_salt) if limit > 0 else (0, None)
                if n:
                    self.pool.share(seq.seq_id, table, n)
                    seq.num_computed = n
                    seq.cached_tokens = max(seq.cached_tokens, n)
            if seq.prefill_start is None:
                seq.prefill_start = seq.num_computed
            prefill.append(seq)
        return budget

    def _selection_rows(self, seq: Sequence) -> int:
        """Prompt rows the forward completing ``seq``'s prompt must compute (its selection's
        observation window; 0 without one)."""
        return self.selection.prompt_rows(seq.plan) if self.selection is not None else 0

    def _cannot_wait(self, seq: Sequence, outputs: list[StepOutput]) -> bool:
        """With nothing running and the caches empty, no page will ever come back: fail the
        request at the head of the queue (``check_fits`` refuses such requests up front; this
        keeps the engine from waiting forever should a request slip through)."""
        if self.running:
            return False
        if self._reclaim(self.pool.num_pages):
            return False  # cached pages came back: the next step tries again
        self.waiting.popleft()
        self._fail(seq, RequestTooLarge(f"the request does not fit the empty pool of {self.pool.num_pages} "
                                        f"pages"), outputs)
        return True

    def _cached_pages(self) -> int:
        """Pages the prefix and chunk caches reference (an upper bound on what evicting frees)."""
        return self.chunk_cache.num_pages() + (self.prefix_cache.num_pages() if self.prefix_cache else 0)

    def idle(self) -> bool:
        """No request holds a page: every page is free or referenced by the caches only."""
        ids = [self.chunk_cache.page_ids()] + ([self.prefix_cache.page_ids()] if self.prefix_cache else [])
        cached = np.unique(np.concatenate(ids)).size
        return not self.has_unfinished() and self.pool.num_free_pages + cached == self.pool.num_pages

    def _reclaim(self, pages: int, keep=()) -> int:
        """Free up to ``pages`` pages from the caches: cached prefixes first, then chunks (LRU),
        keeping the chunks keyed in ``keep``."""
        freed = self.prefix_cache.evict(pages) if self.prefix_cache is not None else 0
        if freed < pages:
            freed += self.chunk_cache.evict(pages - freed, keep)
        return freed

    def _chunk_needs(self, specs: list) -> tuple[set, int, int]:
        """(keys of the request's chunks already cached, their pages, pages the prefills of the
        missing ones hold at most: every head of each, prefix included)."""
        hits, hit_pages, missing, seen = set(), 0, 0, set()
        for key, tokens, _ in specs:
            if key in seen:
                continue
            seen.add(key)
            entry = self.chunk_cache.peek(key)
            if entry is None:
                missing += self._heads * -(-len(tokens) // self.pool.page_size)
            else:
                hits.add(key)
                hit_pages += entry.pages.size
        return hits, hit_pages, missing

    # ------------------------------------------------------------------ chunks

    def _chunk_specs(self, seq: Sequence) -> list[tuple[str, tuple, int]]:
        """(key, canonical tokens, start) of the prompt prefix (computed alone) and of each chunk
        (computed after the prefix, at its canonical position)."""
        cp = seq.chunked_prompt
        prefix = tuple(cp.prefix)
        ns = self._namespace(seq)
        specs = [(chunk_key(ns, (), prefix), prefix, 0)] if prefix else []
        specs += [(chunk_key(ns, prefix, ids), prefix + tuple(ids), len(prefix)) for ids in cp.chunks]
        return specs

    def _namespace(self, seq: Sequence) -> str:
        """The chunk keys' namespace: the model fingerprint, salted by the request's cache_salt."""
        return self.fingerprint if seq.cache_salt is None else f"{self.fingerprint}\x1fsalt:{seq.cache_salt}"

    def _ensure_chunks(self, seq: Sequence, specs: list, reserve: int) -> tuple[dict, int]:
        """Put every chunk the request names into the chunk cache, prefilling the missing ones in
        batches; the entries' pages are pinned (one reference each) until the caller releases
        them. ``reserve`` pages must stay free for the request itself. Returns (key -> entry,
        tokens computed). Raises PoolExhausted, keeping what it cached, when pages run short."""
        entries, missing = {}, {}
        for key, tokens, start in specs:
            if key in entries or key in missing:
                continue
            entry = self.chunk_cache.lookup(key)
            if entry is None:
                missing[key] = (tokens, start)
            else:
                entries[key] = entry
        self.pool.retain(_pages_of(entries))
        try:
            computed = self._prefill_chunks(list(missing.items()), reserve, entries, seq.cache_salt)
        except BaseException:
            self.pool.release(_pages_of(entries))
            raise
        seq.fresh_chunk_tokens = sum(len(t) - s for t, s in missing.values())
        return entries, computed

    def _prefill_chunks(self, missing: list, reserve: int, entries: dict, salt: str | None) -> int:
        """Prefill chunks at their canonical positions as short-lived dense pool sequences (from
        any cached prefix), CHUNK_SLOTS and one token budget at a time; the chunk cache keeps
        their pages. Adds each pinned entry to ``entries``; returns tokens computed."""
        computed = 0
        while missing:
            group, tokens = [], 0
            while missing and len(group) < CHUNK_SLOTS and (not group or tokens + len(missing[0][1][0])
                                                            <= self.cfg.max_num_batched_tokens):
                group.append(missing.pop(0))
                tokens += len(group[-1][1][0])
            ids, cached = [], []
            try:
                for key, (toks, start) in group:
                    sid = next(self._chunk_seq_ids)
                    self.pool.add_sequence(sid, "dense")
                    ids.append(sid)
                    m = 0
                    if self.prefix_cache is not None:
                        m, table = self.prefix_cache.match("dense", toks, len(toks) - 1, salt)
                        if m:
                            self.pool.share(sid, table, m)
                    cached.append(m)
                    need = self.pool.pages_needed(len(toks), m).peak + reserve
                    if need > self.pool.num_free_pages:
                        self._reclaim(need - self.pool.num_free_pages, entries)
                    if need > self.pool.num_free_pages:
                        raise PoolExhausted(f"a chunk prefill needs {need} pages, {self.pool.num_free_pages} are free")
                    self.pool.ensure(sid, len(toks))
                self.runner.forward("dense", ids, [g[1][0][m:] for g, m in zip(group, cached)], cached)
                computed += sum(len(g[1][0]) - m for g, m in zip(group, cached))
                ps = self.pool.page_size
                for sid, (key, (toks, start)) in zip(ids, group):
                    table = self.pool.table(sid)
                    if self.prefix_cache is not None:
                        self.prefix_cache.insert("dense", toks, table, salt)
                    pages = table[:, :, start // ps:-(-len(toks) // ps)]
                    self.chunk_cache.insert(key, toks[start:], start, pages, start % ps)
                    # pinned for this request (also when the cache is capped below its size)
                    entries[key] = self.chunk_cache.peek(key) or ChunkPages(tuple(toks[start:]), start, pages.copy(),
                                                                            start % ps)
                    self.pool.retain(entries[key].pages)
            finally:
                for sid in ids:
                    self.pool.free_sequence(sid)
        return computed

    def _make_room(self, batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Ensure pages for every scheduled token; evict cached prefixes, then preempt the newest
        running requests, while the pool is short. Returns the part of the batch that runs."""
        out = []
        for s, n in batch:
            while True:
                if s.seq_id not in self.pool:  # preempted to make room for an earlier one
                    break
                try:
                    self.pool.ensure(s.seq_id, s.num_computed + n)
                    out.append((s, n))
                    break
                except PoolExhausted:
                    need = self.pool.pages_needed(s.num_computed + n, self.pool.length(s.seq_id), s.plan).peak
                    if self._reclaim(need):
                        continue
                    victim = next((v for v in reversed(self.running) if v is not s), None)
                    if victim is None:
                        if n > 1:  # a prompt chunk: try a smaller one next step
                            break
                        raise
                    self._preempt(victim)
                    out = [(v, m) for v, m in out if v is not victim]
        return out

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the request's pages and queue it first; it re-prefills its
        prompt and the tokens it has generated (in the pool, from any cached prefix)."""
        self._free(seq)
        seq.num_computed = 0
        seq.recovery = None
        if self.selection is not None:  # it re-prefills under its plan, and selects again
            seq.plan = self.selection.base_plan(seq.plan)
        seq.reuse_done = True  # its re-prefill runs in the pool, not through the reuse engine
        seq.exact_kv = True
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _forward(self, plan: str, items: list[tuple[Sequence, int]], outputs: list[StepOutput],
                 ahead: bool = False) -> None:
        """``ahead``: the batch is a decode of every running request; its samples launch the next
        step before the host reads them."""
        t0 = time.perf_counter()
        if self.selection is not None:
            self.selection.begin(plan, items)
        logits = self.runner.forward(plan, [s.seq_id for s, _ in items],
                                     [s.token_ids[s.num_computed:s.num_computed + n] for s, n in items],
                                     [s.num_computed for s, _ in items])
        self.timings["forward"] += time.perf_counter() - t0
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
                    s.flops = self._prefill_flops(s)
        if self.selection is not None:
            t0 = time.perf_counter()
            self.selection.end()
            self.timings["select"] += time.perf_counter() - t0
        if not done:
            return
        rows = logits if len(done) == len(items) else logits[torch.tensor(done, device=logits.device)]
        seqs = [items[i][0] for i in done]
        self._sample(seqs, rows, outputs, plan if ahead else None)

    def _place_chunks(self, seq: Sequence, specs: list, entries: dict) -> None:
        """Copy the prompt prefix's and every chunk's cached KV into the request's own pages, keys
        rotated from the chunk's canonical position to where it sits (one store per piece, all
        layers at once). ``full_reuse`` and ``epic`` (which then recomputes each chunk's first
        tokens in place) leave the question to the batched prefill; a recovery method gets pages
        for its whole prompt and its recovery policy, run by the next forward."""
        cp = seq.chunked_prompt
        recovering = seq.method in RECOVERY_METHODS
        end = len(seq.token_ids) if recovering else cp.suffix_start
        self.pool.ensure(seq.seq_id, end)
        tables = self._device_tables(seq)
        rope = self.model.model.rotary_emb
        L = self.config.num_hidden_layers
        positions = [0] * bool(cp.prefix) + list(cp.chunk_starts)
        with torch.inference_mode():
            for (key, _, start), pos in zip(specs, positions):
                entry = entries[key]
                k, v = self.chunk_cache.gather(entry)
                n = entry.num_tokens
                if pos != start:
                    h, d = k.shape[2:]
                    k = rope.relocate(k.reshape(L * n, h, d), pos - start).view(L, n, h, d)
                cu = torch.arange(0, (L + 1) * n, n, dtype=torch.int32, device=self.device)
                lens = torch.full((L,), pos + n, dtype=torch.int32, device=self.device)
                self.runner.attn.store(k.reshape(L * n, *k.shape[2:]), v.reshape(L * n, *v.shape[2:]),
                                       tables, cu, lens)
        seq.reuse_done = True
        seq.exact_kv = False  # reused chunk KV: never offered to the prefix cache
        if recovering:
            seq.recovery = self.reuse.policy(cp, seq.method, seq.budget)
            cached = len(cp.prefix) if seq.method == "redknot_exact" else cp.suffix_start
            seq.cached_tokens = max(0, cached - seq.fresh_chunk_tokens)
            return
        seq.recomputed = []
        if seq.method == "epic":
            e = (seq.budget or {}).get("epic_tokens", self.reuse.options.epic_tokens)
            spans = [(s, min(e, len(c))) for c, s in zip(cp.chunks, cp.chunk_starts)]
            if spans:
                self.runner.forward("dense", [seq.seq_id] * len(spans),
                                    [seq.token_ids[s:s + n] for s, n in spans], [s for s, _ in spans])
                seq.recomputed = [p for s, n in spans for p in range(s, s + n)]
        seq.num_computed = end
        seq.cached_tokens = end - seq.fresh_chunk_tokens

    def _device_tables(self, seq: Sequence) -> torch.Tensor:
        """The sequence's block tables on the device, int32 [L, Hkv, pages] (synced first): where
        K/V computed outside the model runner are stored."""
        self.pool.sync_device_tables()
        slot = torch.tensor([self.pool.slot(seq.seq_id)], device=self.device)
        return self.pool.device_tables.index_select(1, slot)[:, 0]

    def _recover(self, seqs: list[Sequence], outputs: list[StepOutput]) -> None:
        """One batched recovery forward for requests of one method (their chunks already in their
        pages); each request's pages are then trimmed to its plan and its first token sampled."""
        t0 = time.perf_counter()
        prompts = [s.token_ids[:s.num_prompt] for s in seqs]
        rows = RecoveryRows(self.config, [s.recovery[0] for s in seqs], [len(p) for p in prompts],
                            [s.recovery[1] for s in seqs], self.device)
        logits = self.runner.recover([s.seq_id for s in seqs], prompts, rows)
        self.timings["forward"] += time.perf_counter() - t0
        for s, report, r in zip(seqs, rows.flops(), rows.requests):
            prev = self.recovery_share.get(s.method)
            self.recovery_share[s.method] = r.row_share if prev is None else (prev + r.row_share) / 2
            s.recovery = None
            s.num_computed = s.num_prompt
            s.flops = report.totals()
            self.pool.trim(s.seq_id)
        self._sample(seqs, logits, outputs)

    def _prefill_flops(self, seq: Sequence) -> dict:
        """What the pool prefill of a request executed: every position it computed (from its
        first uncached one, and ``epic``'s recomputed chunk heads), under its plan's windows."""
        window, sink = (torch.as_tensor(x) for x in self.pool.window_sink(seq.plan))
        q_pos = torch.tensor(seq.recomputed + list(range(seq.prefill_start, seq.num_prompt)), dtype=torch.int64)
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        report = FlopReport()
        for layer in range(self.config.num_hidden_layers):
            pairs = visible_pairs(q_pos, window[layer], sink[layer], group)
            report.add_layer(self.config, q_pos.numel(), pairs, q_pos.numel())
        report.add_lm_head(self.config)
        return report.totals()

    # ------------------------------------------------------------------ tokens

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, outputs: list[StepOutput],
                plan: str | None = None) -> None:
        """``plan``: the batch is a decode of every running request under it; the next step's
        forward is launched from the samples before the host reads them (async_decode)."""
        t0 = time.perf_counter()
        self._sample_rows(seqs, logits, outputs, plan)
        self.timings["sample"] += time.perf_counter() - t0

    def _step_ahead(self) -> list[StepOutput] | None:
        """The step whose forward the last one launched: its positions count as computed, the
        next one is launched the same way while nothing else waits, then the host reads its
        samples. None when none of its requests still runs (the step then schedules afresh)."""
        ahead, self._ahead = self._ahead, None
        running = {id(s) for s in self.running}
        keep = [i for i, s in enumerate(ahead.seqs) if id(s) in running and s.finish_reason is None]
        if not keep:
            return None
        t0 = time.perf_counter()
        seqs = [ahead.seqs[i] for i in keep]
        tokens = ahead.tokens.tokens
        if len(keep) < len(ahead.seqs):
            tokens = tokens[torch.tensor(keep, device=self.device)]
        for s in seqs:
            s.num_computed += 1
            self.pool.trim(s.seq_id)
        self.timings["steps"] += 1
        outputs: list[StepOutput] = []
        if self._may_look_ahead(len(seqs)):
            self._ahead = self._launch_ahead(ahead.plan, seqs, tokens)
        ids = ahead.tokens.tolist()
        self._take_tokens(seqs, [ids[i] for i in keep], outputs)
        self.timings["sample"] += time.perf_counter() - t0
        return outputs

    def _may_look_ahead(self, decoding: int) -> bool:
        """Whether a decode of ``decoding`` sequences may launch the next step ahead: async decode
        is on, they are every running request, and no waiting request could start at the next
        step (none waits, or every slot is taken). A step the head selection needs is not
        launched ahead (``_launch_ahead``)."""
        return (self.async_decode and decoding == len(self.running)
                and (not self.waiting or len(self.running) >= self.max_num_seqs)
                and not any(needs_each_sample(s) for s in self.running))

    def _launch_ahead(self, plan: str, seqs: list[Sequence], tokens: torch.Tensor) -> _Ahead | None:
        """Launch the decode of ``tokens`` (sampled on the device, one per sequence, not yet
        appended) at each sequence's next position; sequences the token ends by length are left
        out. None when nothing is launched (no page to spare, or the forward fails: the next step
        then computes these positions as usual and meets the error itself)."""
        picks = [i for i, s in enumerate(seqs)
                 if len(s.token_ids) + 1 - s.num_prompt < s.params.max_tokens and len(s.token_ids) + 1 < self.max_model_len]
        if not picks:
            return None
        chosen = [seqs[i] for i in picks]
        if self.selection is not None and self.selection.needed_by_decode(plan, chosen):
            return None  # it runs as a plain step, with the selection around its forward
        try:
            for s in chosen:
                self.pool.ensure(s.seq_id, s.num_computed + 1)
            ids = tokens if len(picks) == len(seqs) else tokens[torch.tensor(picks, device=tokens.device)]
            logits = self.runner.forward(plan, [s.seq_id for s in chosen], ids, [s.num_computed for s in chosen])
            nxt = _TokensToHost(sample(logits, [s.params for s in chosen], [s.generator for s in chosen]))
        except Exception:
            return None
        return _Ahead(plan, chosen, nxt)

    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor, outputs: list[StepOutput],
                     plan: str | None = None) -> None:
        for s, row in zip(seqs, logits):
            if s.params.return_first_logits and s.first_logits is None:
                s.first_logits = row.float().cpu()
        logprobs = Logprobs(logits, [s.params for s in seqs])  # before sample() masks the logits
        try:
            sampled = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], [s.grammar for s in seqs])
            on_way = sampled
            if plan is not None:  # copy these out first, so reading them does not wait for the next step
                on_way = _TokensToHost(sampled)
                self._ahead = self._launch_ahead(plan, seqs, sampled)
            tokens = on_way.tolist()
        except Exception:  # find the rows that fail and fail only those requests
            tokens = []
            for s, row in zip(seqs, logits):
                try:
                    tokens.append(sample(row[None], [s.params], [s.generator], [s.grammar]).item())
                except Exception as e:
                    self._fail(s, e, outputs)
                    tokens.append(None)
        logprobs.record(seqs, tokens)
        self._take_tokens(seqs, tokens, outputs)

    def _take_tokens(self, seqs: list[Sequence], tokens: list, outputs: list[StepOutput]) -> None:
        """Append each sequence's sampled token (None: its sampling failed), finishing and
        freeing those it ends."""
        now = time.perf_counter()
        for s, t in zip(seqs, tokens):
            if t is None:
                continue
            if s.first_token_time is None:
                s.first_token_time = now
            outputs.append(self._append(s, t))
            if s.finished:
                self._free(s)

    def _append(self, seq: Sequence, token: int) -> StepOutput:
        p = seq.params
        seq.token_ids.append(token)
        out = StepOutput(seq, [token])
        if not p.ignore_eos and token in self.config.eos_token_ids or token in p.stop_token_ids:
            seq.finish_reason = "stop"  # the stop token's text is not part of the output
            out.new_text = seq.detok.flush()
            return out
        delta = seq.detok.add(token)
        if p.stop:  # held-back text counts too: a stop string may end inside a split character
            text = seq.detok.text + seq.detok.pending()
            tail_start = max(0, len(text) - len(delta) - len(seq.detok.pending())
                             - max(len(x) for x in p.stop) + 1)
            hits = [h for h in (text.find(x, tail_start) for x in p.stop) if h >= 0]
            if hits:
                seq.detok.text = text[:min(hits)]  # the stop string is not part of the output
                seq.finish_reason = "stop"
                return out
        if len(seq.token_ids) - seq.num_prompt >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            delta += seq.detok.flush()
            seq.finish_reason = "length"
        out.new_text = delta
        return out

    def _fail(self, seq: Sequence, error: Exception, outputs: list[StepOutput]) -> None:
        # without its traceback: the frames would keep the failed step's tensors alive
        seq.error = error.with_traceback(None)
        if isinstance(error, torch.OutOfMemoryError) and self.device.type == "cuda":
            torch.cuda.empty_cache()
        seq.finish_reason = "error"
        if seq in self.running:
            self._free(seq)
        outputs.append(StepOutput(seq))

    def _free(self, seq: Sequence) -> None:
        self._committed -= seq.committed_pages
        seq.committed_pages = 0
        if seq.seq_id in self.pool:
            seq.pages_at_finish = self.pool.pages_held(seq.seq_id)
            self.pool.free_sequence(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)

    # ------------------------------------------------------------------ state

    def kv_bytes(self) -> int:
        """Bytes of KV pages in use (shared pages once), cached prefixes included."""
        return (self.pool.num_pages - self.pool.num_free_pages) * self.pool.bytes_per_page

    def capture_graphs(self, max_len: int | None = None) -> int:
        """Capture the decode CUDA graphs for contexts up to ``max_len`` (default 8192) now."""
        return self.runner.capture(min(max_len or 8192, self.max_model_len))

    def request_kv_bytes(self, outputs: list[StepOutput] = ()) -> int:
        """Bytes of the pages requests hold: the running ones, and those that finished in
        ``outputs`` counted at their last length (their pages are already back)."""
        pages = sum(self.pool.pages_held(s.seq_id) for s in self.running)
        for o in outputs:
            if o.seq.finished and o.seq not in self.running:
                pages += o.seq.pages_at_finish
        return pages * self.pool.bytes_per_page

    def resize_pool(self, num_pages: int) -> None:
        """Rebuild the page pool with ``num_pages`` pages (only while nothing runs)."""
        if self.has_unfinished():
            raise RuntimeError("resize_pool while requests are running")
        self._ahead = None  # a finished request's unneeded next step
        old = self.pool
        self.chunk_cache.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.pool = PagePool(num_pages, old.page_size, old.head_dim, old.window, old.sink, dtype=old.dtype,
                             device=old.device)
        for name in old.plans:
            self.pool.add_plan(name, *old.window_sink(name))
        self.pool.attach_device_tables(self.cfg.max_num_seqs + CHUNK_SLOTS, self.max_model_len)
        del old
        self.runner = ModelRunner(self.model, self.pool, self.runner.plans, self.cfg.max_num_seqs,
                                  self.cfg.cuda_graphs, self.cfg.kernel)
        if self.prefix_cache is not None:
            self.prefix_cache = PrefixCache(self.pool, self.prefix_cache.fingerprint)
        self.chunk_cache = ChunkCache(self.pool, self.fingerprint, self.cfg.chunk_cache_bytes)
        self.reuse.store = self.reuse.prefix_store = self.chunk_cache
        if getattr(self, "selection", None) is not None:
            self.selection.attach()
        if self.pool.device.type == "cuda":  # the old pool's memory back to the device, for other processes
            torch.cuda.empty_cache()

    def stats(self) -> dict:
        occ = self.pool.occupancy()
        return {"running": len(self.running), "waiting": len(self.waiting), "preemptions": self.num_preemptions,
                "pool_pages": occ, "page_bytes": self.pool.bytes_per_page, "kv_bytes": self.kv_bytes(),
                "prefix_cache_pages": self.prefix_cache.num_pages() if self.prefix_cache else 0,
                "prefix_cache_hit_tokens": self.prefix_cache.hits if self.prefix_cache else 0,
                "chunk_cache": self.chunk_cache.stats()}

    def clear_caches(self) -> None:
        """Drop every cached prefix and chunk (benchmarks measure cold starts with this)."""
        self.chunk_cache.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

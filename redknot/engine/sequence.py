"""A request's state as the engine advances it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

import torch

from .sampling import SamplingParams

_ids = itertools.count()


class SequenceStatus(str, Enum):
    WAITING = "waiting"  # queued (also after a preemption)
    WAITING_FOR_KV = "waiting_for_kv"  # parked while its documents' KV loads from a tier below the pool
    RUNNING = "running"  # admitted: holds pages, prefills or decodes
    FINISHED = "finished"  # finish_reason says why


@dataclass(eq=False)
class ReuseState:
    """What a request that reads document KV carries between admission and its recovery."""
    prompt: object  # the ChunkedPrompt (prefix, documents, question)
    done: bool = False  # its chunks are placed (or skipped after a preemption: it re-prefills in the pool)
    fresh_chunk_tokens: int = 0  # chunk and prefix tokens computed for this request (not cache hits)
    recomputed: list[int] = field(default_factory=list)  # positions recomputed in place (epic)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (start, tokens) its first prefill forward recomputes
    specs: list | None = None  # (key, canonical tokens, start) of its prefix and chunks, hashed once
    recovery: tuple | None = None  # recovery methods before their recovery forward: (Policy, cached bool [N])
    tiers_tried: bool = False  # its missing documents were looked for below the pool (asynchronously)
    loaded: dict = field(default_factory=dict)  # key -> ChunkPages loaded for it alone (some heads; it holds them)
    linear: object | None = None  # a hybrid's placed linear state: reuse.flops.LinearReuse (its FLOPs)
    linear_pieces: dict | None = None  # a hybrid's chunk key -> cache.linear_chunks.LinearChunk, until placed


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    method: str = "dense"  # a registry name (reuse.registry)
    budget: dict | None = None  # the method's knobs for this request ("cacheblend@0.3": registry.parse_method)
    chunked_prompt: object | None = None  # methods reading document KV: the ChunkedPrompt (prefix, documents, suffix)
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # tokens whose KV is in the pool
    plan: str = "dense"  # the head plan its pages live under (set by the engine from the method)
    prepared: bool = False  # Engine.prepare checked it (plan set, fits the pool and the context)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: Exception | None = None
    generator: torch.Generator | None = None
    detok: object | None = None  # IncrementalDetokenizer
    stream: bool = False  # text is read after every token (serving): detokenise incrementally
    arrival: float = 0.0
    first_token_time: float | None = None  # time.perf_counter() when the first output token was sampled
    first_logits: torch.Tensor | None = None  # float32 [V], with params.return_first_logits
    cached_tokens: int = 0  # prompt tokens whose KV came from a cache
    flops: dict | None = None  # executed prefill FLOPs
    exact_kv: bool = True  # its KV is what a prefill under its plan computes (prefix-cacheable)
    prefill_start: int | None = None  # first prompt position the pool prefill computes
    reuse: ReuseState | None = None  # set by Engine.prepare where the method reads document KV
    num_preemptions: int = 0
    committed_pages: int = 0  # pages admission reserved for it while it runs
    pages_at_finish: int = 0  # pool pages it held when its pages were last freed
    # Namespace of the request's cached content (a tenant's salt): requests with different salts must
    # never share cached KV (prefix cache blocks, stored chunks). None: the shared namespace.
    cache_salt: str | None = None
    abandoned: bool = False  # its client has gone: nothing it computes is read any more
    page_mass: torch.Tensor | None = None  # float32 [L, Hkv, pages]: budgeted heads' accumulated mass
    grammar: object | None = None  # structured.GrammarState, with params.structured_outputs
    logprobs: list | None = None  # per output token: (logprob, [(token, logprob)] top-k), with params.logprobs
    scheduled_time: float | None = None  # time.perf_counter() when it was first admitted (queue time ends)
    # prefill/decode disaggregation (engine/handoff.py): the lease id its pages are kept under when it
    # finishes (a prefill instance's request), or the handoff it starts from (a decode instance's)
    kv_export: str | None = None
    kv_import: object | None = None  # pd.transfer.Received until admission adopts its pages
    kv_transfer: dict | None = None  # what its handoff moved: bytes, by head class, transport, seconds

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.status = SequenceStatus.FINISHED

    @property
    def needs_documents(self) -> bool:
        """Its document KV is still to be placed (a method reading chunks, not yet admitted)."""
        return self.reuse is not None and not self.reuse.done

    @property
    def recovery(self):
        return self.reuse.recovery if self.reuse is not None else None

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not yet computed (the prompt remainder, or the last sampled token)."""
        return len(self.token_ids) - self.num_computed

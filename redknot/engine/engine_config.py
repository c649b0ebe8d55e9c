"""The engine's settings."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.events import KVEventsConfig
from ..cache.tiers import KVOffloadConfig
from ..reuse.options import ReuseOptions
from .selective import SelectionOptions


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
    # While a step carries other work (decode, shorter prompts, recoveries, or requests waiting),
    # a prompt's chunk is at most this many tokens: a request arriving mid-step then waits for a
    # short step, not a whole budget of a long prompt (vLLM's long_prefill_token_threshold). A
    # prompt alone still takes the whole budget. None: no cap.
    long_prefill_token_threshold: int | None = None
    # Rows one recovery forward starts with at most (every row of each prompt: recovery reads the
    # whole prompt at layer 0), beside the token budget that charges what it computes over all
    # layers; the memory profile sizes the activations for it. None: 4 x max_num_batched_tokens.
    # A prompt longer than this still recovers, alone.
    max_recovery_rows: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # Hybrid linear-attention models: snapshots of the linear layers' state at cached prefixes' ends
    # (each a whole sequence's state); 0 turns their prefix caching off
    linear_state_snapshots: int = 16
    cuda_graphs: bool = True
    # Launch each decode-only step's next forward, fed by its samples on the device, before the
    # host reads them: the host's bookkeeping then overlaps the GPU's next step (a token a
    # finishing sequence did not need is discarded). None: on where decode replays CUDA graphs.
    async_decode: bool | None = None
    kernel: str = "auto"  # "triton" on CUDA, "torch" (the reference) on CPU
    chunk_cache_bytes: int | None = None  # cap on the pool bytes cached chunks hold (None: the pool)
    kv_offload: KVOffloadConfig | None = None  # CPU / disk / Redis tiers under the pool for document KV
    kv_events: KVEventsConfig | None = None  # vLLM-format KV events (ZeroMQ) for KV-aware routers
    reuse_options: ReuseOptions | None = None
    # Retrieval heads' selected sets and per-head decode budgets (H2O); None: retrieval heads global
    selection: SelectionOptions | None = None

    def __post_init__(self):
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError(f"long_prefill_token_threshold must be >= 1, got {self.long_prefill_token_threshold}")
        if self.max_recovery_rows is not None and self.max_recovery_rows < 1:
            raise ValueError(f"max_recovery_rows must be >= 1, got {self.max_recovery_rows}")

    @property
    def recovery_rows(self) -> int:
        return self.max_recovery_rows or 4 * self.max_num_batched_tokens

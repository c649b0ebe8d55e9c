"""The reference reuse prefill: each method as a masked, dense-buffer forward (``reuse.recovery.recover``).

Not the product path. Tests compare the engine (paged pool, batched recovery rows) against it:
chunk KV is computed once by a dense forward at canonical positions, relocated into a dense buffer,
and the method's policy (from the registry, as the engine builds it) runs one masked forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from redknot.cache.chunk_kv import ChunkKV, chunk_key
from oracles.chunk_store import ChunkStore
from redknot.config import HeadConfig, SparseFFNConfig
from redknot.models.config import ModelConfig
from redknot.models.llama import LlamaForCausalLM
from redknot.reuse.flops import FlopReport
from redknot.reuse.options import ReuseOptions
from redknot.reuse.policies import FixedSet
from redknot.reuse.prompt import ChunkedPrompt
from redknot.reuse.recovery import Recovered, kv_buffer, recover
from redknot.reuse.registry import PolicyInputs, get_method


@dataclass
class PrefillResult:
    recovered: Recovered
    cached_tokens: int  # prompt tokens whose KV came from a cache at layer 0
    offline_flops: FlopReport = field(default_factory=FlopReport)  # chunks computed for this request
    offline_s: float = 0.0


class ReuseEngine:
    """Turns a ChunkedPrompt into a prefill for any method, caching prefix and chunk KV by content."""

    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig, fingerprint: str, head_config: HeadConfig | None,
                 sparse: SparseFFNConfig, store: ChunkStore, prefix_store: ChunkStore, device: torch.device,
                 options: ReuseOptions | None = None):
        self.model, self.cfg, self.device = model, cfg, device
        self.fingerprint = fingerprint  # keys carry this model's identity, whatever store they go to
        self._namespace = fingerprint  # and, for the prefill running, its cache namespace
        self.head_config, self.sparse = head_config, sparse
        self.store, self.prefix_store = store, prefix_store
        self.options = options or ReuseOptions()
        self.kernel = "auto"  # the recovery forward's attention path (recovery.recover)
        glob = HeadConfig.all_global(cfg.num_hidden_layers, cfg.num_key_value_heads)
        self.global_vis = _tensors(glob.visibility(cfg.sliding_windows))

    # ---- chunk KV -----------------------------------------------------------------------------
    def _key(self, prefix, ids) -> str:
        return chunk_key(self._namespace, prefix, ids)

    def _entry(self, store: ChunkStore, key: str, prefix: tuple, ids: tuple, start: int,
               offline: list) -> ChunkKV:
        entry = store.get(key)
        if entry is not None:
            return entry
        t0 = time.perf_counter()
        base = self._entry(self.store, self._key((), prefix), (), prefix, 0, offline) if prefix else None
        tokens = torch.tensor(prefix + ids, device=self.device)
        n = tokens.numel()
        positions = torch.arange(start, n, device=self.device)
        if base is not None:
            ck, cv, cached = self._empty_cache(n)
            for l in range(self.cfg.num_hidden_layers):
                ck[l][:start], cv[l][:start] = base.k[l], base.v[l]
            cached[:start] = True
            rec = recover(self.model, tokens, FixedSet(positions, *self.global_vis), ck, cv, cached, self.kernel)
        else:
            rec = recover(self.model, tokens, FixedSet(positions, *self.global_vis), kernel=self.kernel)
        entry = ChunkKV(tuple(ids), start, torch.stack([k[start:] for k in rec.k]),
                        torch.stack([v[start:] for v in rec.v]), compute_s=time.perf_counter() - t0)
        offline.append((rec.flops, entry.compute_s))
        store.put(key, entry)
        return entry

    def _empty_cache(self, n: int):
        c = self.cfg
        dtype = next(self.model.parameters()).dtype

        def buf():
            return kv_buffer(n, c.num_key_value_heads, c.head_dim, dtype, self.device)

        ck = [buf() for _ in range(c.num_hidden_layers)]
        cv = [buf() for _ in range(c.num_hidden_layers)]
        return ck, cv, torch.zeros(n, dtype=torch.bool, device=self.device)

    def _place(self, ck, cv, entry: ChunkKV, at: int) -> None:
        """Copy a cached chunk into the request's cache at offset `at`, keys relocated in fp32."""
        n = entry.num_tokens
        rope = self.model.model.rotary_emb
        k = entry.k.to(self.device)
        if at != entry.start:
            L, _, h, d = k.shape
            k = rope.relocate(k.reshape(L * n, h, d), at - entry.start).view(L, n, h, d)
        for l in range(self.cfg.num_hidden_layers):
            ck[l][at:at + n] = k[l]
            cv[l][at:at + n] = entry.v[l].to(self.device)

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(self, prompt: ChunkedPrompt, method: str, namespace: str | None = None) -> PrefillResult:
        """``namespace``: the cache key namespace (default: the model fingerprint; a salted one
        keeps one tenant's chunks apart from another's)."""
        self._namespace = namespace or self.fingerprint
        try:
            return self._prefill(prompt, method)
        finally:
            self._namespace = self.fingerprint

    def _prefill(self, prompt: ChunkedPrompt, method: str) -> PrefillResult:
        method = get_method(method).name
        tokens = torch.tensor(prompt.token_ids, device=self.device)
        n = tokens.numel()
        all_pos = torch.arange(n, device=self.device)
        if method == "dense":
            return PrefillResult(recover(self.model, tokens, FixedSet(all_pos, *self.global_vis), kernel=self.kernel), 0)
        if method == "prefix":
            return self._prefix(prompt, tokens)
        if method == "headsparse":
            if self.head_config is None:
                raise ValueError("method='headsparse' needs a head_config")
            vis = _tensors(self.head_config.visibility(self.cfg.sliding_windows))
            return PrefillResult(recover(self.model, tokens, FixedSet(all_pos, *vis), kernel=self.kernel), 0)
        offline: list = []
        ck, cv, cached = self._empty_cache(n)
        p = len(prompt.prefix)
        if p:
            self._place(ck, cv, self._entry(self.store, self._key((), prompt.prefix), (), prompt.prefix, 0,
                                            offline), 0)
            cached[:p] = True
        # a dummy prefix: each chunk computed after prefix + that many BOS tokens, their K/V not placed
        bos = self.cfg.bos_token_id if self.cfg.bos_token_id is not None else 0
        lead = tuple(prompt.prefix) + (bos,) * self.options.dummy_prefix_tokens
        for ids, at in zip(prompt.chunks, prompt.chunk_starts):
            entry = self._entry(self.store, self._key(lead, ids), lead, ids, len(lead), offline)
            self._place(ck, cv, entry, at)
        policy, cached = self.policy(prompt, method)
        rec = recover(self.model, tokens, policy, ck, cv, cached, self.kernel)
        off = FlopReport()
        for f, _ in offline:
            off = off.merge(f)
        return PrefillResult(rec, int(cached.sum()) if get_method(method).cached_from == "chunks" else p, off,
                             sum(s for _, s in offline))

    def policy(self, prompt: ChunkedPrompt, method: str):
        """The method's recovery policy and cached positions, built by the registry as the engine
        builds them. A placed-chunk method is the fixed set it computes in the pool: the question
        (and for ``epic`` each chunk's first tokens)."""
        inputs = PolicyInputs(prompt, self.cfg, self.head_config, self.sparse, self.options, self.device)
        spec = get_method(method)
        if spec.recovers:
            return spec.build_policy(inputs)
        is_chunk, _ = inputs.chunk_layout()
        cached = is_chunk.clone()
        cached[:len(prompt.prefix)] = True
        rows = [torch.arange(prompt.suffix_start, len(prompt), device=self.device)]
        if spec.recompute_chunk_heads:
            rows = [torch.arange(at, at + min(self.options.epic_tokens, len(c)), device=self.device)
                    for c, at in zip(prompt.chunks, prompt.chunk_starts)] + rows
        return FixedSet(torch.cat(rows), *self.global_vis), cached

    def _prefix(self, prompt: ChunkedPrompt, tokens: torch.Tensor) -> PrefillResult:
        """Exact prefix caching at chunk boundaries (what vLLM/SGLang prefix caching gives)."""
        ids = prompt.token_ids
        n = len(ids)
        bounds = [b for b in [len(prompt.prefix)] + [s + len(c) for c, s in zip(prompt.chunks, prompt.chunk_starts)]
                  if 0 < b < n]
        hit, entry = 0, None
        for b in reversed(bounds):
            entry = self.prefix_store.get(self._key((), tuple(ids[:b])))
            if entry is not None:
                hit = b
                break
        ck, cv, cached = self._empty_cache(n)
        if entry is not None:
            for l in range(self.cfg.num_hidden_layers):
                ck[l][:hit], cv[l][:hit] = entry.k[l].to(self.device), entry.v[l].to(self.device)
            cached[:hit] = True
        rec = recover(self.model, tokens, FixedSet(torch.arange(hit, n, device=self.device), *self.global_vis),
                      ck, cv, cached, self.kernel)
        for b in bounds:
            if b > hit:
                key = self._key((), tuple(ids[:b]))
                if not self.prefix_store.contains(key):
                    self.prefix_store.put(key, ChunkKV(tuple(ids[:b]), 0, torch.stack([k[:b] for k in rec.k]),
                                                       torch.stack([v[:b] for v in rec.v])))
        return PrefillResult(rec, hit)


def _tensors(vis) -> tuple[torch.Tensor, torch.Tensor]:
    window, sink = vis
    return torch.as_tensor(window, dtype=torch.int64), torch.as_tensor(sink, dtype=torch.int64)


def reuse_oracle(llm) -> ReuseEngine:
    """The reference prefill for an ``LLM``: its model, plan, sparse-FFN tiers and reuse knobs (as
    its engine holds them now), its own dense chunk stores, attending with the engine's kernels."""
    docs = llm.engine.documents
    oracle = ReuseEngine(llm.model, llm.config, llm.fingerprint, llm.head_config, docs.sparse,
                         ChunkStore(llm.fingerprint, 1 << 40, 0, llm.device),
                         ChunkStore(llm.fingerprint, 1 << 40, 0, llm.device), llm.device, docs.options)
    oracle.kernel = llm.engine.cfg.kernel
    return oracle

"""The offline API, shaped like vLLM's: ``LLM(model=…).generate(prompts, SamplingParams(…))``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache import ChunkStore
from ..config import HeadConfig, SparseFFNConfig
from ..models import ModelConfig, build_model, load_model, resolve_dtype
from ..models.fingerprint import model_fingerprint
from ..reuse.methods import REUSE_METHODS, PrefillResult, ReuseEngine, ReuseOptions
from ..reuse.prompt import build_prompt, is_conversation
from .backends import AttentionBackend, DenseBackend
from .runner import ModelRunner
from .sampling import SamplingParams, sample
from .sequence import Sequence

METHODS = ("dense", "headsparse") + tuple(m for m in REUSE_METHODS if m != "dense")


def prefills_through_reuse(method: str) -> bool:
    """Methods whose prefill is the reuse engine's recovery (dense/headsparse use the runner)."""
    return method in REUSE_METHODS and method != "dense"

# Which attention backend a method decodes on: dense KV, or per-head pages under the head config
# (or under an all-global plan for the exact gate, so it runs the same SegPaged code).
_BACKEND_OF = {"headsparse": "headsparse", "redknot": "headsparse", "redknot_kv": "headsparse",
               "redknot_exact": "global_paged"}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict | None = None  # cached_tokens, executed prefill FLOPs (reuse methods), time_to_first_token (s)
    first_token_logits: torch.Tensor | None = None  # float32 [vocab], with SamplingParams(return_first_logits=True)


class LLM:
    """Load an HF Llama-family checkpoint and serve it offline.

    ``method`` picks how attention and KV are handled by default ("dense": contiguous KV + SDPA;
    "headsparse": SegPaged per-head KV, each head seeing only its visible set per ``head_config``).
    """

    def __init__(self, model: str | Path | None = None, head_config: str | Path | HeadConfig | None = None,
                 method: str = "dense", device: str | torch.device | None = None, dtype=None,
                 page_size: int = 64, kv_pages: int | None = None, max_num_batched_tokens: int = 8192,
                 sparse_ffn: str | Path | SparseFFNConfig | None = None, chunk_store_bytes: int = 4 << 30,
                 cpu_chunk_store_bytes: int = 0, reuse_options: ReuseOptions | None = None, tokenizer=None):
        """``model``: an HF checkpoint directory, or a ModelConfig for random weights of that
        architecture (benchmarks; the tokenizer then defaults to a small built-in BPE)."""
        if model is None:
            from ..testbed import model_path
            model = model_path()
        if head_config is None and not isinstance(model, ModelConfig) and (Path(model) / "heads.json").is_file():
            head_config = Path(model) / "heads.json"  # a checkpoint may carry its head config (the bundled one does)
        if sparse_ffn is None and not isinstance(model, ModelConfig) and (Path(model) / "sparse_ffn.json").is_file():
            sparse_ffn = Path(model) / "sparse_ffn.json"  # and its sparse-FFN tiers (layer indices are per model)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_dir = None if isinstance(model, ModelConfig) else Path(model)
        if isinstance(model, ModelConfig):
            self.config = model
            self.model = build_model(model, resolve_dtype(dtype, model, self.device), self.device)
            if tokenizer is None:
                from ..tiny import make_tokenizer
                tokenizer = make_tokenizer()
        else:
            self.model, self.config = load_model(model, dtype=dtype, device=self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = tokenizer or _load_tokenizer(model)
        self.max_model_len = self.config.max_position_embeddings
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size, self.kv_pages = page_size, kv_pages
        if isinstance(head_config, (str, Path)):
            head_config = HeadConfig.from_json(head_config)
        if head_config is not None:
            head_config.validate_model(self.config.num_hidden_layers, self.config.num_key_value_heads)
        self.head_config = head_config
        if isinstance(sparse_ffn, (str, Path)):
            sparse_ffn = SparseFFNConfig.from_json(sparse_ffn)
        self.sparse_ffn = sparse_ffn or SparseFFNConfig()
        self.fingerprint = model_fingerprint(self.model, self.config, self.tokenizer)
        # Chunks at canonical positions, and exact prefixes (method "prefix"), keyed by content + model.
        self.chunk_store = ChunkStore(self.fingerprint, chunk_store_bytes, cpu_chunk_store_bytes, self.device)
        self.prefix_store = ChunkStore(self.fingerprint, chunk_store_bytes, 0, self.device)
        self.reuse = ReuseEngine(self.model, self.config, self.fingerprint, head_config, self.sparse_ffn, self.chunk_store,
                                 self.prefix_store, self.device, reuse_options)
        self.last_prefill: PrefillResult | None = None  # what the last reuse prefill executed
        self.method = self._check_method(method)
        self.runner = ModelRunner(self.model, self.device)
        self._backends: dict[str, AttentionBackend] = {}
        self.backend(self.method)  # build eagerly so a bad setup fails here, not at the first request

    # ---- public API ---------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 documents=None, method: str | None = None) -> list[RequestOutput]:
        """``documents``: one list of documents (strings or token-id lists) per prompt, or None."""
        single = (isinstance(prompts, str) or is_conversation(prompts)
                  or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)))
        prompts = [prompts] if single else list(prompts)
        if documents is not None and single and (not documents or not isinstance(documents[0], list)
                                                 or (documents[0] and isinstance(documents[0][0], int))):
            documents = [documents]  # one prompt's documents given flat
        if documents is not None and len(documents) != len(prompts):
            raise ValueError(f"got {len(documents)} document lists for {len(prompts)} prompts")
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        method = self._check_method(method or self.method)
        backend = self.backend(method)
        start = time.perf_counter()
        seqs, prefilled = [], {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            docs = None if documents is None else documents[i]
            seq = Sequence(self._prompt_ids(prompt, docs), p)
            if p.seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(p.seed)
            seqs.append(seq)
        try:
            for i, seq in enumerate(seqs):
                backend.add_sequence(seq.seq_id)
                if prefills_through_reuse(method):
                    docs = None if documents is None else documents[i]
                    result = self._reuse_prefill(prompts[i], docs, method)
                    backend.import_kv(seq.seq_id, result.recovered.k, result.recovered.v)
                    seq.num_computed = len(seq.token_ids)
                    prefilled[seq.seq_id] = result
            first = self._run(backend, seqs, {sid: r.recovered.logits for sid, r in prefilled.items()})
        finally:
            for seq in seqs:
                backend.free_sequence(seq.seq_id)
        outputs = []
        for i, (prompt, s) in enumerate(zip(prompts, seqs)):
            r = prefilled.get(s.seq_id)
            metrics = {"cached_tokens": r.cached_tokens if r else 0,
                       "flops": r.recovered.flops.totals() if r else None,
                       "time_to_first_token": s.first_token_time - start}
            outputs.append(RequestOutput(i, prompt if isinstance(prompt, str) else None, s.prompt_token_ids,
                                         [CompletionOutput(0, s.text, s.output_token_ids, s.finish_reason)],
                                         metrics, first[s.seq_id] if s.params.return_first_logits else None))
        return outputs

    def first_token_logits(self, prompt, documents=None, method: str | None = None) -> torch.Tensor:
        """float32 logits [vocab] of the first generated position."""
        method = self._check_method(method or self.method)
        if prefills_through_reuse(method):
            return self._reuse_prefill(prompt, documents, method).recovered.logits
        backend = self.backend(method)
        seq = Sequence(self._prompt_ids(prompt, documents), SamplingParams(max_tokens=1, temperature=0))
        backend.add_sequence(seq.seq_id)
        try:
            return self._prefill(backend, [seq])[seq.seq_id]
        finally:
            backend.free_sequence(seq.seq_id)

    def backend(self, method: str) -> AttentionBackend:
        """The attention backend ``method`` decodes on (built on first use, shared across methods)."""
        key = _BACKEND_OF.get(method, "dense")
        if key not in self._backends:
            if key == "dense":
                self._backends[key] = DenseBackend(self.config, self.dtype, self.device)
            else:
                from .segpaged_backend import SegPagedBackend
                plan = self.head_config
                if key == "global_paged":
                    plan = HeadConfig.all_global(self.config.num_hidden_layers, self.config.num_key_value_heads)
                elif plan is None:
                    raise ValueError(f"method={method!r} needs a head_config (a JSON file or HeadConfig)")
                self._backends[key] = SegPagedBackend(self.config, plan, self.dtype, self.device,
                                                      page_size=self.page_size, num_pages=self.kv_pages)
        return self._backends[key]

    # ---- internals ----------------------------------------------------------------------------
    def _check_method(self, method: str) -> str:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r} (available: {', '.join(METHODS)})")
        if method in ("redknot", "redknot_kv") and self.head_config is None:
            raise ValueError(f"method={method!r} needs a head_config (a JSON file or HeadConfig)")
        return method

    def _reuse_prefill(self, prompt, documents, method: str) -> PrefillResult:
        cp = build_prompt(self.tokenizer, prompt, documents)
        self._check_ids(cp.token_ids)
        self.last_prefill = self.reuse.prefill(cp, method)
        return self.last_prefill

    def _prompt_ids(self, prompt, documents) -> list[int]:
        if documents is None and not is_conversation(prompt):
            return self._encode(prompt)
        return self._check_ids(build_prompt(self.tokenizer, prompt, documents).token_ids)

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        return self._check_ids(ids)

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, the model allows {self.max_model_len} "
                             f"(max_position_embeddings)")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (vocab_size={self.config.vocab_size})")
        return ids

    def _prefill(self, backend, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
        """Chunked prefill under the token budget; returns each prompt's last-position logits."""
        last: dict[int, torch.Tensor] = {}
        pending = [s for s in seqs if s.num_pending > 0]
        while pending:
            batch, budget = [], self.max_num_batched_tokens
            for s in pending:
                n = min(s.num_pending, budget)
                if n == 0:
                    break
                batch.append((s, n))
                budget -= n
            logits = self.runner.step(backend, batch)
            for (s, _), row in zip(batch, logits):
                if s.num_pending == 0:
                    last[s.seq_id] = row
            pending = [s for s in pending if s.num_pending > 0]
        return last

    def _run(self, backend, seqs: list[Sequence], prefilled: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Prefill what is not prefilled, then decode every sequence to its end; returns each one's
        first-token logits."""
        first = {**prefilled, **self._prefill(backend, [s for s in seqs if s.seq_id not in prefilled])}
        logits = torch.stack([first[s.seq_id] for s in seqs])
        active = list(seqs)
        while True:
            tokens = sample(logits, [s.params for s in active], [s.generator for s in active])
            for s, t in zip(active, tokens):
                self._append(s, t)
            active = [s for s in active if not s.finished]
            if not active:
                return first
            logits = self.runner.step(backend, [(s, 1) for s in active])

    def _append(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()  # the sampled id is on the host: the device is done
        p = seq.params
        out = seq.output_token_ids
        seq.text = self.tokenizer.decode(out, skip_special_tokens=True)
        if not p.ignore_eos and token in self.config.eos_token_ids or token in p.stop_token_ids:
            seq.finish_reason = "stop"
            seq.text = self.tokenizer.decode(out[:-1], skip_special_tokens=True)
        elif any(stop in seq.text for stop in p.stop):
            seq.finish_reason = "stop"
            seq.text = seq.text[: min(seq.text.find(s) for s in p.stop if s in seq.text)]
        elif len(out) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"


def _load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))

"""The offline API, shaped like vLLM's: ``LLM(model=…).generate(prompts, SamplingParams(…))``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import HeadConfig
from ..models import load_model
from .backends import AttentionBackend, DenseBackend
from .runner import ModelRunner
from .sampling import SamplingParams, sample
from .sequence import Sequence

# Attention-only methods available now; the chunk-reuse methods plug in beside them.
METHODS = ("dense", "headsparse")
REUSE_METHODS = ("prefix", "full_reuse", "cacheblend", "epic", "redknot", "redknot_exact")


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


class LLM:
    """Load an HF Llama-family checkpoint and serve it offline.

    ``method`` picks how attention and KV are handled by default ("dense": contiguous KV + SDPA;
    "headsparse": SegPaged per-head KV, each head seeing only its visible set per ``head_config``).
    """

    def __init__(self, model: str | Path | None = None, head_config: str | Path | HeadConfig | None = None,
                 method: str = "dense", device: str | torch.device | None = None, dtype=None,
                 page_size: int = 64, kv_pages: int | None = None, max_num_batched_tokens: int = 8192):
        if model is None:
            from ..testbed import model_path
            model = model_path()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, self.config = load_model(model, dtype=dtype, device=self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = _load_tokenizer(model)
        self.max_model_len = self.config.max_position_embeddings
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size, self.kv_pages = page_size, kv_pages
        if isinstance(head_config, (str, Path)):
            head_config = HeadConfig.from_json(head_config)
        if head_config is not None:
            head_config.validate_model(self.config.num_hidden_layers, self.config.num_key_value_heads)
        self.head_config = head_config
        self.method = self._check_method(method)
        self.runner = ModelRunner(self.model, self.device)
        self._backends: dict[str, AttentionBackend] = {}
        self.backend(self.method)  # build eagerly so a bad setup fails here, not at the first request

    # ---- public API ---------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 documents=None, method: str | None = None) -> list[RequestOutput]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        if documents is not None:
            raise NotImplementedError("documents= (chunk reuse) is not implemented yet")
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        backend = self.backend(self._check_method(method or self.method))
        seqs = []
        for prompt, p in zip(prompts, params):
            seq = Sequence(self._encode(prompt), p)
            if p.seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(p.seed)
            seqs.append(seq)
        try:
            for seq in seqs:
                backend.add_sequence(seq.seq_id)
            self._run(backend, seqs)
        finally:
            for seq in seqs:
                backend.free_sequence(seq.seq_id)
        return [RequestOutput(i, prompt if isinstance(prompt, str) else None, s.prompt_token_ids,
                              [CompletionOutput(0, s.text, s.output_token_ids, s.finish_reason)])
                for i, (prompt, s) in enumerate(zip(prompts, seqs))]

    def first_token_logits(self, prompt, documents=None, method: str | None = None) -> torch.Tensor:
        """float32 logits [vocab] of the first generated position."""
        if documents is not None:
            raise NotImplementedError("documents= (chunk reuse) is not implemented yet")
        backend = self.backend(self._check_method(method or self.method))
        seq = Sequence(self._encode(prompt), SamplingParams(max_tokens=1, temperature=0))
        backend.add_sequence(seq.seq_id)
        try:
            return self._prefill(backend, [seq])[seq.seq_id]
        finally:
            backend.free_sequence(seq.seq_id)

    def backend(self, method: str) -> AttentionBackend:
        if method not in self._backends:
            if method == "dense":
                self._backends[method] = DenseBackend(self.config, self.dtype, self.device)
            else:  # headsparse
                from .segpaged_backend import SegPagedBackend
                if self.head_config is None:
                    raise ValueError(f"method={method!r} needs a head_config (a JSON file or HeadConfig)")
                self._backends[method] = SegPagedBackend(self.config, self.head_config, self.dtype, self.device,
                                                         page_size=self.page_size, num_pages=self.kv_pages)
        return self._backends[method]

    # ---- internals ----------------------------------------------------------------------------
    def _check_method(self, method: str) -> str:
        if method in REUSE_METHODS:
            raise NotImplementedError(f"method={method!r} needs chunk reuse, which is not implemented yet")
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r} (available: {', '.join(METHODS)})")
        return method

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
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

    def _run(self, backend, seqs: list[Sequence]) -> None:
        first = self._prefill(backend, seqs)
        logits = torch.stack([first[s.seq_id] for s in seqs])
        active = list(seqs)
        while True:
            tokens = sample(logits, [s.params for s in active], [s.generator for s in active])
            for s, t in zip(active, tokens):
                self._append(s, t)
            active = [s for s in active if not s.finished]
            if not active:
                return
            logits = self.runner.step(backend, [(s, 1) for s in active])

    def _append(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
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

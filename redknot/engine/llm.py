"""The offline API, shaped like vLLM's: ``LLM(model=…).generate(prompts, SamplingParams(…))``."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache.events import KVEventsConfig
from ..cache.tiers import KVOffloadConfig
from ..distributed.lockstep import LockstepEngine
from ..distributed.setup import TensorParallel
from ..distributed.shard import check_tensor_parallel
from ..config import HeadConfig, SparseFFNConfig
from ..models import ModelConfig, build_model, load_model, resolve_dtype, resolve_model
from ..models.resolve import bundled_model_path
from ..models.shelf import REUSE_FILE
from ..models.tokenizer import make_tokenizer
from ..models.fingerprint import model_fingerprint
from ..reuse.options import ReuseOptions
from ..reuse.prompt import ChunkedPrompt, build_prompt, is_conversation
from ..reuse.registry import METHOD_NAMES as METHODS, default_method, get_method, parse_method
from .engine import Engine, EngineConfig
from .host_memory import cap_cpu_primitive_cache
from .sampling import SamplingParams
from .selective import SelectionOptions
from .sequence import Sequence

__all__ = ["LLM", "METHODS", "CompletionOutput", "RequestOutput"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None  # with SamplingParams(logprobs=k): per token (logprob, [(token, logprob)] top-k)


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict | None = None  # cached_tokens, executed prefill FLOPs (reuse methods), time_to_first_token (s)
    first_token_logits: torch.Tensor | None = None  # float32 [vocab], with SamplingParams(return_first_logits=True)


class LLM:
    """Load an HF Llama-family checkpoint and serve it offline: a thin front on ``Engine``.

    ``method`` picks the default way a request is prefilled and its KV kept ("dense": every head
    sees everything; "headsparse": each head only its visible set per ``head_config``; the reuse
    methods reuse cached document KV). Every method shares one paged KV pool.
    """

    def __init__(self, model: str | Path | None = None, head_config: str | Path | HeadConfig | None = None,
                 method: str = "dense", device: str | torch.device | None = None, dtype=None,
                 page_size: int = 64, kv_pages: int | None = None, max_num_batched_tokens: int = 8192,
                 max_recovery_rows: int | None = None, long_prefill_token_threshold: int | None = None,
                 sparse_ffn: str | Path | SparseFFNConfig | None = None, chunk_cache_bytes: int | None = None,
                 reuse_options: ReuseOptions | None = None, tokenizer=None,
                 max_num_seqs: int = 256, max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 cuda_graphs: bool = True, async_decode: bool | None = None, gpu_memory_utilization: float = 0.9,
                 reserve_full_length: bool = True, retrieval_heads: bool = False, decode_kv_budget=None, selection=None, kernel: str = "auto",
                 kv_offload: KVOffloadConfig | dict | None = None, kv_events: KVEventsConfig | dict | None = None,
                 tensor_parallel_size: int = 1, balance_kv_heads: bool = True, _tp_rank=None):
        """``model``: an HF checkpoint directory, a GGUF file (or a directory holding one), a
        fetched shelf name (``redknot models get NAME``), or a ModelConfig for random weights of
        that architecture (benchmarks; the tokenizer then defaults to a small built-in BPE).

        ``retrieval_heads``: the head config's retrieval heads keep sink + window + the tokens
        covering its ``retrieval_top_p`` of the prompt's observation-window attention (otherwise
        they are served as global heads). ``decode_kv_budget``: per-head decode KV budgets with
        H2O accumulation (tokens or a fraction; ``"global=0.1,retrieval=256"``). ``selection``: a
        ``SelectionOptions`` with every knob (overrides the two above). ``kernel``: the attention
        kernels, "auto" (Triton on CUDA, the torch reference elsewhere), "triton" or "torch".
        ``async_decode``: launch each decode step from the previous one's samples on the device
        before the host reads them (None: where decode replays CUDA graphs). ``kv_offload``: tiers
        under the GPU pool for document KV, a ``KVOffloadConfig`` or a dict of its fields
        (``{"cpu_bytes": 4 << 30, "disk_dir": "/var/cache/kv", "disk_bytes": 100 << 30,
        "redis_url": "redis://host:6379"}``). ``kv_events``: publish vLLM-format KV events over
        ZeroMQ for KV-aware routers, a ``KVEventsConfig`` or a dict of its fields
        (``{"endpoint": "tcp://*:5557", "documents": True}``). ``tensor_parallel_size``: split the
        model over that many processes (one per GPU; gloo on CPU), its KV heads and their pages
        with it (docs/tp.md); ``balance_kv_heads`` permutes each layer's KV heads so the head
        plan's global heads spread over the ranks."""
        spec = {k: v for k, v in locals().items() if k not in ("self", "_tp_rank")}  # what the workers build
        if isinstance(kv_events, dict):
            kv_events = KVEventsConfig(**kv_events)
        kv_offload = KVOffloadConfig.of(kv_offload)  # bad options fail before the model loads
        model, head_config, sparse_ffn = _resolve(model, head_config, sparse_ffn)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_dir = None if isinstance(model, ModelConfig) else Path(model)
        self.config = model if isinstance(model, ModelConfig) else ModelConfig.from_dir(model)
        self.recommended_method = checkpoint_method(self.model_dir)  # for requests naming none (serve's auto)
        self.head_config, self.sparse_ffn = head_config, sparse_ffn = _load_plans(head_config, sparse_ffn, self.config)
        if selection is None and (retrieval_heads or decode_kv_budget is not None):
            selection = SelectionOptions(retrieval_heads=retrieval_heads, decode_kv_budget=decode_kv_budget)
        self.tp = _tensor_parallel(spec, tensor_parallel_size, _tp_rank, self.config, head_config, self.device,
                                   balance_kv_heads, kv_offload, selection)
        tokenizer = self._load(model, dtype, tokenizer)
        self.tokenizer = tokenizer or _load_tokenizer(model)
        self.fingerprint = model_fingerprint(self.model, self.config, self.tokenizer)
        self.engine = self._make_engine(head_config, EngineConfig(
            page_size=page_size, kv_pages=kv_pages, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_recovery_rows=max_recovery_rows,
            long_prefill_token_threshold=long_prefill_token_threshold, max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching, cuda_graphs=cuda_graphs,
            async_decode=async_decode, chunk_cache_bytes=chunk_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization, reserve_full_length=reserve_full_length, kernel=kernel,
            reuse_options=reuse_options, selection=selection, kv_offload=kv_offload, kv_events=kv_events))
        self.max_model_len = self.engine.max_model_len
        self.method = self.check_method(method)
        self._grammars = None

    def _make_engine(self, head_config, cfg: EngineConfig) -> Engine:
        """The engine; under tensor parallelism this rank's lockstep engine over its share of the
        heads (local config, the head plan's slice)."""
        if self.tp is None:
            return Engine(self.model, self.config, self.tokenizer, self.fingerprint, head_config, self.sparse_ffn,
                          self.device, cfg)
        self.tp.engine = LockstepEngine(self.model, self.tp.local_config, self.tokenizer, self.fingerprint,
                                        self.tp.shard.head_config(head_config), self.sparse_ffn, self.device, cfg,
                                        group=self.tp.group, watch=self.tp.watch, grammars=lambda: self.grammars)
        return self.tp.engine

    def _load(self, model, dtype, tokenizer):
        """Load (or build, for a ModelConfig) the model, this rank's shard of it under tensor
        parallelism; returns the tokenizer (a built-in one for random weights)."""
        shard = None if self.tp is None else self.tp.shard
        if self.tp is not None:
            self.device = self.tp.device
        if self.device.type == "cpu":
            cap_cpu_primitive_cache()  # before the first CPU kernel
        if isinstance(model, ModelConfig):
            self.model = build_model(model, resolve_dtype(dtype, model, self.device), self.device, shard=shard)
            tokenizer = tokenizer or make_tokenizer()
        else:
            self.model, self.config = load_model(model, dtype=dtype, device=self.device, shard=shard)
        if shard is not None:
            shard.connect(self.model, self.tp.group)
        self.dtype = next(self.model.parameters()).dtype
        return tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel workers (a one-device LLM has nothing to stop)."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def pool(self):
        return self.engine.pool

    @property
    def chunk_cache(self):
        """Cached document KV (pool pages)."""
        return self.engine.chunk_cache

    # ---- public API ---------------------------------------------------------------------------
    def make_sequence(self, prompt, params: SamplingParams, documents=None, method: str | None = None,
                      cache_salt: str | None = None) -> Sequence:
        """Validate and tokenise one request; raises ValueError/TypeError on bad input.
        ``cache_salt`` names the cache namespace the request's content belongs to (``Sequence.cache_salt``)."""
        method, budget = parse_method(self.check_method(method or self.method))  # "cacheblend@0.3": its budget
        cp = None
        if isinstance(prompt, ChunkedPrompt):  # the layout given: prefix, documents and question as token ids
            if documents is not None:
                raise ValueError("a ChunkedPrompt carries its documents: pass documents=None")
            cp, ids = prompt, self._check_ids(prompt.token_ids)
        elif documents is None and not is_conversation(prompt) and not get_method(method).reads_chunks:
            ids = self._encode(prompt)
        else:  # the reuse engine needs the prompt's layout: prefix, documents, suffix
            cp = build_prompt(self.tokenizer, prompt, documents)
            ids = self._check_ids(cp.token_ids)
        seq = Sequence(ids, params, method=method, chunked_prompt=cp, cache_salt=cache_salt, budget=budget or None)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if params.structured_outputs is not None:  # compiled here (cached), never in the step loop
            seq.grammar = self.grammars.matcher(params.structured_outputs)
        return seq

    @property
    def grammars(self):
        """The structured-output grammar cache of this model's tokenizer (made on first use)."""
        if self._grammars is None:
            from .structured import GrammarCache

            self._grammars = GrammarCache(self.tokenizer, self.config.vocab_size, self.config.eos_token_ids)
        return self._grammars

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 documents=None, method: str | None = None, use_tqdm: bool = False,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """``documents``: one list of documents (strings or token-id lists) per prompt, or None.
        ``cache_salt``: the cache namespace of these requests (``make_sequence``); a fresh salt
        keeps them from reusing, or being reused by, any other request's cached prefix."""
        single = (isinstance(prompts, (str, ChunkedPrompt)) or is_conversation(prompts)
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
        seqs = [self.make_sequence(p, sp, None if documents is None else documents[i], method, cache_salt)
                for i, (p, sp) in enumerate(zip(prompts, params))]
        engine = self.engine
        for s in seqs:  # every request is checked before any is queued
            engine.prepare(s)
        start = time.perf_counter()
        try:
            for s in seqs:
                engine.add_request(s)
            while engine.has_unfinished():
                engine.step()
                failed = next((s for s in seqs if s.error is not None), None)
                if failed is not None:
                    raise failed.error
        finally:
            for s in seqs:
                if not s.finished:
                    engine.abort(s)
        outputs = []
        for i, (prompt, s) in enumerate(zip(prompts, seqs)):
            metrics = {"cached_tokens": s.cached_tokens, "flops": s.flops,
                       "time_to_first_token": s.first_token_time - start, "preemptions": s.num_preemptions}
            outputs.append(RequestOutput(i, prompt if isinstance(prompt, str) else None, s.prompt_token_ids,
                                         [CompletionOutput(0, s.text, s.output_token_ids, s.finish_reason, s.logprobs)],
                                         metrics, s.first_logits))
        return outputs

    def first_token_logits(self, prompt, documents=None, method: str | None = None) -> torch.Tensor:
        """float32 logits [vocab] of the first generated position."""
        method = self.check_method(method or self.method)
        params = SamplingParams(max_tokens=1, temperature=0, return_first_logits=True, ignore_eos=True)
        return self.generate(prompt, params, documents=documents, method=method)[0].first_token_logits

    @property
    def auto_method(self) -> str:
        """The method ``auto`` stands for on this model (``reuse.registry.default_method``: the
        checkpoint's ``reuse.json`` choice, else by its head config)."""
        return default_method(self.head_config, self.recommended_method)

    def check_method(self, method: str) -> str:
        """``method`` (a registry name or alias, with any budget after "@": ``parse_method``) if the
        engine runs it, its name resolved; else ValueError."""
        name, _ = parse_method(method)
        self.engine.check_method(name)
        return name + method[method.index("@"):] if "@" in method else name

    def context_limits(self, method: str | None = None) -> tuple[int, int]:
        """(most tokens of prompt + max_tokens, most prompt tokens) one request of ``method`` can
        ever hold, documents aside: the model's max_model_len, or less where the page pool is
        smaller than that under the method's head plan. Both come from the scheduler's admission
        arithmetic (``Scheduler.check_fits``)."""
        method = parse_method(self.check_method(method or self.method))[0]

        def make_seq(n: int) -> Sequence:
            seq = Sequence([0] * n, SamplingParams(max_tokens=1), method=method)
            self.engine.prepare_plan(seq)
            return seq

        return self.engine.scheduler.context_limits(get_method(method), make_seq)

    def max_new_tokens(self, seq: Sequence) -> int:
        """The most tokens a prepared-to-be request can generate (its prompt and method fixed): what a
        request that leaves max_tokens unset gets. The same arithmetic admits it."""
        self.engine.prepare_plan(seq)
        return self.engine.scheduler.max_new_tokens(seq)

    def max_context(self, method: str | None = None) -> int:
        """The most tokens (prompt + max_tokens) any request of ``method`` can hold, however they split."""
        return min(self.context_limits(method))

    def prompt_ids(self, prompt, documents=None) -> list[int]:
        """The token ids a request's prompt (with its documents) is served as."""
        if documents is None and not is_conversation(prompt):
            return self._encode(prompt)
        return self._check_ids(build_prompt(self.tokenizer, prompt, documents).token_ids)

    def kv_bytes(self) -> int:
        return self.engine.kv_bytes()

    # ---- internals ----------------------------------------------------------------------------
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


def _resolve(model, head_config, sparse_ffn):
    """(model, head config, sparse-FFN tiers): the bundled checkpoint when none is named; an HF
    directory for a .gguf file or a shelf name; the head config and tiers a checkpoint carries
    (``heads.json``, ``sparse_ffn.json``: layer indices are per model) when none are given."""
    if model is None:  # the checkpoint shipped in the package, as every CLI defaults to
        model = bundled_model_path()
    if isinstance(model, ModelConfig):
        return model, head_config, sparse_ffn
    model = resolve_model(model)
    if head_config is None and (Path(model) / "heads.json").is_file():
        head_config = Path(model) / "heads.json"
    if sparse_ffn is None and (Path(model) / "sparse_ffn.json").is_file():
        sparse_ffn = Path(model) / "sparse_ffn.json"
    return model, head_config, sparse_ffn


def checkpoint_method(model_dir: Path | None) -> str | None:
    """The method spec a checkpoint recommends for requests that name none (``reuse.json``
    beside it, written from the shelf's measurements), or None."""
    path = None if model_dir is None else Path(model_dir) / REUSE_FILE
    if path is None or not path.is_file():
        return None
    try:
        spec = json.loads(path.read_text())["method"]
        parse_method(spec)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: expected {{\"method\": SPEC}} with a method spec such as "
                         f"\"redknot@0.2+s16\" ({e})") from None
    return spec


def _load_plans(head_config, sparse_ffn, config) -> tuple[HeadConfig | None, SparseFFNConfig]:
    """The head config (checked against the model's layers and KV heads) and the sparse-FFN tiers,
    from objects or JSON paths."""
    if isinstance(head_config, (str, Path)):
        head_config = HeadConfig.from_json(head_config)
    if head_config is not None:
        head_config.validate_model(config.num_hidden_layers, config.num_key_value_heads)
    if isinstance(sparse_ffn, (str, Path)):
        sparse_ffn = SparseFFNConfig.from_json(sparse_ffn)
    return head_config, sparse_ffn or SparseFFNConfig()


def _tensor_parallel(spec, world, tp_rank, config, head_config, device, balance, kv_offload, selection):
    """This rank's ``TensorParallel`` (rank 0 starts the workers), or None on one device."""
    if world == 1 and tp_rank is None:
        return None
    check_tensor_parallel(config, world)
    if kv_offload is not None:
        raise ValueError("kv_offload (the KV tiers) is not supported with tensor_parallel_size > 1 yet")
    if selection is not None and selection.active:
        raise ValueError("retrieval-head selection and decode KV budgets are not supported with "
                         "tensor_parallel_size > 1 yet")
    return TensorParallel(LLM, spec, world, tp_rank, config, head_config, device, balance)


def _load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))

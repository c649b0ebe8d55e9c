"""``redknot serve``: the OpenAI-compatible server (uvicorn) over one model."""

from __future__ import annotations

import argparse
import logging
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the bundled testbed model)")
    p.add_argument("--head-config", default=None, help="head config JSON (needed by headsparse and redknot*)")
    p.add_argument("--method", default="auto",
                   help="default method of requests that name none (auto: redknot with a head config, "
                        "else cacheblend: documents are reused out of the box)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together at most")
    p.add_argument("--kv-pages", type=int, default=None,
                   help="SegPaged pool pages (default: sized from --gpu-memory-utilization)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many processes, one per GPU (Llama family; docs/tp.md)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory for weights, activations and KV pages together (vLLM's flag)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per SegPaged page")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length to serve (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens one engine step computes at most; smaller prompt chunks let decoding requests "
                        "run between the chunks of a long dense prefill")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="while a step carries other work (decoding requests, shorter prompts, recoveries) or "
                        "requests wait, a long prompt's chunk is at most this many tokens, so requests arriving "
                        "meanwhile wait for a short step (default: no cap)")
    p.add_argument("--max-recovery-rows", type=int, default=None,
                   help="prompt rows one recovery forward (cacheblend, redknot, ...) starts with at most "
                        "(the memory profile sizes the activations for it; default 4 x max-num-batched-tokens)")
    p.add_argument("--chunk-cache-bytes", type=int, default=None,
                   help="pool bytes cached document KV may hold at most (default: as much as the pool has free)")
    add_offload_arguments(p)
    add_pd_arguments(p)
    p.add_argument("--retrieval-heads", action="store_true",
                   help="serve the head config's retrieval heads as sink + window + the prompt tokens covering "
                        "its retrieval_top_p of the observation window's attention (default: as global heads)")
    p.add_argument("--decode-kv-budget", default=None, metavar="BUDGET",
                   help="per-head decode KV budget with H2O heavy hitters: tokens (512) or a fraction of the "
                        "context (0.1) for global and retrieval heads, or per class: global=0.1,retrieval=256")
    p.add_argument("--decode-kv-window", type=int, default=128,
                   help="recent tokens a budgeted head keeps inside its budget")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model, or redknot-testbed)")
    p.add_argument("--cuda-graph-max-len", type=int, default=0,
                   help="capture decode CUDA graphs for contexts up to this many tokens at start-up "
                        "(default 0: each one is captured when first met)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, replacing the tokenizer's (vLLM's flag)")
    p.add_argument("--tool-call-parser", default="hermes", choices=("hermes", "llama3_json"),
                   help="how tool calls are read from outputs under tool_choice auto: Hermes/Qwen <tool_call> "
                        "blocks or Llama 3 JSON (required and named tool choices are guided, whatever the parser)")
    p.add_argument("--log-level", default="info")
    g = p.add_argument_group("security and limits")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every /v1 route (repeat for several keys; "
                        "default: $REDKNOT_API_KEY, else open). /metrics takes these keys too (or --metrics-key); "
                        "/health stays open")
    g.add_argument("--metrics-key", default=None, metavar="KEY",
                   help="the key /metrics requires instead of the API keys (e.g. a scraper's own; default: "
                        "$REDKNOT_METRICS_KEY, else the API keys; open when there are none)")
    g.add_argument("--share-cache-across-keys", action="store_true",
                   help="with several API keys, let them share cached prompt content (--cache-isolation shared)")
    g.add_argument("--cache-isolation", default=None, choices=("shared", "per-key", "per-salt"),
                   help="who shares cached prompt content: everyone (shared), requests of one API key (per-key, "
                        "the default), or requests of one key naming the same cache_salt (per-salt: every request "
                        "must carry one; 400 without)")
    g.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body (413 past it; default: 64 bytes per context token, at least 1 MiB)")
    g.add_argument("--max-documents", type=int, default=256, help="documents per request at most")
    g.add_argument("--max-document-bytes", type=int, default=None,
                   help="UTF-8 bytes per document at most (default: 32 per context token, at least 256 KiB)")
    g.add_argument("--max-stop-strings", type=int, default=16, help="stop strings (and stop_token_ids) per request")
    g.add_argument("--max-stop-string-chars", type=int, default=256, help="characters per stop string")
    g.add_argument("--tokenizer-workers", type=int, default=2,
                   help="threads that tokenise requests (never the event loop)")
    g.add_argument("--timeout-keep-alive", type=float, default=5,
                   help="seconds an idle keep-alive connection stays open (uvicorn; vLLM's default)")
    g.add_argument("--read-timeout", type=float, default=30,
                   help="seconds a connection has to send each whole request (slow senders are closed)")
    g.add_argument("--write-timeout", type=float, default=30,
                   help="seconds a client may take none of its response before it is disconnected and its "
                        "request aborted (KV pages freed)")
    g.add_argument("--shutdown-timeout", type=float, default=30,
                   help="on SIGTERM/SIGINT, seconds requests in flight get to finish; then they are aborted and "
                        "the server exits")
    g.add_argument("--limit-concurrency", type=int, default=None,
                   help="answer 503 (JSON, Retry-After) once this many requests are in flight; /health and "
                        "/metrics are always answered (default: no limit)")
    g.add_argument("--max-connections", type=int, default=None,
                   help="close new connections past this many open ones (default: the file-descriptor limit, "
                        "raised to its hard maximum, less a reserve)")


def add_pd_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation (docs/pd.md; behind vllm-router --vllm-pd-disaggregation)")
    g.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                   help="prefill: keep prefilled requests' pages (per head, what the plan sees) for a decode "
                        "instance to pull; decode: pull them and decode; both (default): either leg, and plain "
                        "requests as always")
    g.add_argument("--pd-transport", choices=("tcp", "cuda_ipc", "nccl", "nixl"), default="tcp",
                   help="how page bytes travel: tcp (ZeroMQ), cuda_ipc (two processes on one GPU), nccl "
                        "(torch.distributed point-to-point; gloo on CPUs), nixl (NIXL READs; needs redknot[nixl])")
    g.add_argument("--pd-host", default=None,
                   help="address the KV server binds and names in kv_transfer_params (default: --host)")
    g.add_argument("--pd-port", type=int, default=0, help="KV server port (default 0: any free one)")
    g.add_argument("--pd-lease-s", type=float, default=30.0,
                   help="seconds a prefilled request's pages wait for their pull before they are freed")
    g.add_argument("--pd-pull-timeout-s", type=float, default=30.0,
                   help="a decode instance's pull fails after this long without data")
    g.add_argument("--pd-on-failure", choices=("recompute", "fail"), default="recompute",
                   help="when a pull fails (prefill gone, lease expired, checksum or plan mismatch): compute the "
                        "prompt here (recompute) or answer 503 (fail)")
    g.add_argument("--pd-nccl-init", default=None, metavar="URL",
                   help="torch.distributed init method shared by a prefill/decode pair (tcp://host:port; nccl)")
    g.add_argument("--pd-nccl-rank", type=int, default=None, choices=(0, 1),
                   help="0 on the prefill instance, 1 on the decode instance (nccl)")


def pd_options(args: argparse.Namespace):
    """PDOptions from the --role and --pd-* flags (the default role, both, serves either leg)."""
    from .pd import PDOptions

    try:
        return PDOptions(role=args.role, transport=args.pd_transport, host=args.pd_host or args.host,
                         port=args.pd_port, lease_s=args.pd_lease_s, pull_timeout_s=args.pd_pull_timeout_s,
                         on_failure=args.pd_on_failure, nccl_init=args.pd_nccl_init, nccl_rank=args.pd_nccl_rank)
    except ValueError as e:
        raise SystemExit(f"redknot serve: {e}") from None


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..engine import LLM
    from ..engine.async_engine import AsyncLLMEngine
    from .app import ServerLimits, build_app
    from .http import uvicorn_config

    api_keys = api_keys_of(args)
    log = logging.getLogger("redknot")  # the server's own messages (PD handoffs, tiers) beside uvicorn's
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.setLevel(args.log_level.upper())
        log.propagate = False
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_documents=args.max_documents,
                          max_document_bytes=args.max_document_bytes, max_stop_strings=args.max_stop_strings,
                          max_stop_string_chars=args.max_stop_string_chars, tokenizer_workers=args.tokenizer_workers)

    llm = LLM(model=args.model, head_config=args.head_config, device=args.device,
              dtype=args.dtype, kv_pages=args.kv_pages, page_size=args.page_size, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, max_recovery_rows=args.max_recovery_rows,
              long_prefill_token_threshold=args.long_prefill_token_threshold, chunk_cache_bytes=args.chunk_cache_bytes, kv_offload=kv_offload_options(args),
              kv_events=kv_events_options(args),
              gpu_memory_utilization=args.gpu_memory_utilization, selection=selection_options(args),
              tensor_parallel_size=args.tensor_parallel_size)
    set_default_method(llm, args.method)
    print(f"default method: {llm.method}; prefix caching on", flush=True)
    print(capacity_summary(llm.engine), flush=True)
    if args.cuda_graph_max_len > 0:
        n = llm.engine.capture_graphs(args.cuda_graph_max_len)
        print(f"captured {n} decode CUDA graphs (contexts up to {args.cuda_graph_max_len} tokens)", flush=True)
    engine = AsyncLLMEngine(llm, max_num_seqs=args.max_num_seqs)
    try:
        app = build_app(engine, args.served_model_name or (args.model or "redknot-testbed"), api_keys=api_keys,
                        limits=limits, share_cache_across_keys=args.share_cache_across_keys,
                        cache_isolation=args.cache_isolation,
                        tool_call_parser=args.tool_call_parser, chat_template=args.chat_template,
                        metrics_key=args.metrics_key or os.environ.get("REDKNOT_METRICS_KEY") or None,
                        pd=pd_options(args))
    except ValueError as e:
        engine.shutdown()
        raise SystemExit(f"redknot serve: {e}") from None
    if app.state.pd is not None and app.state.pd.server is not None:
        print(f"role {args.role}: KV server at {app.state.pd.address} ({args.pd_transport})", flush=True)
    print(f"API key required on /v1 routes: {'yes' if api_keys else 'no'}; "
          f"max context of a default request: {llm.max_context()} tokens", flush=True)
    try:
        uvicorn.Server(uvicorn_config(app, args.host, args.port, log_level=args.log_level,
                                      timeout_keep_alive=args.timeout_keep_alive,
                                      limit_concurrency=args.limit_concurrency, read_timeout=args.read_timeout,
                                      max_connections=args.max_connections, write_timeout=args.write_timeout,
                                      shutdown_timeout=args.shutdown_timeout)).run()
    finally:
        if app.state.pd is not None:
            app.state.pd.close()
        engine.shutdown()
    return 0


def byte_size(text: str) -> int:
    """Bytes from an integer with an optional binary suffix: 512, 64K, 8G, 1.5T."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in units else ""
    try:
        value = float(t[:len(t) - len(unit)]) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 512, 64K, 8G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a byte size is >= 0, got {text!r}")
    return int(value)


def add_offload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV offload (document KV tiers under the GPU pool)")
    g.add_argument("--kv-offload-cpu-bytes", "--kv-cpu-bytes", dest="kv_cpu_bytes", type=byte_size, default=0,
                   metavar="BYTES", help="host memory for document KV the pool evicts (pinned on CUDA; e.g. 16G)")
    g.add_argument("--kv-disk-dir", default=None, help="directory of the disk tier (one file per document; "
                   "found again after a restart)")
    g.add_argument("--kv-disk-bytes", type=byte_size, default=0, metavar="BYTES",
                   help="bytes the disk tier holds at most (needed with --kv-disk-dir)")
    g.add_argument("--kv-remote", "--kv-redis-url", dest="kv_redis_url", default=None, metavar="URL",
                   help="Redis/Valkey tier shared by replicas, redis://host:port/db (a dead server is skipped)")
    g.add_argument("--kv-remote-ttl", dest="kv_redis_ttl", type=float, default=None, metavar="SECONDS",
                   help="expiry of entries written to the Redis tier (default: none; the server's maxmemory "
                        "policy evicts)")
    g.add_argument("--kv-remote-timeout", dest="kv_redis_timeout", type=float, default=0.5, metavar="SECONDS",
                   help="socket timeout of each Redis call")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV cache events for KV-aware routers, vLLM's flag: "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                        "\"replay_endpoint\": \"tcp://*:5558\", \"documents\": true}' (documents: also announce "
                        "each cached document as one block)")
    g.add_argument("--kv-write-policy", choices=("write_through", "write_back"), default="write_through",
                   help="write_through: a document's KV goes down when computed; write_back: when the pool "
                        "evicts it")


def kv_offload_options(args: argparse.Namespace):
    """KVOffloadConfig from the --kv-* flags (None when no tier is asked for)."""
    from ..cache.tiers import KVOffloadConfig
    if not (args.kv_cpu_bytes or args.kv_disk_dir or args.kv_redis_url):
        return None
    try:
        return KVOffloadConfig(cpu_bytes=args.kv_cpu_bytes, disk_dir=args.kv_disk_dir, disk_bytes=args.kv_disk_bytes,
                               redis_url=args.kv_redis_url, redis_ttl_s=args.kv_redis_ttl,
                               redis_timeout_s=args.kv_redis_timeout, write_policy=args.kv_write_policy)
    except ValueError as e:
        raise SystemExit(f"redknot serve: {e}") from None


def kv_events_options(args: argparse.Namespace):
    """KVEventsConfig from --kv-events-config (None when off)."""
    import json

    from ..cache.events import KVEventsConfig
    if not args.kv_events_config:
        return None
    try:
        options = json.loads(args.kv_events_config)
        if not isinstance(options, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        return KVEventsConfig.from_vllm(options)
    except ValueError as e:  # json.JSONDecodeError is one
        raise SystemExit(f"redknot serve: --kv-events-config: {e}") from None


def selection_options(args: argparse.Namespace):
    """SelectionOptions from --retrieval-heads / --decode-kv-budget (None when neither is given)."""
    from ..engine.selective import SelectionOptions
    if not args.retrieval_heads and args.decode_kv_budget is None:
        return None
    try:
        return SelectionOptions(retrieval_heads=args.retrieval_heads, decode_kv_budget=args.decode_kv_budget,
                                decode_kv_window=args.decode_kv_window)
    except ValueError as e:
        raise SystemExit(f"redknot serve: {e}") from None


def api_keys_of(args: argparse.Namespace) -> list[str]:
    """The keys of ``--api-key``, else ``$REDKNOT_API_KEY``; none: the server is open."""
    if args.api_key:
        return [k for k in args.api_key if k]
    key = os.environ.get("REDKNOT_API_KEY", "")
    return [key] if key else []


def capacity_summary(engine) -> str:
    """What the pool holds, said at start-up: pages, bytes, and sessions of 8K/32K/128K per head plan."""
    mem = engine.memory
    lines = [f"KV pool: {mem['kv_pages']} pages of {engine.pool.bytes_per_page} B = {mem['kv_bytes'] / 2**30:.2f} GiB"]
    if "weights_bytes" in mem:
        lines[0] += (f" (of {mem['total_bytes'] / 2**30:.1f} GiB x {mem['gpu_memory_utilization']}: weights "
                     f"{mem['weights_bytes'] / 2**30:.2f}, activations {mem['activation_bytes'] / 2**30:.2f}, "
                     f"graphs {mem['graph_reserve_bytes'] / 2**30:.2f}, other {mem['other_bytes'] / 2**30:.2f} GiB)")
    for plan, per in engine.capacity().items():
        fits = ", ".join(f"{n // 1024}K: {v['sessions']}" for n, v in per.items())
        lines.append(f"  sessions that fit under the {plan} plan: {fits or 'none (max_model_len)'}")
    return "\n".join(lines)


def set_default_method(llm, method: str = "auto") -> str:
    """The method requests that name none get (``auto``: ``LLM.auto_method``)."""
    llm.method = llm.check_method(llm.auto_method if method == "auto" else method)
    return llm.method


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot serve", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

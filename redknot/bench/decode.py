"""`redknot bench decode`: offline decode throughput against the memory-bandwidth bound (GPU).

Real architectures with random bf16 weights (timings do not depend on weight values). For each
context length and batch size, B sequences of random tokens hold ``context`` tokens of KV (pages
filled with random values: the decode step reads the same bytes as after a real prefill, without
spending the run on prefills), then decode ``--tokens`` tokens each through ``Engine.step()``:
the whole engine loop (scheduling, sampling, detokenisation, CUDA-graph replay) is in the time.

The bound of a step is (weight bytes + KV bytes the plan reads) / bandwidth; on a mixture of
experts the weight bytes are the active ones: the dense parts and, of each MoE layer's E experts,
the E(1 - (1 - k/E)^B) a step of B sequences is expected to touch (B*k uniform picks). With latent
attention (DeepSeek's MLA) the KV bytes are each layer's cached [k_rope | latent] rows that any of
its query heads sees, read once for all of them. The table shows
tok/s, its fraction of the bound, and HF transformers' eager ``generate`` in the same run (its
decode time is generate(N tokens) - generate(1 token), so its prefill is not counted).

``--structured-output json`` adds, beside each row, the same decode with every sequence under a
JSON-schema grammar (xgrammar bitmasks in the sampler): the cost of guided decoding, in one run.
Its grammar works on a tokenizer of the architecture's vocabulary: ``--tokenizer DIR`` (the real
one), else a byte-level BPE of that size trained on Python's standard-library sources.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

import torch

from ..engine.selective import SELECTED_METHODS, selection_for
from ..visibility import visible_keys
from ..models.config import ModelConfig
from .common import ARCHS, head_config, hf_model, parse_names, sync

METHODS = ("dense", "headsparse", "hf")
# Rows with selected sets (the engine's SELECTED_METHODS); --decode-kv-budget sets the budget.
SELECTIVE = tuple(SELECTED_METHODS)
ALL_METHODS = METHODS + tuple(SELECTIVE)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="mistral-7b", choices=sorted(ARCHS))
    p.add_argument("--cases", default="1x1024,8x1024,32x1024,64x1024,128x1024,256x1024,"
                                      "1x4096,8x4096,32x4096,64x4096,128x4096,16x32768",
                   help="comma list of BATCHxCONTEXT")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma list of {', '.join(ALL_METHODS)}: h2o = dense with a decode KV budget on every "
                        "head, headsparse_h2o = headsparse with the budget on its global and retrieval heads, "
                        "retrieval = headsparse with live retrieval heads (a head config with retrieval entries)")
    p.add_argument("--decode-kv-budget", default="0.1", help="the h2o rows' budget (tokens or a fraction)")
    p.add_argument("--decode-kv-window", type=int, default=128, help="the h2o rows' recent window")
    p.add_argument("--retrieval-ratio", type=float, default=0.0,
                   help="make this share of each layer's local heads retrieval heads (their window and sink "
                        "kept), for the retrieval rows when the head config has none")
    p.add_argument("--kv-pages", default="cases",
                   help="pool pages: 'cases' (the largest case under the dense plan), 'auto' (the engine's "
                        "gpu_memory_utilization sizing) or a number")
    p.add_argument("--head-config", default="g15-w1024", help="headsparse's plan: g15-w1024, g15-w4096 or anchor")
    p.add_argument("--anchor-head-config", default=None)
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed per case")
    p.add_argument("--hf-max-context", type=int, default=4096, help="HF eager only for contexts up to this")
    p.add_argument("--hf-max-batch", type=int, default=64)
    p.add_argument("--bandwidth", type=float, default=4.0e12, help="bytes/s of the bound (H200: ~4 TB/s)")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--no-async-decode", action="store_true",
                   help="the host reads each step's tokens before the next step is launched")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also run 4 eager (graph-free) steps of each case under torch.profiler; op tables in DIR")
    p.add_argument("--structured-output", default="none", choices=("none", "json"),
                   help="json: also time each row with every sequence under a JSON-schema grammar")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="HF tokenizer of the architecture (the grammar's vocabulary; default: a BPE of its "
                        "vocabulary size trained on Python's sources)")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)


def _cases(spec: str) -> list[tuple[int, int]]:
    out = []
    for item in spec.split(","):
        b, _, n = item.partition("x")
        if not (b.isdigit() and n.isdigit()):
            raise ValueError(f"--cases: {item!r} is not BATCHxCONTEXT")
        out.append((int(b), int(n)))
    return out


def _weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: every matrix but the embedding table (only B rows);
    a tied LM head is counted (it reads the whole table)."""
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen or name.endswith("embed_tokens.weight"):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def _active_weight_bytes(model, cfg: ModelConfig, batch: int) -> int:
    """``_weight_bytes`` with each MoE layer's experts counted at the share a decode step of ``batch``
    sequences is expected to touch: 1 - (1 - k/E)^B (B*k uniform picks of k distinct experts each)."""
    if cfg.moe is None:
        return _weight_bytes(model)
    share = expert_share(cfg, batch)
    seen, total = set(), 0.0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or name.endswith("embed_tokens.weight"):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size() * (share if ".experts." in name else 1.0)
    return int(total)


def expert_share(cfg: ModelConfig, batch: int) -> float:
    """The expected share of a MoE layer's experts a decode step of ``batch`` tokens touches."""
    return 1 - (1 - cfg.moe.top_k / cfg.moe.num_experts) ** batch


def _kv_read_bytes(cfg: ModelConfig, window, sink, context: int, batch: int, itemsize: int) -> int:
    """KV bytes one decode step reads under a plan (window/sink [L, Hkv]): each head its sink and
    window of the context, every head all of it when global. MLA (window/sink per query head): each
    layer's latent rows that some query head sees (the widest window and sink), latent_dim wide."""
    if cfg.mla is not None:
        window, sink = window.max(dim=1, keepdim=True).values, sink.max(dim=1, keepdim=True).values
        return int(visible_keys(window, sink, context).sum()) * cfg.mla.latent_dim * itemsize * batch
    return int(visible_keys(window, sink, context).sum()) * 2 * cfg.head_dim * itemsize * batch


def _fill_random(pool) -> None:
    g = torch.Generator(device=pool.device).manual_seed(0)
    for t in (pool.k_pages, pool.v_pages):
        for i in range(0, t.shape[0], 4096):
            t[i:i + 4096].normal_(generator=g)


# The guided rows' schema: a long array of small records, so the grammar constrains every timed step.
BENCH_SCHEMA = {"type": "array", "minItems": 512, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
                                     "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                              "maxItems": 4}},
    "required": ["id", "name", "tags"], "additionalProperties": False}}


def corpus_tokenizer(vocab_size: int):
    """A byte-level BPE of ``vocab_size`` tokens trained on Python's standard-library sources: a
    realistic vocabulary for grammar masks where no real tokenizer is at hand."""
    import sysconfig
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts, size = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            texts.append(f.read_text(errors="ignore"))
        except OSError:
            continue
        size += len(texts[-1])
        if size > 8 << 20:
            break
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _time_engine(llm, method: str, batch: int, context: int, tokens: int, profile: str | None = None,
                 structured=None) -> dict:
    from ..engine.detokenizer import IncrementalDetokenizer
    from ..engine.sampling import SamplingParams

    engine = llm.engine
    vocab = llm.config.vocab_size
    params = SamplingParams(max_tokens=tokens + 2, temperature=0, ignore_eos=True, structured_outputs=structured)
    seqs = []
    g = torch.Generator().manual_seed(batch * 7 + context)
    cfg = llm.config
    try:
        for _ in range(batch):
            ids = torch.randint(10, vocab, (context + 1,), generator=g).tolist()
            seq = llm.make_sequence(ids, params, method=method)
            engine.prepare(seq)
            seq.detok = IncrementalDetokenizer(llm.tokenizer, lazy=True)
            engine.pool.add_sequence(seq.seq_id, seq.plan)
            engine.running.append(seq)
            seqs.append(seq)
            engine.pool.ensure(seq.seq_id, context)  # the context's KV is "there": random pages
            engine.pool.trim(seq.seq_id)
            seq.num_computed = context
            seq.first_token_time = time.perf_counter()
            if engine.selection is not None and seq.plan in engine.selection.derived:
                # select now from random observation queries, so only the kept pages stay allocated
                q = [torch.randn(8, cfg.num_attention_heads, cfg.head_dim, device=llm.device, dtype=llm.dtype)
                     for _ in range(cfg.num_hidden_layers)]
                engine.selection.select_from(seq, q, context)
        held = sum(engine.pool.pages_held(s.seq_id) for s in seqs)
        for _ in range(2):  # warm: captures the batch's graph
            engine.step()
        sync(llm.device)
        engine.timings = dict.fromkeys(engine.timings, 0)
        engine.runner.graph_events = [] if engine.runner.cuda_graphs else None
        checks0 = engine.selection.checks if engine.selection is not None else 0
        t0 = time.perf_counter()
        for _ in range(tokens):
            engine.step()
        sync(llm.device)
        dt = time.perf_counter() - t0
        # budget checks (one per sequence every page_size steps) fall inside the timed steps only
        # when --tokens spans a check position: report how many did
        checks = (engine.selection.checks if engine.selection is not None else 0) - checks0
        events, engine.runner.graph_events = engine.runner.graph_events, None
        host = {k: v / tokens for k, v in engine.timings.items() if k != "steps"}
        if events:
            host["graph_gpu"] = sum(a.elapsed_time(b) for a, b in events) / 1e3 / len(events)
        graph_s = None
        graph = engine.runner.last_graph
        if graph is not None:  # the device's share of a step: the captured forward alone, back to back
            graph.replay()
            sync(llm.device)
            t0 = time.perf_counter()
            for _ in range(10):
                graph.replay()
            sync(llm.device)
            graph_s = (time.perf_counter() - t0) / 10
        if profile:
            from torch.profiler import ProfilerActivity, profile as torch_profile
            graphs, engine.runner.cuda_graphs = engine.runner.cuda_graphs, False  # kernels, not a replay
            try:
                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(4):
                        engine.step()
                    sync(llm.device)
            finally:
                engine.runner.cuda_graphs = graphs
            os.makedirs(profile, exist_ok=True)
            with open(os.path.join(profile, f"decode_{method}_{batch}x{context}.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
        # guided rows: how many sequences were still inside their grammar when the timing ended
        constrained = sum(1 for s in seqs if s.grammar is not None and not s.grammar.terminated)
    finally:
        for s in seqs:
            engine.abort(s)
    return {"s_per_step": dt / tokens, "tok_s": batch * tokens / dt, "graph_s_per_step": graph_s,
            "constrained_at_end": constrained if structured is not None else None,
            "phases_s_per_step": host, "pages_held_at_start": held, "budget_checks": checks,
            "kv_bytes_held_at_start": held * engine.pool.bytes_per_page}


def _time_hf(hf, batch: int, context: int, tokens: int, dev) -> dict:
    """HF transformers' eager decode loop (what ``generate`` runs per token, without its
    logits processors): prefill once, then one forward per token over its KV cache."""
    ids = torch.randint(10, hf.config.vocab_size, (batch, context), device=dev)
    with torch.inference_mode():
        out = hf(ids, use_cache=True, logits_to_keep=1)
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        del out
        for _ in range(2):  # warm
            out = hf(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(tokens):
            out = hf(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(dev)
        dt = time.perf_counter() - t0
    del cache, out
    return {"s_per_step": dt / tokens, "tok_s": batch * tokens / dt}


def run(args) -> dict:
    from ..engine import LLM

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    methods = parse_names(args.methods, ALL_METHODS, "method")
    cases = _cases(args.cases)
    arch = dict(ARCHS[args.arch])
    max_ctx = max(n for _, n in cases) + args.tokens + 8
    arch["max_position_embeddings"] = max(max_ctx, 4096)
    cfg = ModelConfig.from_dict(arch)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    itemsize = torch.tensor([], dtype=dtype).element_size()
    result = {"benchmark": "decode", "arch": args.arch, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda"
              else "cpu", "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "redknot " + " ".join(sys.argv[1:]), "bandwidth": args.bandwidth,
              "head_config": args.head_config, "decode_kv_budget": getattr(args, "decode_kv_budget", None),
              "rows": []}
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        pass
    rows = result["rows"]
    if "hf" in methods:
        hf = hf_model(ARCHS[args.arch], dev, dtype)
        for b, n in cases:
            if b > args.hf_max_batch or n > args.hf_max_context:
                continue
            try:
                r = _time_hf(hf, b, n, min(args.tokens, 32), dev)
            except torch.OutOfMemoryError as e:  # a large MoE's KV cache beside its weights: the row says so
                rows.append({"method": "hf", "batch": b, "context": n, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"hf          B={b:>3} ctx={n:>6}: {rows[-1]['error']}", flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                continue
            rows.append({"method": "hf", "batch": b, "context": n, **r})
            print(f"hf          B={b:>3} ctx={n:>6}: {r['tok_s']:9.1f} tok/s", flush=True)
        del hf
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    ours = [m for m in methods if m != "hf"]
    if ours:
        head = head_config(args.head_config, cfg, args.anchor_head_config)
        if getattr(args, "retrieval_ratio", 0.0) > 0:
            head = _with_retrieval(head, args.retrieval_ratio)
        # a pool for the largest case under the dense plan (+ a page per head and sequence); MLA stores
        # one latent head per layer, a hybrid's linear layers none
        heads = len(cfg.attention_layers) * (1 if cfg.mla is not None else cfg.num_key_value_heads)
        pages = max(b * heads * (-(-(n + args.tokens + 8) // 64) + 1) for b, n in cases)
        kv_pages = getattr(args, "kv_pages", "cases")
        pages = None if kv_pages == "auto" else (pages if kv_pages == "cases" else int(kv_pages))
        llm = LLM(model=cfg, head_config=head, device=dev, dtype=dtype, kv_pages=pages, max_num_seqs=max(b for b, _ in cases),
                  max_model_len=arch["max_position_embeddings"], enable_prefix_caching=False,
                  cuda_graphs=not args.no_cuda_graphs, chunk_cache_bytes=0,
                  async_decode=False if getattr(args, "no_async_decode", False) else None)
        _fill_random(llm.pool)
        guided = None
        if getattr(args, "structured_output", "none") == "json":
            from transformers import AutoTokenizer

            from ..engine.structured import StructuredOutputs
            llm.tokenizer = llm.engine.tokenizer = (AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer
                                                    else corpus_tokenizer(cfg.vocab_size))
            guided = StructuredOutputs(json=BENCH_SCHEMA)
            llm.grammars.compile(guided)  # compiled once, before any timing
        result["weight_bytes"] = _weight_bytes(llm.model)
        if cfg.moe is not None:
            result["moe"] = {"num_experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
                             "bound": "weights: dense parts + each MoE layer's experts x E(1-(1-k/E)^B)/E"}
        state_slot = llm.pool.linear_state.bytes_per_slot if llm.pool.linear_state is not None else 0
        if state_slot:
            result["linear_state"] = {"bytes_per_sequence": state_slot,
                                      "bound": "each step reads and writes every sequence's linear-layer state"}
        if cfg.mla is not None:
            result["mla"] = {"kv_lora_rank": cfg.mla.kv_lora_rank, "qk_rope_head_dim": cfg.mla.qk_rope_head_dim,
                             "bound": "KV: per layer the latent rows (latent + k_rope) its widest query head sees"}
        vis = {"dense": llm.engine.runner.plans["dense"], "headsparse": llm.engine.runner.plans["headsparse"]}
        runs = [(m, None) for m in ours] + ([(m, guided) for m in ours] if guided is not None else [])
        for b, n in cases:
            for m, structured in sorted(runs, key=lambda r: ours.index(r[0])):
                base = _use_selection(llm, m, args)
                label = m if structured is None else f"{m}+json"
                try:
                    r = _time_engine(llm, base, b, n, args.tokens, args.profile, structured)
                except Exception as e:  # e.g. a dense 64 x 32K pool does not fit: the row says so
                    rows.append({"method": label, "batch": b, "context": n, "error": f"{type(e).__name__}: {e}"[:300]})
                    print(f"{label:<11} B={b:>3} ctx={n:>6}: {rows[-1]['error']}", flush=True)
                    continue
                if structured is not None:
                    plain = next((x for x in rows if x["method"] == m and x["batch"] == b and x["context"] == n
                                  and "tok_s" in x), None)
                    rows.append({"method": label, "batch": b, "context": n, **r,
                                 "of_unguided": r["tok_s"] / plain["tok_s"] if plain else None})
                    print(f"{label:<11} B={b:>3} ctx={n:>6}: {r['tok_s']:9.1f} tok/s"
                          + (f" ({rows[-1]['of_unguided']:.3f} of unguided)" if plain else "")
                          + f", {r['constrained_at_end']}/{b} sequences still inside the grammar", flush=True)
                    continue
                kv = (r["kv_bytes_held_at_start"] if m in SELECTIVE
                      else _kv_read_bytes(cfg, vis[base][0].cpu(), vis[base][1].cpu(), n, b, itemsize))
                weights = _active_weight_bytes(llm.model, cfg, b)
                state = 2 * state_slot * b  # a hybrid's linear state, read and written back
                bound = b / ((weights + kv + state) / args.bandwidth)
                rows.append({"method": m, "batch": b, "context": n, **r, "kv_read_bytes": kv,
                             "weight_read_bytes": weights, "state_read_write_bytes": state, "bound_tok_s": bound,
                             "of_bound": r["tok_s"] / bound})
                gpu = f", forward alone {1e3 * r['graph_s_per_step']:.2f} ms" if r["graph_s_per_step"] else ""
                gpu += " (" + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in r["phases_s_per_step"].items()) + " ms)"
                print(f"{m:<11} B={b:>3} ctx={n:>6}: {r['tok_s']:9.1f} tok/s  ({100 * r['tok_s'] / bound:5.1f}% "
                      f"of the {bound:.0f} tok/s bound), step {1e3 * r['s_per_step']:.2f} ms{gpu}", flush=True)
    print_table(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _with_retrieval(head, ratio: float):
    """The head config with round(ratio x local heads) of each layer's local heads made retrieval."""
    from ..config import HeadConfig
    classes = [list(r) for r in head.classes]
    for row in classes:
        local = [h for h, c in enumerate(row) if c == "local"]
        for h in local[:round(ratio * len(local))]:
            row[h] = "retrieval"
    return HeadConfig(classes, [list(r) for r in head.windows], [list(r) for r in head.sinks], head.retrieval_top_p,
                      head.dense_prefix_layers, {**head.metadata, "derived": f"{ratio:.0%} of local heads retrieval"})


def _use_selection(llm, method: str, args) -> str:
    """Give the engine the selected-set options of ``method``'s row (none for the plain
    methods); returns the base method its requests run."""
    from ..engine.selective import HeadSelection

    base, opts = selection_for(method, args.decode_kv_budget, args.decode_kv_window)
    llm.engine.selection = None if opts is None else HeadSelection.for_engine(llm.engine, opts)
    return base


def print_table(result: dict) -> None:
    guided = [r for r in result["rows"] if r["method"].endswith("+json") and "tok_s" in r]
    if guided:
        print("\nguided decoding (JSON schema, xgrammar bitmasks) against the same decode without one:")
        print(f"{'method':<16}{'B x ctx':>13}{'tok/s':>10}{'of unguided':>13}{'constrained':>13}")
        for r in guided:
            print(f"{r['method']:<16}{r['batch']:>5} x {r['context']:<6}{r['tok_s']:>10.0f}"
                  f"{r['of_unguided'] or float('nan'):>13.3f}{r['constrained_at_end']:>10}/{r['batch']}")
    rows = [r for r in result["rows"] if "tok_s" in r and not r["method"].endswith("+json")]
    sel = [r for r in rows if r["method"] in SELECTIVE]
    if sel:
        base = {(r["method"], r["batch"], r["context"]): r for r in rows if r["method"] in ("dense", "headsparse")}
        print(f"\nselected-set rows (decode KV budget {result.get('decode_kv_budget')}):")
        print(f"{'method':<15}{'B x ctx':>13}{'tok/s':>10}{'KV read GiB':>13}{'x dense':>9}{'x headsparse':>13}"
              f"{'checks':>8}")
        for r in sel:
            ratio = [r["tok_s"] / b["tok_s"] if b else float("nan")
                     for b in (base.get((m, r["batch"], r["context"])) for m in ("dense", "headsparse"))]
            print(f"{r['method']:<15}{r['batch']:>5} x {r['context']:<6}{r['tok_s']:>10.0f}"
                  f"{r['kv_read_bytes'] / 2**30:>13.2f}{ratio[0]:>9.2f}{ratio[1]:>13.2f}{r.get('budget_checks', 0):>8}")
    result = {**result, "rows": [r for r in rows if r["method"] not in SELECTIVE]}
    rows = result["rows"]
    by = {(r["method"], r["batch"], r["context"]): r for r in rows}
    cases = sorted({(r["batch"], r["context"]) for r in rows}, key=lambda c: (c[1], c[0]))
    print(f"\ndecode, {result['arch']}, {result['device']}, {result['dtype']}: tok/s (fraction of the "
          f"weights+KV bandwidth bound)")
    if result.get("moe"):
        m = result["moe"]
        print(f"MoE ({m['num_experts']} experts, top-{m['top_k']}): the bound's weight bytes are the active ones, the "
              f"dense parts and the E(1-(1-k/E)^B) experts per layer B*k uniform picks touch on average")
    if result.get("mla"):
        m = result["mla"]
        print(f"latent attention: the bound's KV bytes are {m['kv_lora_rank']} + {m['qk_rope_head_dim']} elements per "
              f"token and layer (read once for every query head; headsparse: what the widest head of a layer sees)")
    print(f"{'B x ctx':>12} {'dense':>16} {'headsparse':>16} {'hf eager':>10} {'dense/hf':>9} {'hs/dense':>9}")
    for b, n in cases:
        d, h, f = by.get(("dense", b, n)), by.get(("headsparse", b, n)), by.get(("hf", b, n))

        def cell(r):
            return f"{r['tok_s']:8.0f} ({100 * r['of_bound']:3.0f}%)" if r else f"{'-':>16}"

        print(f"{b:>5} x {n:<6} {cell(d)} {cell(h)} {f['tok_s'] if f else float('nan'):10.1f} "
              f"{d['tok_s'] / f['tok_s'] if d and f else float('nan'):9.2f} "
              f"{h['tok_s'] / d['tok_s'] if d and h else float('nan'):9.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot bench decode", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

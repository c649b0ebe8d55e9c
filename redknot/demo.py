"""`redknot demo`: RAG requests that share documents in different orders, served by every method.

It loads an HF checkpoint (without --model, a tiny random Llama written to a temporary directory,
so it runs offline on any CPU), checks redknot's forward against transformers, then sends the
same documents in three orders through every method: the first request cold (chunks computed and
cached), the others warm (chunks reused at new offsets). It prints time to first token, how many
prompt tokens came from a cache, agreement with dense on the first token, and the KV bytes each
method holds while decoding.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time

import torch

METHODS = ("dense", "headsparse", "prefix", "full_reuse", "epic", "cacheblend", "redknot", "redknot_kv",
           "redknot_exact")


def _documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    names = ["Ilsa Torv", "Marek Vann", "Oda Kell", "Brin Salo", "Tove Arden", "Kase Dunmor"]
    cities = ["Varna", "Lusk", "Orrin", "Pell", "Tamsk", "Eddow"]
    docs = []
    for i in range(n):
        name, city = names[i % len(names)], cities[(i * 2 + 1) % len(cities)]
        facts = [f"{name} founded the city of {city} in {rng.randint(1000, 1900)}.",
                 f"The river past {city} is called the {rng.choice(['Ardt', 'Mell', 'Sorn'])}.",
                 f"{name} later traded salt and amber with {rng.choice(names)}."]
        docs.append(" ".join(rng.choice(facts) for _ in range(14)))
    return docs


def run(args) -> int:
    from .config import HeadConfig, SparseFFNConfig
    from .engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from .tiny import make_tiny_checkpoint

            model = make_tiny_checkpoint(tmp, "llama", num_hidden_layers=4, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=32, max_position_embeddings=4096)
            print(f"wrote a tiny random Llama checkpoint to {model}")
        probe = LLM(model=model, device=args.device)
        cfg = probe.config
        heads = HeadConfig.synthetic(cfg.num_hidden_layers, cfg.num_key_value_heads, 0.25, window=128, sink=4)
        layers = cfg.num_hidden_layers
        sparse = SparseFFNConfig(dense_until=max(1, layers // 8), deep_layer_start=max(2, layers * 5 // 8),
                                 recent_n=32, min_keep=8)
        llm = LLM(model=model, device=args.device, head_config=heads, sparse_ffn=sparse, page_size=16)
        del probe
        counts = heads.class_counts()
        print(f"model: {cfg.model_type}, {layers} layers, {cfg.num_attention_heads} query / "
              f"{cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim}, device {llm.device}")
        print(f"head plan: {counts['global']} global / {counts['local']} local KV heads (window 128, sink 4); "
              f"sparse FFN from layer {sparse.dense_until}\n")
        docs = _documents(4)
        question = "Question: who founded the city of Lusk? Answer:"
        orders = [docs, [docs[2], docs[0], docs[3], docs[1]], docs[::-1]]
        _check_against_transformers(llm, model, question, docs)

        dense_logits = [llm.first_token_logits(question, documents=o, method="dense") for o in orders]
        n_tokens = len(llm._prompt_ids(question, docs))
        rows = []
        for m in METHODS:
            llm.chunk_store.clear()
            llm.prefix_store.clear()
            ttfts, cached, agree, cos = [], [], [], []
            for i, order in enumerate(orders):
                t0 = time.perf_counter()
                logits = llm.first_token_logits(question, documents=order, method=m)
                ttfts.append(time.perf_counter() - t0)
                cached.append(llm.last_prefill.cached_tokens if llm.last_prefill and m not in ("dense", "headsparse")
                              else 0)
                llm.last_prefill = None
                agree.append(bool(logits.argmax() == dense_logits[i].argmax()))
                cos.append(torch.nn.functional.cosine_similarity(logits.double(), dense_logits[i].double(), dim=0))
            rows.append((m, ttfts[0], statistics.median(ttfts[1:]), statistics.mean(cached[1:]), sum(agree),
                         float(torch.stack(cos).mean()), _held_kv_bytes(llm, m, question, docs, SamplingParams)))
        dense_bytes = rows[0][-1]
        print(f"3 requests, {len(docs)} shared documents in different orders, {n_tokens} prompt tokens each")
        print(f"{'method':<14} {'cold TTFT ms':>12} {'warm TTFT ms':>12} {'cached tok':>10} {'top-1=dense':>11} "
              f"{'logit cos':>9} {'KV held':>10} {'vs dense':>8}")
        for m, cold, warm, cached, agree, c, held in rows:
            print(f"{m:<14} {1e3 * cold:>12.1f} {1e3 * warm:>12.1f} {cached:>10.0f} {agree:>9}/3 {c:>9.4f} "
                  f"{held:>10,} {held / dense_bytes:>8.2f}")
        print("\nA random model's attention is spread over the whole context, so per-head windows and reuse "
              "without recovery\nchange its answers far more than a trained model's; quality is measured on "
              "the trained testbed model.\nTimes are CPU times of the torch reference path; GPU numbers are "
              "in docs/results/.")
    return 0


def _check_against_transformers(llm, model, question, docs) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = llm._prompt_ids(question, docs)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    ours = llm.first_token_logits(question, documents=docs, method="dense").cpu()
    err = ((ours - ref).norm() / ref.norm()).item()
    print(f"redknot forward vs transformers: relative logit error {err:.1e}, "
          f"same top-1: {ours.argmax().item() == ref.argmax().item()}\n")


def _held_kv_bytes(llm, method, question, docs, SamplingParams) -> int:
    """KV bytes the decode backend holds after the last step of a short generation."""
    backend = llm.backend(method)
    held = []
    end = backend.end

    def spy(ctx):
        end(ctx)
        held.append(backend.kv_bytes())

    backend.end = spy
    try:
        llm.generate(question, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), documents=docs,
                     method=method)
    finally:
        backend.end = end
    return held[-1]

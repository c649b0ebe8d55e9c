"""`redknot demo`: RAG requests that share documents in different orders, served by every method.

It loads the bundled testbed model (or ``--model DIR``) with its head config, checks redknot's
forward against transformers, then sends three questions about one set of generated documents,
each with the documents in another order, through every method: the first request cold (chunks
computed and cached), the others warm (chunks reused at new offsets). It prints time to first
token, prompt tokens served from a cache, agreement with dense on the first token, answers against
the gold ones, and the KV bytes each method holds while decoding.
"""

from __future__ import annotations

import contextlib
import random
import statistics

import torch

METHODS = ("dense", "headsparse", "prefix", "full_reuse", "epic", "cacheblend", "redknot_paper", "redknot",
           "redknot_exact")
CONTEXT_TOKENS = 640  # documents per request: big enough to hold several documents, small enough for 2 cores


def _requests(seed: int = 7):
    """Three questions about one generated set of documents, each in another order. Only types whose
    answer does not depend on the order of the documents (a cross_doc continuation needs its bio
    right before it)."""
    from .testbed.records import generate_records

    records = generate_records(seed, 1, context_tokens=CONTEXT_TOKENS, questions_per_context=3,
                               types=("single_hop", "multi_hop"))
    docs = records[0]["documents"]
    shuffled = docs[:]
    random.Random(seed).shuffle(shuffled)
    return [(r, order) for r, order in zip(records, (docs, shuffled, docs[::-1]))]


def run(args) -> int:
    from .engine import LLM, SamplingParams
    from .qa.answers import MAX_ANSWER_TOKENS, exact_match

    llm = LLM(model=args.model, device=args.device)  # default: the bundled model and its heads.json
    if llm.head_config is None:
        raise ValueError(f"{args.model}: no heads.json beside the checkpoint; write one with "
                         f"`redknot profile --model DIR --out DIR/heads.json`")
    cfg, counts = llm.config, llm.head_config.class_counts()
    print(f"model: {cfg.model_type}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} query / "
          f"{cfg.num_key_value_heads} KV heads, device {llm.device}; head plan: {counts['global']} global / "
          f"{counts['local'] + counts['retrieval']} local KV heads")
    requests = _requests()
    _check_against_transformers(llm, llm.model_dir, requests[0][0]["question"], requests[0][1])
    params = SamplingParams(max_tokens=MAX_ANSWER_TOKENS, temperature=0)
    rows, answers, dense_first = [], {}, []
    for m in METHODS:  # dense first: its first tokens are the reference
        llm.engine.clear_caches()
        ttfts, cached, agree, em = [], [], 0, 0
        with _kv_bytes_held(llm.engine) as held:
            for i, (rec, order) in enumerate(requests):
                out = llm.generate(rec["question"], params, documents=order, method=m)[0]
                ttfts.append(out.metrics["time_to_first_token"])
                cached.append(out.metrics["cached_tokens"])
                first = out.outputs[0].token_ids[0]  # greedy: the argmax of the first-token logits
                if m == "dense":
                    dense_first.append(first)
                agree += int(first == dense_first[i])
                text = out.outputs[0].text.strip()
                answers.setdefault(i, {})[m] = text
                em += int(exact_match(text, rec["answers"]))
        rows.append((m, ttfts[0], statistics.median(ttfts[1:]), statistics.mean(cached[1:]), agree, em, max(held)))
    dense_bytes = rows[0][-1]
    n_tokens = len(llm.prompt_ids(requests[0][0]["question"], requests[0][1]))
    print(f"3 requests over {len(requests[0][1])} shared documents in different orders, ~{n_tokens} prompt tokens each")
    print(f"{'method':<14} {'cold TTFT ms':>12} {'warm TTFT ms':>12} {'cached tok':>10} {'top-1=dense':>11} "
          f"{'EM':>5} {'KV held':>10} {'vs dense':>8}")
    for m, cold, warm, cached, agree, em, held in rows:
        print(f"{m:<14} {1e3 * cold:>12.1f} {1e3 * warm:>12.1f} {cached:>10.0f} {agree:>9}/3 {em:>3}/3 "
              f"{held:>10,} {held / dense_bytes:>8.2f}")
    print("\nanswers (gold | dense | full_reuse | redknot; a multi_hop answer states its first hop, then '=>' and "
          "the answer EM reads):")
    for i, (rec, _) in enumerate(requests):
        a = answers[i]
        print(f"  [{rec['type']}] {rec['question']}\n      {rec['answers'][0]} | {a['dense']} | {a['full_reuse']} | "
              f"{a['redknot_paper']}")
    print("\nCPU times of the torch reference path; GPU numbers and the quality tables are in docs/results/.")
    return 0


def _check_against_transformers(llm, model_dir, question, docs) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = llm.prompt_ids(question, docs)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    ours = llm.first_token_logits(question, documents=docs, method="dense").cpu().float()
    err = ((ours - ref).norm() / ref.norm()).item()
    print(f"redknot forward vs transformers: relative logit error {err:.1e}, "
          f"same top-1: {ours.argmax().item() == ref.argmax().item()}\n")


@contextlib.contextmanager
def _kv_bytes_held(engine):
    """Collects the KV bytes running requests hold after every engine step (the list it yields)."""
    held, step = [], engine.step

    def spy():
        out = step()
        held.append(engine.request_kv_bytes(out))
        return out

    engine.step = spy
    try:
        yield held
    finally:
        engine.step = step

"""`redknot bench quality`: answer quality and first-token fidelity of every method against dense.

Each record is a question over documents with gold answers. Every method answers it greedily
(stop at the first newline) and is scored with SQuAD exact match and token F1 (of a reasoned
answer's conclusion: the text after its last ``=>``) against the gold answers, and against dense's
own answer (answer agreement: what a small model's weak gold scores cannot show). Independently of
the answers, the logits of the first generated position are compared with dense's: top-1
agreement, top-10 overlap, cosine and KL(dense || method) of the softmax distributions. These
catch reuse errors on a model too small (or a data set too easy) for EM/F1 to move. Dense is
always run as the reference, listed or not.

Prompts: the testbed's records ask their question as it is (``--prompt plain``); the public sets
(``--data NAME:PATH``) default to ``--prompt longbench``, LongBench's multi-document QA template
(``LONGBENCH_QA``), which asks for the answer alone, inside the model's chat template. The
documents stay separate chunks in both (the template's instruction joins the prefix, its question
part the suffix; ``redknot.reuse.prompt.DOCUMENTS_SLOT``).

Budgets: a method may carry one knob after ``@``: ``cacheblend@0.3`` (recompute ratio),
``epic@32`` (tokens recomputed per chunk), ``redknot@0.5`` / ``redknot_paper@0.5`` (the sparse FFN's
``keep_fraction``: that share of chunk tokens through the FFN, instead of the mass tiers),
``h2o@0.05`` / ``headsparse_h2o@0.2`` (the decode KV budget, tokens or a fraction of the sequence,
of every head of the all-global plan / of the head plan's global and retrieval heads: each keeps
sink, a ``--decode-kv-window`` (128) window and its heaviest distant pages within the budget from the end of the
prompt on); ``retrieval`` runs the head plan with its retrieval heads live (``retrieval_top_p``
of the head config). Head-plan budgets are separate runs with other ``--head-config`` files
(``redknot bench quality-report`` merges them).

Long runs: a tqdm bar on stderr, the results JSON rewritten after every record (``complete``:
false until the end), and ``--resume`` continues from such a file, skipping the records it holds.

Data: jsonl, one record a line:
    {"id": ..., "documents": [str, ...], "question": str, "answers": [str, ...], "type": str}
"""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import json
import sys
from pathlib import Path

from ..qa.answers import (ANSWER_MARK, MAX_ANSWER_TOKENS, bridge_match, exact_match, f1_score,  # noqa: F401
                          final_answer, normalize_answer, restated_fact, twin_match)
from ..qa.records import read_jsonl
from ..reuse.registry import ALIASES, METHODS, parse_method

import torch

REFERENCE = "dense"
TOPK = 10
# Methods that cannot run without a per-head plan; checked before the (slow) model load.
NEEDS_HEAD_CONFIG = ("headsparse", "redknot_paper", "redknot", "headsparse_h2o", "retrieval")
# Per-record quantities that are averaged, overall and per question type.
SCORES = ("em", "f1", "answer_em", "answer_f1", "top1_agreement", "top10_overlap", "logit_cos", "kl")
# LongBench's multi-document QA prompt (its hotpotqa/2wikimqa/musique template), the documents as chunks.
LONGBENCH_QA = ("Answer the question based on the given passages. Only give me the answer and do not output any "
                "other words.\n\nThe following are given passages.\n{documents}Answer the question based on the "
                "given passages. Only give me the answer and do not output any other words.\n\n"
                "Question: {question}\nAnswer:")
PROMPTS = {"plain": None, "longbench": LONGBENCH_QA}
# Method knobs a spec may set after "@" (budgets): method -> (ReuseOptions / SparseFFNConfig field, type).
SELECTION_KNOBS = ("h2o", "headsparse_h2o")  # rows that take a decode KV budget after "@"
# Selected-set rows (redknot.engine.selective.SELECTED_METHODS): a full prefill under their base
# plan, then the heads keep what their selection keeps; the budget rows default to 10%.
DEFAULT_DECODE_KV_BUDGET = 0.1


# ---- first-token comparison ---------------------------------------------------------------------
def logit_agreement(logits: torch.Tensor, ref: torch.Tensor, k: int = TOPK) -> dict:
    """Top-1 agreement, top-k overlap, cosine and KL(ref || method) of one method's first-token
    logits with dense's (the KL of the two softmax distributions, in nats)."""
    a, b = logits.double().flatten().cpu(), ref.double().flatten().cpu()  # fp64: cos(x, x) reads 1.0
    k = min(k, a.numel())
    top_a = set(a.topk(k).indices.tolist())
    top_b = set(b.topk(k).indices.tolist())
    log_p, log_q = torch.log_softmax(b, 0), torch.log_softmax(a, 0)
    kl = float((log_p.exp() * (log_p - log_q)).sum().clamp_min(0.0))  # fp64 rounding can read -1e-17
    return {"top1_agreement": float(int(a.argmax()) == int(b.argmax())),
            "top10_overlap": len(top_a & top_b) / k,
            "logit_cos": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
            "kl": kl}


def dense_prefill_flops(cfg, n_tokens: int) -> int:
    """FLOPs of a dense prefill of n tokens, counted exactly as the recovery forward counts them
    (redknot.reuse.flops), so reuse methods' executed FLOPs divide by a like-for-like number.
    Dense requests do not report FLOPs themselves; computing them costs no forward."""
    from ..config import HeadConfig
    from ..reuse.flops import FlopReport, visible_pairs

    window, sink = HeadConfig.all_global(cfg.num_hidden_layers, cfg.num_key_value_heads).visibility(
        cfg.sliding_windows)  # every head global, capped by the architecture's own sliding window
    pos = torch.arange(n_tokens)
    report = FlopReport()
    for layer in range(cfg.num_hidden_layers):
        pairs = visible_pairs(pos, torch.as_tensor(window[layer]), torch.as_tensor(sink[layer]), cfg.num_kv_groups)
        report.add_layer(cfg, n_tokens, pairs, n_tokens)
    report.add_lm_head(cfg)
    return report.totals()["total"]


# ---- data ---------------------------------------------------------------------------------------
def load_records(path: str | Path, limit: int | None = None) -> list[dict]:
    """Read and validate a jsonl file (errors name file:line); blank lines are skipped.
    ``NAME:PATH`` reads a public set through its loader (``hotpotqa:hotpotqa_dev_500.jsonl``,
    ``musique:musique_s.json``; see ``redknot.bench.datasets.load_dataset``)."""
    name, sep, rest = str(path).partition(":")
    if sep and not Path(path).exists() and name.isidentifier():
        from .datasets import load_dataset
        records = load_dataset(name, rest, limit)
    else:
        records = read_jsonl(path, limit)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def question_prompt(rec: dict, template: str | None = None) -> str:
    """The prompt string of a record: its question as it is (``template`` None), or the template with
    ``{question}`` filled in and ``{documents}`` turned into ``DOCUMENTS_SLOT`` (the chunks go there)."""
    if template is None:
        return rec["question"]
    from ..reuse.prompt import DOCUMENTS_SLOT

    lead, slot, rest = template.partition("{documents}")
    if not slot:
        raise ValueError("a prompt template needs a {documents} field: the documents go there as chunks")
    return lead + DOCUMENTS_SLOT + rest.replace("{question}", rec["question"])


def split_variant(spec: str) -> tuple[str, dict]:
    """``"cacheblend@0.3"`` -> ``("cacheblend", {"cacheblend_ratio": 0.3})``; a plain name -> (name, {}).
    Engine methods take the budgets a request may carry (``reuse.registry.parse_method``: ``redknot@0.3+s16``
    keeps each chunk's first 16 tokens among the kept rows, ``redknot@0.3`` none, whatever the model's
    ``sparse_ffn.json`` says); the selected-set rows ``h2o@F`` and ``headsparse_h2o@F`` take a decode
    KV budget (tokens, or a fraction of the context)."""
    name, at, value = spec.partition("@")
    if name not in SELECTION_KNOBS:
        return parse_method(spec) if name in METHODS or name in ALIASES else (name, {})
    if not at:
        return name, {}
    from ..engine.selective import parse_budget

    try:
        v = float(value)
    except ValueError:
        raise ValueError(f"method {spec!r}: {value!r} is not a float (decode_kv_budget)") from None
    if v < 0:
        raise ValueError(f"method {spec!r}: decode_kv_budget out of range")
    return name, {"decode_kv_budget": next(iter(parse_budget(v).values()))}  # tokens (>= 1) or a fraction


_ROW_SALTS = itertools.count()


def _generate(llm, rec: dict, method: str, max_tokens: int, template: str | None = None,
              decode_kv_window: int = 128):
    """One record through one method (a spec, ``split_variant``): the greedy answer and its first-token
    logits, one prefill."""
    import dataclasses

    from ..engine import SamplingParams
    from ..engine.selective import HeadSelection, selection_for

    name, knobs = split_variant(method)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, stop=["\n"], return_first_logits=True)
    engine = llm.engine
    name, selection = selection_for(name, knobs.pop("decode_kv_budget", DEFAULT_DECODE_KV_BUDGET), decode_kv_window)
    reuse = engine.documents  # the reuse knobs every request's policy is built with
    saved = reuse.options, reuse.sparse, engine.selection
    options = {k: v for k, v in knobs.items() if k in {f.name for f in dataclasses.fields(saved[0])}}
    reuse.options = dataclasses.replace(saved[0], **options)  # this request's budget only
    reuse.sparse = dataclasses.replace(saved[1], **{k: v for k, v in knobs.items() if k not in options})
    engine.selection = None if selection is None else HeadSelection.for_engine(engine, selection)
    # A selected row prefills the whole prompt as a first request would (its own cache namespace):
    # its FLOPs are the base plan's full prefill, not what earlier rows left in the prefix cache.
    salt = None if selection is None else f"quality-row-{next(_ROW_SALTS)}"
    try:
        return llm.generate(question_prompt(rec, template), params, documents=rec["documents"], method=name,
                            cache_salt=salt)[0]
    finally:
        reuse.options, reuse.sparse, engine.selection = saved


def answer_scores(text: str, rec: dict, reference: str | None = None) -> dict:
    """The scores read from the answer's text alone (what ``--rescore`` recomputes); with dense's
    answer as ``reference``, also the answer's EM/F1 against it (answer agreement: conclusion
    against conclusion, as gold scores read a reasoned answer)."""
    ref = None if reference is None else final_answer(reference)
    return {"em": exact_match(text, rec["answers"]), "f1": f1_score(text, rec["answers"]),
            "answer_em": None if ref is None else exact_match(text, [ref]),
            "answer_f1": None if ref is None else f1_score(text, [ref]),
            # reasoned answers only
            "bridge_em": bridge_match(text, (rec.get("meta") or {}).get("bridge"), restated_fact(rec)),
            "twin_em": twin_match(text, rec)}  # records with twins (testbed --meta) only


def _score(llm, rec: dict, method: str, out, ref_out) -> dict:
    """The answer's scores, its agreement with the reference (answer and first token) and the prefill FLOPs."""
    text = out.outputs[0].text.strip()
    ref_logits = ref_out.first_token_logits
    metrics = out.metrics or {}
    flops = (metrics.get("flops") or {}).get("total")
    dense_flops = dense_prefill_flops(llm.config, len(out.prompt_token_ids))
    if method == REFERENCE:
        flops = dense_flops
    return {"text": text, **answer_scores(text, rec, ref_out.outputs[0].text.strip()),
            **logit_agreement(out.first_token_logits, ref_logits),
            "cached_tokens": metrics.get("cached_tokens"), "flops": flops, "dense_flops": dense_flops,
            "prompt_tokens": len(out.prompt_token_ids)}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _summary(rows: list[dict]) -> dict:
    out = {k: _mean(r.get(k) for r in rows) for k in SCORES}  # .get: older results lack the newer scores
    out["n"] = len(rows)
    bridged = [r for r in rows if r.get("bridge_em") is not None]
    if bridged:  # reasoned answers: how often the bridge was right, and the answer after a right one
        right = [r for r in bridged if r["bridge_em"]]
        out.update(bridge_em=_mean(r["bridge_em"] for r in bridged), bridge_n=len(bridged),
                   em_given_bridge=_mean(r["em"] for r in right))
    twinned = [r["twin_em"] for r in rows if r.get("twin_em") is not None]
    if twinned:  # the share answered with the twin's answer: em ~ twin_em is a coin flip between the two
        out["twin_em"] = _mean(twinned)
    return out


def _aggregate(rows: list[dict]) -> dict:
    """Overall and per-type means for one method; FLOPs as the share of dense over all records."""
    summary = _summary(rows)
    summary["cached_tokens"] = _mean(r["cached_tokens"] for r in rows)
    flops = [r["flops"] for r in rows]
    available = all(f is not None for f in flops)  # a partial mean would compare unlike prompts
    summary["flops"] = _mean(flops) if available else None
    summary["dense_flops"] = _mean(r["dense_flops"] for r in rows)
    # Ratio of totals, not a mean of ratios: long prompts dominate compute, so they should here too.
    summary["flops_fraction"] = sum(flops) / sum(r["dense_flops"] for r in rows) if available else None
    by_type = collections.defaultdict(list)
    for r in rows:
        by_type[r["type"]].append(r)
    summary["by_type"] = {t: _summary(by_type[t]) for t in sorted(by_type)}
    return summary


BASELINE = "full_reuse"  # the low end of normalised recovery
RECOVERED = ("answer_f1", "f1")  # the scores normalised recovery is reported for


def add_recovery(methods: dict) -> dict:
    """Normalised recovery of each method (its summary gains ``answer_f1_recovery`` and
    ``f1_recovery``): (score(method) - score(full_reuse)) / (score(dense) - score(full_reuse)),
    1 where a method keeps all dense keeps over plain reuse, 0 where it adds nothing; None without a
    full_reuse row or where dense and full_reuse score alike."""
    dense, low = methods.get(REFERENCE), methods.get(BASELINE)
    for s in methods.values():
        for key in RECOVERED:
            top = None if dense is None or low is None else dense.get(key)
            bottom = None if low is None else low.get(key)
            gap = None if top is None or bottom is None else top - bottom
            s[f"{key}_recovery"] = (None if not gap or s.get(key) is None else (s[key] - bottom) / gap)
    return methods


def evaluate(llm, records: list[dict], methods: list[str], max_tokens: int, progress: bool = True,
             on_record=None, template: str | None = None, previous: list[dict] | None = None,
             decode_kv_window: int = 128) -> dict:
    """Run every record through every method; returns {"methods": {NAME: summary}, "records": [...]}.
    ``decode_kv_window``: the recent window the budget rows keep inside their budget.
    ``on_record(result so far)`` is called after each record (run() saves it: a stopped run keeps
    what it measured). ``previous``: per-record entries of an earlier, stopped run of the same
    records and methods; they are kept and their records are not run again (``--resume``)."""
    from tqdm import tqdm

    rows = {m: [] for m in methods}
    per_record = []
    for entry in previous or []:
        missing = [m for m in methods if m not in entry["predictions"]]
        if missing:
            raise ValueError(f"--resume: record {entry['id']!r} of the earlier run lacks method(s) "
                             f"{', '.join(missing)}: resume with the methods it was run with")
        for m in methods:
            rows[m].append({**entry["predictions"][m], "type": entry["type"]})
        per_record.append(entry)
    done = {e["id"] for e in per_record}
    todo = [r for r in records if r["id"] not in done]
    bar = tqdm(total=len(todo) * len(methods), desc=f"quality ({len(done)} records resumed)" if done else "quality",
               unit="run", disable=not progress, file=sys.stderr)
    try:
        for rec in todo:
            entry = {"id": rec["id"], "type": rec["type"], "answers": rec["answers"], "predictions": {}}
            try:
                ref_out = _generate(llm, rec, REFERENCE, max_tokens, template)  # also the reference's own row
                for m in methods:
                    bar.set_postfix_str(m)
                    out = ref_out if m == REFERENCE else _generate(llm, rec, m, max_tokens, template,
                                                                   decode_kv_window)
                    row = _score(llm, rec, m, out, ref_out)
                    rows[m].append({**row, "type": rec["type"]})
                    entry["predictions"][m] = row
                    bar.update()
            except ValueError as e:  # e.g. a prompt longer than the model allows: say which record
                raise ValueError(f"record {rec['id']!r}: {e}") from e
            per_record.append(entry)
            if on_record is not None:
                on_record({"methods": add_recovery({m: _aggregate(rows[m]) for m in methods}), "records": per_record})
    finally:
        bar.close()
    return {"methods": add_recovery({m: _aggregate(rows[m]) for m in methods}), "records": per_record}


# ---- command line -------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..engine import METHODS

    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the bundled testbed model)")
    p.add_argument("--data", required=True, help="jsonl: id, documents, question, answers, type per line; "
                                                 "or NAME:PATH of a public set (hotpotqa:FILE, musique:FILE)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of: {', '.join(METHODS)}")
    p.add_argument("--head-config", default=None,
                   help=f"head config JSON (needed by {', '.join(NEEDS_HEAD_CONFIG)}; default: heads.json "
                        f"beside the checkpoint)")
    p.add_argument("--sparse-ffn", default=None,
                   help="sparse FFN JSON (default: sparse_ffn.json beside the checkpoint, else built-in tiers)")
    p.add_argument("--shallow-window", type=int, default=None,
                   help="redknot's shallow layers: the window global heads recover within (default: the "
                        "widest local window; at least the context length: global heads read everything there)")
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--rescore", default=None, metavar="RESULTS",
                   help="no model: score the answers stored in a results JSON again against --data (its "
                        "records, with --meta for bridge and twin matches); first-token agreement and FLOPs "
                        "are kept as measured")
    p.add_argument("--resume", action="store_true",
                   help="continue the run whose (partial) results JSON is --out: keep its records, run the rest")
    p.add_argument("--prompt", choices=("auto",) + tuple(PROMPTS), default="auto",
                   help="plain: the question as it is; longbench: LongBench's multi-document QA template "
                        "(answer only), inside the chat template, documents as chunks; auto (default): "
                        "longbench for NAME:PATH public sets, plain for jsonl records")
    p.add_argument("--limit", type=int, default=None, help="first N records only")
    p.add_argument("--max-tokens", type=int, default=MAX_ANSWER_TOKENS)
    p.add_argument("--decode-kv-window", type=int, default=128,
                   help="the budget rows' recent window (inside the budget; a budget below window + sink "
                        "keeps just those)")
    p.add_argument("--page-size", type=int, default=64,
                   help="tokens a KV page holds (decode budgets keep whole pages: smaller pages, finer budgets)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)


def parse_methods(spec: str, head_config) -> list[str]:
    """Validate the method list up front, so a typo fails before minutes of model loading."""
    from ..engine import METHODS
    from ..engine.selective import SELECTED_METHODS

    known = tuple(METHODS) + tuple(SELECTED_METHODS)
    methods = list(dict.fromkeys(m.strip() for m in spec.split(",") if m.strip()))
    unknown = [m for m in methods if split_variant(m)[0] not in known]
    if unknown or not methods:
        raise ValueError(f"unknown method(s) {', '.join(unknown) or '(none given)'} (available: {', '.join(known)})")
    needy = [m for m in methods if split_variant(m)[0] in NEEDS_HEAD_CONFIG]
    if needy and head_config is None:
        raise ValueError(f"method(s) {', '.join(needy)} need --head-config")
    return methods


def rescore(results_path: str | Path, records: list[dict]) -> dict:
    """A results JSON with every answer scored again against ``records`` (matched by id)."""
    try:
        result = json.loads(Path(results_path).read_text())
        entries = result["records"]
        methods = list(result["methods"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{results_path}: not a results JSON of `redknot bench quality` ({e})") from e
    by_id = {r["id"]: r for r in records}
    rows = {m: [] for m in methods}
    for entry in entries:
        rec = by_id.get(entry["id"])
        if rec is None or rec["answers"] != entry["answers"]:
            why = "is not in" if rec is None else "has other answers in"
            raise ValueError(f"record {entry['id']!r} {why} the data: rescore with the records the results "
                             f"were made from")
        ref = entry["predictions"].get(REFERENCE, {}).get("text")
        for m, row in entry["predictions"].items():
            row.update(answer_scores(row["text"], rec, ref))
            rows[m].append({**row, "type": entry["type"]})
    result["methods"] = add_recovery({m: _aggregate(rows[m]) for m in methods if rows[m]})
    return result


def _checkpoint_dir(model) -> Path:
    """The HF directory a ``--model`` names (a shelf name or a GGUF file converted, as the engine
    would), so its heads.json is found beside it; as given when it names nothing yet (the load
    reports that, after the data is checked)."""
    from ..models.resolve import bundled_model_path, resolve_model

    if not model:
        return bundled_model_path()
    try:
        return Path(resolve_model(model))
    except FileNotFoundError:
        return Path(model)


def run(args) -> dict:
    from ..engine import LLM, SamplingParams

    if args.rescore:  # no model
        if args.limit is not None:
            raise ValueError("--rescore reads every record of the results: drop --limit")
        result = rescore(args.rescore, load_records(args.data))
        result["rescored"] = {"from": str(args.rescore), "data": str(args.data),
                              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(format_table(result))
        return result
    # results name the model as given (a shelf name stays one, not this machine's converted copy)
    args.model_name = str(args.model) if args.model else None
    args.model = _checkpoint_dir(args.model)
    if args.head_config is None and (args.model / "heads.json").is_file():
        args.head_config = args.model / "heads.json"
    methods = parse_methods(args.methods, args.head_config)
    if args.shallow_window is not None and args.shallow_window < 1:
        raise ValueError(f"--shallow-window must be >= 1, got {args.shallow_window}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    records = load_records(args.data, args.limit)  # before the model: bad data fails fast
    prompt = args.prompt
    if prompt == "auto":
        name, sep, _ = str(args.data).partition(":")
        prompt = "longbench" if sep and not Path(args.data).exists() and name.isidentifier() else "plain"
    args.prompt = prompt
    template = PROMPTS[prompt]
    previous = None
    if args.resume and Path(args.out).is_file():
        previous = _resumable(Path(args.out), args, methods)
    from ..reuse.options import ReuseOptions

    llm = LLM(model=args.model, head_config=args.head_config, sparse_ffn=args.sparse_ffn, device=args.device,
              dtype=args.dtype, page_size=args.page_size, reuse_options=ReuseOptions(shallow_window=args.shallow_window))
    # One request at a time: a page pool for the largest request (its context, and for chunk
    # methods the cached chunks it copies from), not the serving default share of GPU memory, so
    # harness processes can share a device.
    params = SamplingParams(max_tokens=args.max_tokens)
    from ..engine.selective import selection_for

    kv_pages = max(llm.engine.pool_pages_for(llm.make_sequence(question_prompt(r, template), params, r["documents"],
                                                          selection_for(split_variant(m)[0])[0]))
                   for r in records for m in methods)
    llm.engine.resize_pool(kv_pages)
    meta = {
        "benchmark": "quality", "model": args.model_name or str(args.model), "data": str(args.data), "reference": REFERENCE,
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."), "torch": torch.__version__,
        "n_records": len(records), "head_config": None if args.head_config is None else str(args.head_config),
        "head_plan": llm.head_config.class_counts() if llm.head_config else None, "sparse_ffn": vars(llm.sparse_ffn),
        "kv_pages": kv_pages, "prompt_template": template,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict, complete: bool) -> None:
        # after every record, so a run stopped by a time limit keeps its records (marked incomplete)
        done = {**result, **meta, "n_records_done": len(result["records"]), "complete": complete}
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(done, indent=1) + "\n")
        tmp.replace(out)

    result = evaluate(llm, records, methods, args.max_tokens, on_record=lambda r: save(r, False), template=template,
                      previous=previous, decode_kv_window=args.decode_kv_window)
    save(result, True)
    result.update(meta, n_records_done=len(records), complete=True)
    print(format_table(result))
    return result


def _resumable(path: Path, args, methods: list[str]) -> list[dict]:
    """The per-record entries of an earlier run at ``path`` that this run continues; raises when that
    run measured something else (model, data, head plan, prompt, answer length)."""
    try:
        old = json.loads(path.read_text())
        entries, old_args = old["records"], old["args"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--resume: {path} is not a results JSON of `redknot bench quality` ({e})") from e
    for key, theirs in (("model", old.get("model")), ("head_config", old.get("head_config"))):
        mine = None if getattr(args, key) is None else str(getattr(args, key))
        if key == "model" and theirs is not None and theirs == getattr(args, "model_name", None):
            continue  # the name it was given (a file before names were kept records the path)
        if mine != theirs:
            raise ValueError(f"--resume: {path} was made with {key}={theirs!r}, this run has {mine!r}")
    for key in ("data", "sparse_ffn", "shallow_window", "max_tokens",
                "dtype", "prompt"):
        mine = getattr(args, key, None)
        mine = None if mine is None else str(mine)
        theirs = old_args.get(key)
        theirs = None if theirs is None else str(theirs)
        if key == "prompt" and theirs is None:
            theirs = "plain"
        if mine != theirs:
            raise ValueError(f"--resume: {path} was made with {key}={theirs!r}, this run has {mine!r}")
    for key, default in (("page_size", 64), ("decode_kv_window", 128)):  # files before they were recorded: defaults
        mine, theirs = getattr(args, key, default), old_args.get(key, default)
        if mine != theirs:
            raise ValueError(f"--resume: {path} was made with {key}={theirs!r}, this run has {mine!r}")
    if old_args.get("shallow_suffix", "local") != "local":  # files that record it: the question's shallow visibility
        raise ValueError(f"--resume: {path} was made with shallow_suffix={old_args['shallow_suffix']!r}; "
                         f"redknot's question attends locally in the shallow layers ('local')")
    dropped = [m for m in methods if m not in old["methods"]]
    if dropped:  # a subset continues (the others' answers are left out); a new method would lack old records
        raise ValueError(f"--resume: {path} has methods {','.join(old['methods'])}, this run {','.join(methods)} "
                         f"(a resumed run keeps all or some of the earlier methods, no new ones)")
    return [{**e, "predictions": {m: e["predictions"][m] for m in methods}} for e in entries]


def format_table(result: dict) -> str:
    """One row per method: EM/F1 vs gold, F1 ÷ dense, answer EM/F1 vs dense, normalised recovery of
    answer F1 and gold F1 (``add_recovery``), first-token top-1/top-10/KL/cos, cached tokens, FLOPs
    share, EM per type."""
    methods = result["methods"]
    types = sorted({t for s in methods.values() for t in s["by_type"]})
    dense_f1 = (methods.get(REFERENCE) or {}).get("f1")

    def num(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    width = max([6] + [len(m) for m in methods])
    head = (f"{'method':<{width}}  {'EM':>5}  {'F1':>5}  {'F1/d':>5}  {'aEM':>5}  {'aF1':>5}  {'top1':>5}  "
            f"{'aF1rc':>5}  {'F1rc':>5}  {'top10':>5}  {'KL':>6}  {'cos':>7}  {'cached':>7}  {'flops':>5}"
            + "".join(f"  {('EM:' + t)[:12]:>12}" for t in types))
    lines = [f"quality on {result.get('n_records_done', result.get('n_records', '?'))} records vs {REFERENCE} | "
             f"model {result.get('model', '?')}", head, "-" * len(head)]
    for m, s in methods.items():
        ratio = s["f1"] / dense_f1 if dense_f1 else None
        lines.append(f"{m:<{width}}  {num(s['em']):>5}  {num(s['f1']):>5}  {num(ratio, '{:.2f}'):>5}  "
                     f"{num(s.get('answer_em')):>5}  {num(s.get('answer_f1')):>5}  {num(s['top1_agreement']):>5}  "
                     f"{num(s.get('answer_f1_recovery'), '{:.2f}'):>5}  {num(s.get('f1_recovery'), '{:.2f}'):>5}  "
                     f"{num(s['top10_overlap']):>5}  {num(s.get('kl'), '{:.4f}'):>6}  "
                     f"{num(s['logit_cos'], '{:.5f}'):>7}  "
                     f"{num(s['cached_tokens'], '{:.1f}'):>7}  {num(s['flops_fraction'], '{:.2f}'):>5}" +
                     "".join(f"  {num(s['by_type'].get(t, {}).get('em')):>12}" for t in types))
    if any("twin_em" in t for s in methods.values() for t in s["by_type"].values()):
        lines.append(f"{'':<{width}}  answered with the twin's answer (share of records):")
        for m, s in methods.items():
            lines.append(f"{m:<{width}}  {num(s.get('twin_em')):>5}" + " " * 48 +
                         "".join(f"  {num(s['by_type'].get(t, {}).get('twin_em')):>12}" for t in types))
    return "\n".join(lines)

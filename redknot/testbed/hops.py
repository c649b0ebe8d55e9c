"""``redknot testbed hops``: split a model's ``multi_hop`` answers into lookup and composition.

Each ``multi_hop`` record (written with ``make-data --meta``) is asked three ways over the same
documents: the question itself, its first hop alone (X's employer, birthplace, school …) and its
second hop alone (that entity's attribute). A composed answer can only be right when both lookups
are; the counts per (hop1, hop2, composed) outcome say which of the three the model lacks. A model
trained with ``--reasoned-answers`` writes the bridge first (``BRIDGE => ANSWER``): its written
bridge is scored too, and how often the answer follows a right one.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from ..qa.answers import MAX_ANSWER_TOKENS
from .templates import SINGLE_HOP

OUTCOMES = ("hop1", "hop2", "composed")

# The second hop as a one-document question about the bridge entity, by (person link, bridge attribute).
_HOP2 = {link_attr: SINGLE_HOP[relation][2][0] for link_attr, relation in {
    ("employer", "hq"): "hq", ("employer", "founded_year"): "company_founded", ("employer", "founder"): "founder",
    ("birth_city", "river"): "river", ("birth_city", "mayor"): "mayor", ("birth_city", "founded_year"): "town_founded",
    ("residence", "river"): "river"}.items()}
_HOP2[("school", "founded_year")] = "In which year was {X} founded?"
_HOP2[("school", "city")] = "In which city is {X}?"


def hop_questions(record: dict) -> list[tuple[str, str, list[str]]]:
    """A ``multi_hop`` record (made with ``meta``) as ``[(name, question, answers)]``: the question
    itself ("composed"), its first hop alone ("hop1": X's bridge entity) and its second hop alone
    ("hop2": the bridge entity's attribute, the record's answer), each answerable from the same
    documents. Lets a model's multi_hop errors be split into lookup and composition failures."""
    if record.get("type") != "multi_hop" or not record.get("meta"):
        raise ValueError(f"record {record.get('id')!r}: hop questions need a multi_hop record with meta "
                         f"(make-data --meta)")
    m = record["meta"]
    link, attr = m["relation"].split("->")
    hop1 = SINGLE_HOP[link][2][0].format(X=m["entity"])
    hop2 = _HOP2[(link, attr)]
    return [("composed", record["question"], record["answers"]), ("hop1", hop1, [m["bridge"]]),
            ("hop2", hop2.format(X=m["bridge"]), record["answers"])]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="jsonl from `redknot testbed make-data --meta` (multi_hop records "
                                                 "are used, others skipped)")
    p.add_argument("--out", required=True, help="JSON file: counts and every answer")
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the bundled testbed model)")
    p.add_argument("--method", default="dense", help="how the model serves the documents (default: dense)")
    p.add_argument("--limit", type=int, default=None, help="read only the first N records")
    p.add_argument("--max-tokens", type=int, default=MAX_ANSWER_TOKENS)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)


def run(args) -> int:
    from tqdm import tqdm

    from ..qa.answers import bridge_match, exact_match, restated_fact
    from ..qa.records import read_jsonl
    from ..engine import LLM, SamplingParams

    records = [r for r in read_jsonl(args.data, args.limit) if r.get("type") == "multi_hop"]
    if not records:
        raise ValueError(f"{args.data}: no multi_hop records")
    asks = [(r, hop_questions(r)) for r in records]  # before the model: records without meta fail fast
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, stop=["\n"])
    rows, counts = [], collections.Counter()
    by_relation = collections.defaultdict(collections.Counter)
    for rec, questions in tqdm(asks, desc="hops", unit="record", file=sys.stderr):
        row = {"id": rec["id"], "relation": rec["meta"]["relation"]}
        for name, question, gold in questions:
            out = llm.generate(question, params, documents=rec["documents"], method=args.method)[0]
            text = out.outputs[0].text.strip()
            row[name] = {"question": question, "gold": gold, "text": text, "em": exact_match(text, gold)}
        bridge = bridge_match(row["composed"]["text"], rec["meta"]["bridge"], restated_fact(rec))
        if bridge is not None:  # a reasoned answer: did it name the right bridge?
            row["composed"]["bridge_em"] = bridge
        outcome = ",".join(f"{k}={int(row[k]['em'])}" for k in OUTCOMES)
        counts[outcome] += 1
        by_relation[row["relation"]][outcome] += 1
        rows.append(row)
    n = len(rows)
    summary = {k: sum(r[k]["em"] for r in rows) / n for k in OUTCOMES}
    both = [r for r in rows if r["hop1"]["em"] and r["hop2"]["em"]]
    summary["composed_given_both_hops"] = (sum(r["composed"]["em"] for r in both) / len(both)) if both else None
    reasoned = [r["composed"] for r in rows if "bridge_em" in r["composed"]]
    right = [c for c in reasoned if c["bridge_em"]]
    summary["reasoned"] = len(reasoned) / n
    summary["bridge"] = sum(c["bridge_em"] for c in reasoned) / len(reasoned) if reasoned else None
    summary["composed_given_bridge"] = sum(c["em"] for c in right) / len(right) if right else None
    result = {"data": str(args.data), "model": str(llm.model_dir), "method": args.method, "n": n,
              "em": summary, "outcomes": dict(counts), "by_relation": {k: dict(v) for k, v in by_relation.items()},
              "records": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"multi_hop records: {n} | method {args.method}")
    for k in OUTCOMES:
        print(f"  {k:<9} EM {summary[k]:.3f}")
    cb = summary["composed_given_both_hops"]
    print(f"  composed when both hops alone are right: {'-' if cb is None else f'{cb:.3f}'} ({len(both)} records)")
    if reasoned:
        cg = summary["composed_given_bridge"]
        print(f"  reasoned answers: {len(reasoned)} of {n}; right bridge {summary['bridge']:.3f}; answer right "
              f"after a right bridge {'-' if cg is None else f'{cg:.3f}'} ({len(right)} records)")
    for outcome, c in sorted(counts.items()):
        print(f"  {outcome}: {c}")
    return 0

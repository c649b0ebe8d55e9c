"""How document A phrases X's role, against whether a `description` answer (or its restated holder)
is right: the table of testbed.md, "Runs X, Y and Z".

    redknot testbed make-data --seed 20002 --n 128 --context-tokens 2048 --meta --out fresh_2k.jsonl
    # likewise fresh_8k (20003, 64, 8192), heldout_2k (20000, 128, 2048), heldout_8k (20001, 64, 8192)
    python docs/results/description_phrasing.py RECORDS.jsonl RESULTS.json [RECORDS RESULTS ...]

A record's phrasing is read off A's first sentence that names X: the holder before X, after X, or
only in the title. "holder" counts answers whose text before `=>` names the holder (restated runs).
"""

import collections
import json
import re
import sys


def phrasing(rec: dict) -> str:
    x, holder = rec["meta"]["entity"], rec["meta"]["bridge"]
    doc = rec["documents"][rec["supporting"][0]].replace("\n", " ")
    sentence = next(s for s in re.split(r"(?<=[.])\s+", doc) if x in s)
    if holder not in sentence:
        return "title only"
    return "holder before X" if sentence.index(holder) < sentence.index(x) else "holder after X"


def main(argv: list[str]) -> None:
    counts = collections.defaultdict(lambda: [0, 0, 0])  # em, holder named, records
    for records_path, results_path in zip(argv[::2], argv[1::2]):
        records = {r["id"]: r for r in map(json.loads, open(records_path))}
        for r in json.load(open(results_path))["records"]:
            if r["type"] != "description":
                continue
            rec, pred = records[r["id"]], r["predictions"]["dense"]
            c = counts[phrasing(rec)]
            c[0] += pred["em"]
            c[1] += rec["meta"]["bridge"].lower() in pred["text"].split("=>")[0].lower() and "=>" in pred["text"]
            c[2] += 1
    print(f"{'phrasing':<16} {'EM':>8} {'holder':>8} {'records':>8}")
    for k in ("holder before X", "holder after X", "title only"):
        em, named, n = counts[k]
        print(f"{k:<16} {em:>8.0f} {named:>8d} {n:>8d}")


if __name__ == "__main__":
    main(sys.argv[1:])

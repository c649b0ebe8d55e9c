"""Calibration prompts for the head profiler.

A record is ``{"id", "documents": [str, ...], "question": str, "answers": [str, ...], "type": str}``.
Sources: a JSON-lines file of such records, a plain text file (documents = paragraphs separated
by blank lines, grouped into records of ``TEXT_DOCS_PER_RECORD``), or the built-in generator of
fictional multi-document records whose facts are spread over documents that refer to each other,
so that some heads must read across documents to follow them.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

TEXT_DOCS_PER_RECORD = 4
# build_prompt needs a non-empty question; plain text has none.
DEFAULT_QUESTION = "What do the documents above say?"


class CalibrationError(ValueError):
    """A calibration file that cannot be read as records."""


def load_calibration(path: str | Path, limit: int | None = None) -> list[dict]:
    """Records from ``*.jsonl`` / ``*.json`` (one JSON object a line) or from plain text."""
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"{path}: no such calibration file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CalibrationError(f"{path}: not UTF-8 text ({e})") from None
    records = _jsonl_records(text, path) if path.suffix.lower() in (".jsonl", ".json") else _text_records(text, path)
    if not records:
        raise CalibrationError(f"{path}: no calibration records (empty file?)")
    return records[:limit] if limit else records


def _jsonl_records(text: str, path: Path) -> list[dict]:
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{where}: malformed JSON ({e.msg}); expected one record per line") from None
        records.append(_check_record(raw, where, default_id=f"{path.stem}-{n}"))
    return records


def _check_record(raw, where: str, default_id: str) -> dict:
    if not isinstance(raw, dict):
        raise CalibrationError(f"{where}: expected a JSON object record, got {type(raw).__name__}")
    docs = raw.get("documents")
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) and d.strip() for d in docs):
        raise CalibrationError(f"{where}: 'documents' must be a non-empty list of non-empty strings")
    question = raw.get("question", "")
    if not isinstance(question, str):
        raise CalibrationError(f"{where}: 'question' must be a string")
    answers = raw.get("answers", [])
    if not isinstance(answers, list):
        raise CalibrationError(f"{where}: 'answers' must be a list of strings")
    return {"id": str(raw.get("id", default_id)), "documents": docs, "question": question or DEFAULT_QUESTION,
            "answers": [str(a) for a in answers], "type": str(raw.get("type", "unknown"))}


def _text_records(text: str, path: Path) -> list[dict]:
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    return [{"id": f"{path.stem}-{i // TEXT_DOCS_PER_RECORD}", "documents": paragraphs[i:i + TEXT_DOCS_PER_RECORD],
             "question": DEFAULT_QUESTION, "answers": [], "type": "text"}
            for i in range(0, len(paragraphs), TEXT_DOCS_PER_RECORD)]


# ---- built-in generator -------------------------------------------------------------------------
_FIRST = ["Ilsa", "Marek", "Tova", "Oren", "Sela", "Dario", "Yuna", "Kasimir", "Nadia", "Pim", "Ruth", "Anselm"]
_LAST = ["Torv", "Varga", "Lindqvist", "Okafor", "Brandt", "Sato", "Quell", "Ferro", "Ambrose", "Nyberg"]
_CITIES = ["Varna", "Ostrel", "Kelmar", "Duskhaven", "Trevik", "Solvang", "Amberly", "Nyhollow", "Corrin", "Palmsey"]
_RIVERS = ["Ilm", "Sarro", "Kessa", "Vey", "Orrin"]
_STEMS = ["Brightwater", "Ironleaf", "Northgate", "Copperline", "Silvermoor", "Redfield", "Blackthorn", "Greyhaven"]
_KINDS = [("Works", "steel bridges"), ("Labs", "medical sensors"), ("Textiles", "wool coats"),
          ("Shipping", "river barges"), ("Foundry", "church bells"), ("Instruments", "violins")]


def builtin_records(n: int = 16, seed: int = 0, n_docs: int = 6) -> list[dict]:
    """``n`` deterministic fictional records: a founder, their company, its city and an employee in
    separate documents that name each other, plus distractor documents about other entities."""
    return [_record(random.Random(seed * 100_003 + i), i, max(n_docs, 4)) for i in range(n)]


def _record(rng: random.Random, i: int, n_docs: int) -> dict:
    def person():
        return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"

    founder, employee = person(), person()
    born, hq, other = rng.sample(_CITIES, 3)
    stem, (kind, product) = rng.choice(_STEMS), rng.choice(_KINDS)
    company, river, year = f"{stem} {kind}", rng.choice(_RIVERS), rng.randint(1850, 1990)
    docs = [
        f"{founder} was born in {born} in {year - rng.randint(20, 40)}. After years as an apprentice, {founder} "
        f"founded {company} in {year}. Friends remember {founder} as patient and stubborn.",
        f"{company} makes {product}. In {year + rng.randint(3, 30)} the company moved its headquarters from "
        f"{born} to {hq}. Its history is told in the biography of its founder.",
        f"{hq} lies on the {river} river and is home to {rng.randint(20, 900)} thousand people. The largest "
        f"employer in {hq} is the maker of {product}, where {employee} leads the workshop.",
        f"{employee} grew up in {other} and joined {company} in {year + rng.randint(31, 45)}. Before that, "
        f"{employee} repaired clocks on the {river} embankment.",
    ]
    while len(docs) < n_docs:  # distractors: same templates, other entities
        p, c = person(), rng.choice(_CITIES)
        docs.append(f"{p} was born in {c}. {p} founded {rng.choice(_STEMS)} {rng.choice(_KINDS)[0]} and later "
                    f"moved to {rng.choice(_CITIES)}, a town on the {rng.choice(_RIVERS)} river.")
    rng.shuffle(docs)
    if i % 2:
        question, answer, kind_ = f"In which city is the company founded by {founder} based?", hq, "multi_hop"
    else:
        question, answer, kind_ = f"Which company did {founder} found?", company, "single_hop"
    return {"id": f"builtin-{i}", "documents": docs, "question": question, "answers": [answer], "type": kind_}

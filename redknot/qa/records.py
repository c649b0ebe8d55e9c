"""The QA record: its fields, its validation and its JSON-lines files.

A record is ``{"id", "documents", "question", "answers", "type"}``, optionally with ``"supporting"``
(indices of the documents needed, in reasoning order) and ``"meta"`` (what a generator knows about
the question: entity, relation, bridge entity, answers of same-variant twins). The testbed corpus
writes records, the public-set loaders convert to them, and the quality harness reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

REQUIRED_FIELDS = {"id": (str, int), "documents": list, "question": str, "answers": list, "type": str}


class RecordError(ValueError):
    """A record file that does not hold valid records."""


def check_record(rec, where: str = "record") -> dict:
    """Raise ``RecordError`` unless ``rec`` has the record fields with the right types."""
    if not isinstance(rec, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED_FIELDS if k not in rec]
    if missing:
        raise RecordError(f"{where}: missing field(s) {missing}; a record needs {list(REQUIRED_FIELDS)}")
    for k, typ in REQUIRED_FIELDS.items():
        if not isinstance(rec[k], typ) or isinstance(rec[k], bool):
            names = " or ".join(t.__name__ for t in (typ if isinstance(typ, tuple) else (typ,)))
            raise RecordError(f"{where}: field {k!r} must be {names}, got {type(rec[k]).__name__}")
    for k in ("documents", "answers"):
        if not all(isinstance(x, str) for x in rec[k]):
            raise RecordError(f"{where}: field {k!r} must be a list of strings")
    if not rec["answers"]:
        raise RecordError(f"{where}: field 'answers' is empty")
    return rec


def write_jsonl(records, path) -> Path:
    """One record a line (UTF-8, non-ASCII kept); parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for k, rec in enumerate(records):
            check_record(rec, f"record {k}")
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def read_jsonl(path, limit: int | None = None) -> list[dict]:
    """Records of a JSON-lines file (the first ``limit``; later lines are not read); blank lines are
    skipped; errors name ``file:line``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such record file")
    records = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(records) >= limit:
                break
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{path}:{n}: malformed JSON ({e.msg} at column {e.colno})") from None
            records.append(check_record(rec, f"{path}:{n}"))
    return records

"""Public multi-document QA sets in redknot's record format, and chunk layouts for reuse benchmarks.

A record is ``{"id", "documents": [str, ...], "question", "answers": [str, ...], "type"}`` (see
``redknot.qa.records``), plus ``"supporting"`` (indices of the documents holding the evidence)
when the source marks it. Loaders:

- ``load_hotpotqa``: HotpotQA distractor JSON, a list of ``{"_id", "question", "answer", "type",
  "supporting_facts", "context": [[title, [sentence, ...]], ...]}`` (the HF ``datasets`` dict
  layout of ``context`` / ``supporting_facts`` is read too).
- ``load_2wikimultihopqa``: 2WikiMultihopQA JSON, the same layout.
- ``load_musique``: MuSiQue JSON lines ``{"id", "question", "answer", "answer_aliases",
  "paragraphs": [{"title", "paragraph_text", "is_supporting"}], "answerable"}``.
- ``load_longbench``: LongBench JSON lines ``{"input", "context", "answers", "_id", "dataset"}``;
  ``context`` is split at passage markers ("Passage 1:", "Paragraph 2:", ...), else at blank lines.
- ``load_cacheblend``: CacheBlend's / LMCache's inputs, a JSON list of ``{"ctxs": [{"title",
  "text"}], "question", "answers": [str]}`` (their ``musique_s.json`` and friends).
- ``load_ircot``: IRCoT's processed sets, JSON lines ``{"question_id", "question_text",
  "answers_objects": [{"spans", "number", "date"}], "contexts": [{"id", "title", "paragraph_text",
  "is_supporting"}]}`` (HotpotQA, 2WikiMultihopQA, MuSiQue dev subsamples).

``load_hotpotqa`` and ``load_musique`` recognise the last two formats and hand over to them, so
``load_dataset("musique", "musique_s.json")`` and ``load_dataset("hotpotqa",
"hotpotqa_dev_500.jsonl")`` read the real-QA files as they are. Passage titles are kept: a document
is ``"Title\ntext"`` (just the text where the title is empty, as in ``musique_s.json``).

``relayout`` re-packs each record's documents into ``n_chunks`` chunks of at most ``chunk_tokens``
tokens (4 x 2K, 8 x 4K, ...), keeping document order, padding with other records' documents as
distractors and dropping non-supporting documents when the record is too long.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from ..qa.records import RecordError, check_record, read_jsonl


class DatasetError(ValueError):
    """A dataset file that cannot be read in the format asked for."""


# ---- reading ------------------------------------------------------------------------------------
def _read_json_or_jsonl(path) -> list[tuple[str, object]]:
    """(``file:line`` or ``file[record]``, object) for a JSON list or a JSON-lines file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such dataset file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e})") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
        return [(f"{path}[{k}]", item) for k, item in enumerate(items)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{n}: malformed JSON ({e.msg} at column {e.colno}); "
                                   f"expected a JSON list or one JSON object a line") from None
    if not out:
        raise DatasetError(f"{path}: no records (empty file?)")
    return out


def _need(item, where: str, keys: tuple[str, ...], fmt: str) -> dict:
    if not isinstance(item, dict):
        raise DatasetError(f"{where}: expected a JSON object ({fmt} record), got {type(item).__name__}")
    missing = [k for k in keys if k not in item]
    if missing:
        raise DatasetError(f"{where}: missing {missing} for a {fmt} record (has {sorted(item)})")
    return item


def _join_sentences(sentences) -> str:
    """HotpotQA sentences carry their leading space; 2Wiki's do not: add one only where needed."""
    out = ""
    for s in sentences:
        if out and not out[-1].isspace() and not s[:1].isspace():
            out += " "
        out += s
    return out.strip()


def _doc(title: str, text: str) -> str:
    title, text = str(title).strip(), text.strip()
    return f"{title}\n{text}" if title else text


def _answers(*values) -> list[str]:
    out = []
    for v in values:
        for a in ([v] if isinstance(v, str) else list(v or [])):
            if isinstance(a, str) and a.strip() and a not in out:
                out.append(a)
    return out


def _finish(rec: dict, where: str) -> dict:
    try:
        return check_record(rec, where)
    except RecordError as e:
        raise DatasetError(str(e)) from None


# ---- HotpotQA / 2WikiMultihopQA -----------------------------------------------------------------
def _pairs(value, where: str, a: str, b: str) -> list:
    """``[[x, y], ...]`` or the HF dict layout ``{a: [x, ...], b: [y, ...]}``."""
    if isinstance(value, dict):
        return list(zip(value.get(a, []), value.get(b, [])))
    if isinstance(value, list) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        return [tuple(p) for p in value]
    raise DatasetError(f"{where}: expected a list of [{a}, {b}] pairs, got {type(value).__name__}")


def _load_wiki_style(path, fmt: str, limit: int | None) -> list[dict]:
    records = []
    for where, item in _read_json_or_jsonl(path)[:limit]:
        item = _need(item, where, ("question", "context"), fmt)
        if "answer" not in item:
            raise DatasetError(f"{where}: no 'answer' (a test split without answers cannot be scored)")
        context = _pairs(item["context"], f"{where}.context", "title", "sentences")
        docs = [_doc(title, _join_sentences(sents) if isinstance(sents, list) else str(sents))
                for title, sents in context]
        support_titles = {t for t, _ in _pairs(item.get("supporting_facts", []), f"{where}.supporting_facts",
                                                 "title", "sent_id")}
        kind = item.get("type")
        rec = {"id": str(item.get("_id", item.get("id", where))), "documents": docs, "question": item["question"],
               "answers": _answers(item["answer"]), "type": f"{fmt}/{kind}" if kind else fmt,
               "supporting": [i for i, (t, _) in enumerate(context) if t in support_titles]}
        records.append(_finish(rec, where))
    return records


def load_hotpotqa(path, limit: int | None = None) -> list[dict]:
    """HotpotQA (distractor / fullwiki dev JSON): one document per context paragraph, "Title\\ntext".
    IRCoT's and CacheBlend's processed files are recognised and read with their loaders."""
    fmt = _detect(path)
    if fmt in ("ircot", "cacheblend"):
        return LOADERS[fmt](path, limit=limit, dataset="hotpotqa")
    return _load_wiki_style(path, "hotpotqa", limit)


def load_2wikimultihopqa(path, limit: int | None = None) -> list[dict]:
    """2WikiMultihopQA (dev JSON, HotpotQA layout): one document per context paragraph."""
    return _load_wiki_style(path, "2wikimultihopqa", limit)


# ---- MuSiQue ------------------------------------------------------------------------------------
def load_musique(path, limit: int | None = None, include_unanswerable: bool = False) -> list[dict]:
    """MuSiQue (ans / full JSON lines); type ``musique/2hop`` etc. from the id prefix. Records with
    ``"answerable": false`` (the full set's contrast questions) are skipped unless asked for.
    CacheBlend's ``musique_s.json`` and IRCoT's files are recognised and read with their loaders."""
    fmt = _detect(path)
    if fmt in ("ircot", "cacheblend"):
        return LOADERS[fmt](path, limit=limit, dataset="musique")
    records = []
    for where, item in _read_json_or_jsonl(path):
        item = _need(item, where, ("question", "answer", "paragraphs"), "musique")
        if item.get("answerable", True) is False and not include_unanswerable:
            continue
        paragraphs = item["paragraphs"]
        if not isinstance(paragraphs, list) or not all(isinstance(p, dict) and "paragraph_text" in p
                                                       for p in paragraphs):
            raise DatasetError(f"{where}: 'paragraphs' must be a list of objects with 'paragraph_text'")
        rid = str(item.get("id", where))
        hops = rid.split("__", 1)[0] if "__" in rid else ""
        rec = {"id": rid, "documents": [_doc(p.get("title", ""), p["paragraph_text"]) for p in paragraphs],
               "question": item["question"], "answers": _answers(item["answer"], item.get("answer_aliases")),
               "type": f"musique/{hops}" if hops else "musique",
               "supporting": [i for i, p in enumerate(paragraphs) if p.get("is_supporting")]}
        records.append(_finish(rec, where))
        if limit and len(records) >= limit:
            break
    return records


# ---- LongBench ----------------------------------------------------------------------------------
PASSAGE_MARKER = re.compile(r"(?m)^[ \t]*(?:Passage|Paragraph|Document|Article|文章)[ \t]*\d+[ \t]*[:：]?")


def split_passages(context: str) -> list[str]:
    """LongBench contexts: at passage markers (dropped) when there are any, else at blank lines."""
    marks = list(PASSAGE_MARKER.finditer(context))
    if marks:
        head = context[:marks[0].start()]
        parts = [head] + [context[m.end():n.start() if n else len(context)]
                          for m, n in zip(marks, marks[1:] + [None])]
    else:
        parts = re.split(r"\n[ \t]*\n", context)
    return [p.strip() for p in parts if p.strip()]


def load_longbench(path, limit: int | None = None) -> list[dict]:
    """LongBench (one task's JSON lines); type ``longbench/<dataset>``. LongBench marks no supporting
    passages; ``relayout`` then protects the documents that contain an answer."""
    records = []
    for where, item in _read_json_or_jsonl(path)[:limit]:
        item = _need(item, where, ("input", "context", "answers"), "longbench")
        docs = split_passages(str(item["context"])) or [""]
        dataset = item.get("dataset") or Path(path).stem
        rec = {"id": str(item.get("_id", where)), "documents": docs, "question": str(item["input"]),
               "answers": _answers(item["answers"]), "type": f"longbench/{dataset}"}
        records.append(_finish(rec, where))
    return records


# ---- CacheBlend / IRCoT processed sets -----------------------------------------------------------
def _detect(path) -> str | None:
    """``"cacheblend"`` / ``"ircot"`` when the file's first record has that format's keys."""
    path = Path(path)
    if not path.is_file():
        return None
    with path.open(encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 16)
    keys = set(re.findall(r'"(ctxs|question_text|answers_objects|contexts)"\s*:', head))
    if {"question_text", "contexts"} <= keys:
        return "ircot"
    if "ctxs" in keys:
        return "cacheblend"
    return None


def load_cacheblend(path, limit: int | None = None, dataset: str = "musique") -> list[dict]:
    """CacheBlend's input format (``musique_s.json``, ...): ``{"ctxs": [{"title", "text"}],
    "question", "answers"}``; id ``<file stem>/<index>``, type ``<dataset>``. The format marks no
    supporting passages (``relayout`` then protects the passages holding an answer)."""
    records = []
    stem = Path(path).stem
    for k, (where, item) in enumerate(_read_json_or_jsonl(path)[:limit]):
        item = _need(item, where, ("ctxs", "question", "answers"), "cacheblend")
        ctxs = item["ctxs"]
        if not isinstance(ctxs, list) or not all(isinstance(c, dict) and "text" in c for c in ctxs):
            raise DatasetError(f"{where}: 'ctxs' must be a list of objects with 'text'")
        rec = {"id": str(item.get("id", item.get("_id", f"{stem}/{k}"))),
               "documents": [_doc(c.get("title") or "", str(c["text"])) for c in ctxs],
               "question": str(item["question"]), "answers": _answers(item["answers"]), "type": dataset}
        records.append(_finish(rec, where))
    return records


def _ircot_answers(objects, where: str) -> list[str]:
    if not isinstance(objects, list):
        raise DatasetError(f"{where}: 'answers_objects' must be a list")
    out = []
    for obj in objects:
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: an answers_objects entry is not an object")
        out += [str(x) for x in obj.get("spans") or []]
        if str(obj.get("number") or "").strip():
            out.append(str(obj["number"]))
        date = obj.get("date") or {}
        parts = [str(date.get(k) or "").strip() for k in ("day", "month", "year")]
        if any(parts):
            out.append(" ".join(p for p in parts if p))
    return _answers(out)


def load_ircot(path, limit: int | None = None, dataset: str | None = None) -> list[dict]:
    """IRCoT's processed format: one document per ``contexts`` paragraph ("Title\\ntext"),
    ``supporting`` from ``is_supporting``, answers from the spans (and number / date) of
    ``answers_objects``; type ``<dataset>`` (default: guessed from the file name), plus the MuSiQue
    hop count where the id carries one (``musique/2hop``)."""
    records = []
    name = Path(path).name.lower()
    dataset = dataset or next((d for d in ("hotpotqa", "2wikimultihopqa", "musique", "iirc") if d in name), "ircot")
    for where, item in _read_json_or_jsonl(path)[:limit]:
        item = _need(item, where, ("question_text", "answers_objects", "contexts"), "ircot")
        contexts = item["contexts"]
        if not isinstance(contexts, list) or not all(isinstance(c, dict) and "paragraph_text" in c for c in contexts):
            raise DatasetError(f"{where}: 'contexts' must be a list of objects with 'paragraph_text'")
        rid = str(item.get("question_id", where))
        hops = rid.split("__", 1)[0] if dataset == "musique" and "__" in rid else ""
        rec = {"id": rid, "documents": [_doc(c.get("title") or "", str(c["paragraph_text"])) for c in contexts],
               "question": str(item["question_text"]),
               "answers": _ircot_answers(item["answers_objects"], where),
               "type": f"{dataset}/{hops}" if hops else dataset,
               "supporting": [i for i, c in enumerate(contexts) if c.get("is_supporting")]}
        records.append(_finish(rec, where))
    return records


# ---- dispatch -----------------------------------------------------------------------------------
LOADERS = {"hotpotqa": load_hotpotqa, "2wikimultihopqa": load_2wikimultihopqa, "musique": load_musique,
           "longbench": load_longbench, "cacheblend": load_cacheblend, "ircot": load_ircot, "redknot": None}
ALIASES = {"2wiki": "2wikimultihopqa", "2wikimqa": "2wikimultihopqa", "hotpot": "hotpotqa", "testbed": "redknot",
           "jsonl": "redknot", "records": "redknot", "musiques": "cacheblend"}


def load_dataset(name: str, path, limit: int | None = None) -> list[dict]:
    """Records of ``path`` read as ``name`` (``hotpotqa``, ``2wikimultihopqa``, ``musique``,
    ``longbench``, or ``redknot`` for files in the record format itself)."""
    key = str(name).strip().lower().replace("_", "").replace("-", "")
    key = ALIASES.get(key, key)
    if key not in LOADERS:
        raise DatasetError(f"unknown dataset {name!r}: use one of {sorted(LOADERS)} "
                           f"(aliases: {', '.join(sorted(ALIASES))})")
    if key == "redknot":
        try:
            records = read_jsonl(path)
        except RecordError as e:
            raise DatasetError(str(e)) from None
        return records[:limit] if limit else records
    return LOADERS[key](path, limit=limit)


# ---- chunk layouts ------------------------------------------------------------------------------
@dataclass
class _Piece:
    text: str
    tokens: int
    support: bool = False
    own: bool = True
    keep: int = 0  # truncation drops low values first: 2 = supporting and holds an answer, 1 = supporting


def _token_counter(tokenizer):
    """Token count without special tokens, for HF (``encode`` -> ids) and ``tokenizers`` (-> Encoding)."""
    cache: dict[str, int] = {}

    def count(text: str) -> int:
        n = cache.get(text)
        if n is None:
            enc = tokenizer.encode(text, add_special_tokens=False)
            n = cache[text] = len(enc.ids if hasattr(enc, "ids") else enc)
        return n

    return count


def _halves(text: str) -> tuple[str, str]:
    """Cut near the middle at a paragraph break, else a sentence end, else whitespace; the halves
    concatenate back to ``text``."""
    mid = len(text) // 2
    for pattern in (r"\n[ \t]*\n", r"(?<=[.!?])\s+", r"\s+"):
        cuts = [m.end() for m in re.finditer(pattern, text) if 0 < m.start() and m.end() < len(text)]
        if cuts:
            cut = min(cuts, key=lambda c: abs(c - mid))
            return text[:cut], text[cut:]
    return text[:mid], text[mid:]


def _split(text: str, count, cap: int) -> list[str]:
    """``text`` in pieces of at most ``cap`` tokens, cut at the largest boundaries that allow it."""
    if count(text) <= cap or len(text) < 2:
        return [text]
    left, right = _halves(text)
    pieces = _split(left, count, cap) + _split(right, count, cap)
    merged = [pieces[0]]
    for p in pieces[1:]:  # re-join neighbours that fit together
        if count(merged[-1] + p) <= cap:
            merged[-1] += p
        else:
            merged.append(p)
    return merged


def _greedy(pieces: list[_Piece], cap: int, sep: int) -> list[list[_Piece]]:
    groups: list[list[_Piece]] = []
    size = cap + 1
    for p in pieces:
        if groups and size + sep + p.tokens <= cap:
            groups[-1].append(p)
            size += sep + p.tokens
        else:
            groups.append([p])
            size = p.tokens
    return groups


def _fit(pieces: list[_Piece], n: int, cap: int, sep: int) -> list[_Piece]:
    """Drop pieces until they pack in ``n`` groups: the last non-supporting one first, then the last
    supporting one without an answer, then the last one."""
    pieces = list(pieces)
    while len(_greedy(pieces, cap, sep)) > n:
        low = min(p.keep for p in pieces)
        pieces.pop(max(i for i, p in enumerate(pieces) if p.keep == low))
    return pieces


def _partition(pieces: list[_Piece], n: int, cap: int, sep: int, rng: random.Random) -> list[list[_Piece]]:
    """``n`` groups in document order: one piece per group at random group positions when there are
    at most ``n`` pieces (so documents that refer to each other land in different chunks), else
    contiguous groups of balanced size."""
    if len(pieces) <= n:
        groups = [[] for _ in range(n)]
        for slot, p in zip(sorted(rng.sample(range(n), len(pieces))), pieces):
            groups[slot].append(p)
        return groups
    groups, rest, k = [], sum(p.tokens for p in pieces), 0
    for j in range(n):
        target, group, size = rest / (n - j), [], 0
        while k < len(pieces) and len(pieces) - k > n - j - 1:
            p = pieces[k]
            add = p.tokens + (sep if group else 0)
            if group and (size + add > cap or size + add / 2 > target):
                break
            group.append(p)
            size, k = size + add, k + 1
        groups.append(group)
        rest -= sum(p.tokens for p in group)
    if k < len(pieces) or any(sum(p.tokens for p in g) + sep * (len(g) - 1) > cap for g in groups):
        groups = _greedy(pieces, cap, sep)
        groups += [[] for _ in range(n - len(groups))]
    return groups


def _answer_docs(rec: dict) -> list[int]:
    answers = [a for a in rec["answers"] if a.strip()]
    return [i for i, d in enumerate(rec["documents"]) if any(a.lower() in d.lower() for a in answers)]


def relayout(records: list[dict], tokenizer, n_chunks: int, chunk_tokens: int, seed: int = 0,
             separator: str = "\n\n") -> list[dict]:
    """Each record with its documents re-packed into ``n_chunks`` chunks of at most ``chunk_tokens``
    tokens (``tokenizer.encode``, no special tokens), deterministic for ``seed``.

    Document order is kept; a record with at most ``n_chunks`` documents gets one per chunk (so a
    reference and its referent are encoded apart), longer ones contiguous balanced groups. Short
    chunks are padded with whole documents of other records (never ones containing an answer of this
    record), inserted at random positions. Too long records lose non-supporting documents from the
    end first, then pieces of split supporting documents that hold no answer. Supporting documents
    (``"supporting"``, else the ones containing an answer) are split only when a single one exceeds
    ``chunk_tokens``, at paragraph or sentence boundaries. The result has ``"supporting"`` as chunk
    indices and ``"layout"``; a chunk that stays empty (nothing left to pad with) is left out.
    """
    if n_chunks < 1 or chunk_tokens < 1:
        raise ValueError(f"n_chunks={n_chunks} and chunk_tokens={chunk_tokens} must be >= 1")
    count = _token_counter(tokenizer)
    sep = count(separator) if separator else 0
    pool = [(ri, d) for ri, r in enumerate(records) for d in r["documents"] if d.strip()]
    out = []
    for ri, rec in enumerate(records):
        rng = random.Random(f"relayout:{seed}:{ri}:{rec['id']}")
        support = set(rec["supporting"]) if rec.get("supporting") else set(_answer_docs(rec))
        answers = [a for a in rec["answers"] if a.strip()]
        pieces = [_Piece(t, count(t), di in support, keep=(di in support) * (1 + any(a in t for a in answers)))
                  for di, doc in enumerate(rec["documents"]) if doc.strip()
                  for t in (s.strip() for s in _split(doc, count, chunk_tokens)) if t]
        groups = _partition(_fit(pieces, n_chunks, chunk_tokens, sep), n_chunks, chunk_tokens, sep, rng)
        _pad(groups, pool, ri, rec, count, chunk_tokens, sep, rng)
        chunks, chunk_support = [], []
        for g in groups:
            while count(separator.join(p.text for p in g)) > chunk_tokens:  # tokens can merge at the joins
                pads = [i for i, p in enumerate(g) if not p.own]
                if not pads:
                    break
                g.pop(pads[-1])
            if g:
                if any(p.support for p in g):
                    chunk_support.append(len(chunks))
                chunks.append(separator.join(p.text for p in g))
        out.append({**rec, "documents": chunks, "supporting": chunk_support,
                    "layout": {"n_chunks": n_chunks, "chunk_tokens": chunk_tokens}})
    return out


def _pad(groups, pool, ri: int, rec: dict, count, cap: int, sep: int, rng: random.Random,
         max_misses: int = 24) -> None:
    """Fill each group up to ``cap`` with random whole documents of other records."""
    if not any(r != ri for r, _ in pool):
        return
    answers = [a for a in rec["answers"] if a.strip()]
    used = set(rec["documents"])
    for g in groups:
        size = sum(p.tokens for p in g) + sep * max(len(g) - 1, 0)
        misses = 0
        while misses < max_misses and cap - size > sep:
            r, doc = pool[rng.randrange(len(pool))]
            n = count(doc)
            if r == ri or doc in used or n + (sep if g else 0) > cap - size or any(a in doc for a in answers):
                misses += 1
                continue
            g.insert(rng.randint(0, len(g)), _Piece(doc, n, own=False))
            used.add(doc)
            size += n + (sep if len(g) > 1 else 0)

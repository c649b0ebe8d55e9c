"""The answer text the testbed model is trained to write for a record: the gold answer, or a
reasoned answer that names the bridge entity first."""

from __future__ import annotations

from ..qa.answers import ANSWER_MARK, restated_fact


def target_answer(record: dict, reasoned=(), restate: bool = False) -> str:
    """The text a model is trained to answer ``record`` with: its first gold answer or, when its type is
    in ``reasoned`` (a subset of BRIDGED_TYPES; the record made with ``meta``), the bridge entity first:
    ``"Kestrel Works => Brar"``, so the second lookup reads a name the model has just written instead
    of one it must compose internally. With ``restate`` the answer first writes its first hop as a fact
    (``restated_fact``), ``"Sagern Ikethov was born in Gubury => Orgai River"``, ``"Orla Venn is the
    founder of Kestrel Works => Brar"``: the bridge is then looked up right after the entity's name,
    as a single-hop answer is, and written last, right before the second lookup it keys. Scoring reads
    the part after ``=>`` (``redknot.qa.answers.final_answer``)."""
    answer = record["answers"][0]
    if record.get("type") not in reasoned:
        return answer
    bridge = (record.get("meta") or {}).get("bridge")
    if not bridge:
        raise ValueError(f"record {record.get('id')!r}: a reasoned answer needs the bridge entity "
                         f"(generate_records(meta=True) / make-data --meta)")
    fact = restated_fact(record) if restate else None
    return f"{fact + ' ' if fact else ''}{bridge} {ANSWER_MARK} {answer}"

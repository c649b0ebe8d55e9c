"""Answers: the reasoned-answer format, the relation phrasings it restates, and SQuAD scoring.

A model trained with reasoned answers writes a two-lookup question's bridge entity first,
``"BRIDGE => ANSWER"``, optionally after restating its first hop as a fact (``"Orla Venn is the
founder of Kestrel Works => Brar"``); scoring reads the part after the last ``=>``. The testbed
corpus states facts with the same phrasings (``EASY_FACTS``, ``DESCRIPTIONS``), so the scorer can
strip a restated first hop without knowing how the record was generated.
"""

from __future__ import annotations

import collections
import re
import string

# description: how document B describes the person introduced in document A, and what it states.
DESCRIPTIONS = {
    "founder": ["the founder of {company}", "the person who founded {company}", "the {person} who founded {company}"],
    "mayor": ["the mayor of {city}"],
    "engineer": ["the chief engineer of {company}"],
}
EASY_FACTS = {  # relation -> one sentence, key next to value
    "birth_city": "{X} was born in {V}.", "birth_year": "{X} was born in {V}.", "employer": "{X} works for {V}.",
    "school": "{X} studied at {V}.", "residence": "{X} lives in {V}.", "company_founded": "{X} was founded in {V}.",
    "founder": "{X} was founded by {V}.", "hq": "{X} is headquartered in {V}.",
    "engineer": "The chief engineer of {X} is {V}.", "river": "{X} lies on the {V}.",
    "mayor": "The mayor of {X} is {V}.",
    "town_founded": "{X} was founded in {V}.", "mountain": "{X} sits at the foot of {V}.",
}

ANSWER_MARK = "=>"  # a reasoned answer: "BRIDGE => ANSWER" (or "X was born in BRIDGE => ANSWER")
# answer budget of the harness, hops and demo: the longest trained answer, a restated one ("X is the
# chief engineer of BRIDGE => ANSWER"), is up to ~26 tokens; plain answers stop at </s> long before
MAX_ANSWER_TOKENS = 32


def restated_fact(record: dict) -> str | None:
    """A two-lookup record's first hop stated as a fact, up to the bridge: for ``multi_hop`` as the
    easy stages state it ("Sagern Ikethov was born in"), for ``description`` the role that document A
    gives the entity ("Orla Venn is the founder of"); None for other records or without meta."""
    meta = record.get("meta") or {}
    if not meta.get("relation"):
        return None
    first = meta["relation"].split("->")[0]
    if record.get("type") == "multi_hop":
        return EASY_FACTS[first].split("{V}")[0].format(X=meta["entity"]).rstrip()
    if record.get("type") in ("description", "mention"):  # the role's first phrasing without its holder
        return f"{meta['entity']} is {DESCRIPTIONS[first][0].split('{')[0].rstrip()}"
    return None


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop articles, collapse whitespace."""
    s = s.lower().translate(_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _golds(answers) -> list[str]:
    return [answers] if isinstance(answers, str) else list(answers)


def final_answer(prediction: str) -> str:
    """A reasoned answer's conclusion: the text after the last ``=>`` (``"Kestrel Works => Brar"`` ->
    ``"Brar"``; a model trained with ``--reasoned-answers`` names a two-hop question's bridge entity
    first); a plain answer as it is."""
    return prediction.rpartition(ANSWER_MARK)[2]


def bridge_match(prediction: str, bridge: str | None, fact: str | None = None) -> float | None:
    """Exact match of a reasoned answer's bridge: the text before its last ``=>``, after ``fact`` when
    the answer restates its first hop (``restated_fact``: "X was born in BRIDGE => …").
    None when the prediction is not reasoned or there is no bridge to compare with."""
    head, mark, _ = prediction.rpartition(ANSWER_MARK)
    if not (mark and bridge):
        return None
    head, fact = normalize_answer(head), normalize_answer(fact or "")
    if fact and head.startswith(fact + " "):
        head = head[len(fact) + 1:]
    return float(head == normalize_answer(bridge))


def twin_match(prediction: str, record: dict) -> float | None:
    """1.0 if a wrong answer is the answer of the record's same-variant twin (``meta``'s
    ``distractor_answers``, testbed records made with ``--meta``): the right kind of fact about the
    wrong entity, where a model that finds the candidates but not the link ends up half the time.
    None for records without twins."""
    twins = (record.get("meta") or {}).get("distractor_answers")
    if not twins:
        return None
    return float(not exact_match(prediction, record["answers"]) and bool(exact_match(prediction, twins)))


def exact_match(prediction: str, answers: str | list[str]) -> float:
    """1.0 if the normalised prediction (its conclusion) equals any normalised gold answer."""
    pred = normalize_answer(final_answer(prediction))
    return float(any(pred == normalize_answer(a) for a in _golds(answers)))


def _token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:  # SQuAD v2 rule: an empty side scores 1 only if both are empty
        return float(pred == ref)
    same = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, answers: str | list[str]) -> float:
    """SQuAD token F1 (bag of normalised tokens) of the prediction's conclusion, max over the gold answers."""
    prediction = final_answer(prediction)
    return max((_token_f1(prediction, a) for a in _golds(answers)), default=0.0)

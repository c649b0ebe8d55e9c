"""The easy curriculum corpus: short contexts of one-sentence facts, each key next to its value.

An ``easy`` stage lets the lookup circuit (match the key, copy what follows it) form where it is
easy to find, before the ``qa`` corpus (``records``) asks for it across documents of filler.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .clusters import ROLE_QUESTIONS
from .documents import _words
from .records import _check_args, _contains
from .templates import EASY_FACTS, SINGLE_HOP
from .world import Person, World, role_holder


@dataclass
class _Fact:
    sentence: str
    question: str
    answer: str
    relation: str
    entity: str


# easy stages of ``role``: the key *after* its value ("The mayor of V is X.", asked "Which city is X the
# mayor of?"), so the lookup must read what precedes the name: mention's first hop in one sentence
EASY_ROLE_FACTS = {  # relation -> (role, sentence)
    "founder_of": ("founder", "{V} was founded by {X}."), "mayor_of": ("mayor", "The mayor of {V} is {X}."),
    "engineer_of": ("engineer", "The chief engineer of {V} is {X}.")}
EASY_TYPES = ("single_hop", "role")  # an easy stage's facts: key before value (the default), or after


def _easy_role_fact(world: World, relation: str) -> _Fact:
    role, sentence = EASY_ROLE_FACTS[relation]
    holder, x = role_holder(world, role)
    return _Fact(sentence.format(X=x.name, V=holder.name),
                 world.rng.choice(ROLE_QUESTIONS[role]).format(X=x.name), holder.name, relation, x.name)


def _easy_fact(world: World, relation: str) -> _Fact:
    if relation in EASY_ROLE_FACTS:
        return _easy_role_fact(world, relation)
    kind, attr, questions = SINGLE_HOP[relation]
    entity = {"person": world.person, "company": world.company, "city": world.city}[kind]()
    value = getattr(entity, attr)
    value = value.name if isinstance(value, Person) else str(value)
    return _Fact(EASY_FACTS[relation].format(X=entity.name, V=value),
                 world.rng.choice(questions).format(X=entity.name), value, relation, entity.name)


def _easy_context(seed: int, i: int, context_tokens: int, questions: int, tokens_per_word: float,
                  meta: bool, types=("single_hop",)) -> list[dict]:
    rng = random.Random(f"redknot-testbed-easy:{seed}:{i}")
    world = World(rng)
    words_budget = context_tokens / tokens_per_word
    pool = [r for t in dict.fromkeys(types) for r in (SINGLE_HOP if t == "single_hop" else EASY_ROLE_FACTS)]
    relations = rng.sample(pool, rng.randint(2, min(4, len(pool))))  # few relations, so each one repeats
    # two facts of each asked relation at least (the asked one and its distractor), then fill
    facts = [_easy_fact(world, relations[(k // 2) % len(relations)]) for k in range(2 * questions)]
    words = sum(_words(f.sentence) for f in facts)
    while words < words_budget - 5:
        facts.append(_easy_fact(world, rng.choice(relations)))
        words += _words(facts[-1].sentence)
    asked = [facts[2 * q + rng.randint(0, 1)] for q in range(questions)]
    rng.shuffle(facts)
    docs, k = [], 0
    while k < len(facts):  # short documents of 2-4 facts
        size = rng.randint(2, 4)
        docs.append(" ".join(f.sentence for f in facts[k:k + size]))
        k += size
    records = []
    for q, fact in enumerate(asked):
        support = [d for d, text in enumerate(docs) if _contains(text, fact.sentence)]
        rec = {"id": f"e{seed}-{i}-{q}", "documents": docs, "question": fact.question, "answers": [fact.answer],
               "type": "easy" if fact.relation not in EASY_ROLE_FACTS else "easy_role", "supporting": support}
        if meta:
            rec["meta"] = {"entity": fact.entity, "relation": fact.relation, "sentence": fact.sentence,
                           "distractor_answers": [f.answer for f in facts
                                                  if f.relation == fact.relation and f is not fact]}
        records.append(rec)
    return records


def easy_records(seed: int, n: int, context_tokens: int = 128, questions_per_context: int = 1,
                 tokens_per_word: float = 1.3, meta: bool = False, types=("single_hop",)) -> list[dict]:
    """Curriculum stage 1: short contexts of one-sentence facts ("X was born in Y."), the key next
    to its value, a few same-relation distractors; single-hop questions; type ``"easy"``. With
    ``"role"`` among ``types``, facts also state a role with the key last ("The mayor of Y is X.",
    asked "Which city is X the mayor of?"; type ``"easy_role"``)."""
    _check_args(n, context_tokens, questions_per_context, tokens_per_word)
    bad = [t for t in types if t not in EASY_TYPES]
    if bad or not types:
        raise ValueError(f"easy types={list(types)}: use one or more of {list(EASY_TYPES)}")
    return [r for i in range(n) for r in _easy_context(seed, i, context_tokens, questions_per_context,
                                                       tokens_per_word, meta, tuple(types))]

"""QA records of the synthetic long-context multi-document corpus.

Every context is a set of documents about fictional entities (people, towns, companies, academies,
rivers, mountains; ``world``) written from templates (``documents``). Its facts come in question
clusters (``clusters``: ``single_hop``, ``multi_hop``, ``cross_doc``, ``description``, and the
training-only ``mention`` and ``role``). Every asked cluster has a twin of the same variant with
other names (asked too when there is more than one question per context), and the rest of the
budget is filled with clusters of the same styles, so "any entity of the right type" is never a
safe answer.

A record is ``{"id", "documents", "question", "answers", "type"}`` plus ``"supporting"`` (indices of
the documents needed, in reasoning order; the answer is in the last one) and, on request,
``"meta"`` (question entity, relation, bridge entity, description, answers of same-variant twins).
"""

from __future__ import annotations

import math
import random
import re

from .clusters import MAKERS, Cluster
from .documents import MAX_DOC_WORDS, _cap, _min_doc_words, render
from .templates import VARIANTS
from .world import World

TYPES = ("single_hop", "multi_hop", "cross_doc", "description")
# asked only where a stage or make-data names them: the default records (held-out seeds) stay as they are
TRAINING_TYPES = ("mention", "role")
ALL_TYPES = TYPES + TRAINING_TYPES
BRIDGED_TYPES = ("multi_hop", "description", "mention")  # the types whose records name a bridge entity
TARGET_DOC_WORDS = 270  # documents per context ~ words budget / this


def _contains(text: str, phrase: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text) is not None


def _check(c: Cluster, docs: list[str], support: list[int]) -> None:
    """The invariants the corpus promises; a failure here is a generator bug."""
    answer_doc = docs[support[-1]]
    assert _contains(answer_doc, c.answer), (c.question, c.answer)
    if len(support) == 2:
        first = docs[support[0]]
        assert _contains(first, c.entity) and not _contains(first, c.answer), (c.question, c.answer)
        assert all(not _contains(answer_doc, w) for w in c.forbidden.get(1, ())), c.question
    if c.type in BRIDGED_TYPES:
        assert _contains(answer_doc, c.bridge) or c.description.lower() in answer_doc.lower(), c.question
    if c.type in ("description", "mention"):
        assert support[0] < support[1] and c.description in answer_doc.replace(_cap(c.description), c.description)
    if c.type == "cross_doc":  # the continuation follows its bio directly
        assert support[1] == support[0] + 1, c.question
    if c.type == "role":  # the holder's own document names X
        assert _contains(answer_doc, c.entity), c.question


def _budget_clusters(world: World, rng: random.Random, words_budget: float, questions: int, types,
                     pair_base: int) -> tuple[list[Cluster], list[Cluster]]:
    """Asked clusters (pairs of one variant, both asked when there are enough questions), the unasked
    twin, then distractor clusters until the document count fits the word budget."""
    asked, twins = [], []
    for j in range(math.ceil(questions / 2)):
        t = types[(pair_base + j) % len(types)]
        variant = rng.choice(VARIANTS[t])
        first = MAKERS[t](world, variant)
        # a cross_doc twin has the same gender: the question's pronoun must not pick the continuation
        pair = [first, MAKERS[t](world, variant, first.gender) if first.gender else MAKERS[t](world, variant)]
        asked.append(pair[0])
        (asked if len(asked) < questions else twins).append(pair[1])
    n_docs = sum(len(c.docs) for c in asked)
    max_docs = max(n_docs, int(words_budget // _min_doc_words(words_budget)))
    target_docs = max(n_docs, round(words_budget / TARGET_DOC_WORDS))
    extra = []
    for c in twins:
        if n_docs + len(c.docs) <= max_docs:
            extra.append(c)
            n_docs += len(c.docs)
    while n_docs < target_docs:
        t = rng.choice(types) if target_docs - n_docs >= 2 else "single_hop"
        c = MAKERS[t](world, rng.choice(VARIANTS[t]))
        extra.append(c)
        n_docs += len(c.docs)
    return asked, extra


def _word_targets(rng: random.Random, n_docs: int, words_budget: float) -> list[int]:
    raw = [rng.uniform(0.8, 1.2) for _ in range(n_docs)]
    scale = words_budget / sum(raw)
    return [int(min(max(r * scale, _min_doc_words(words_budget)), MAX_DOC_WORDS)) for r in raw]


def _context_records(seed: int, i: int, context_tokens: int, questions: int, types, tokens_per_word: float,
                     meta: bool) -> list[dict]:
    rng = random.Random(f"redknot-testbed:{seed}:{i}")
    world = World(rng)
    words_budget = context_tokens / tokens_per_word
    asked, extra = _budget_clusters(world, rng, words_budget, questions, types, i * math.ceil(questions / 2))
    clusters = asked + extra
    # a bio and its continuation move as one unit; every other document on its own
    units = []
    for ci, c in enumerate(clusters):
        members = [(ci, di) for di in range(len(c.docs))]
        units += [members] if c.type == "cross_doc" else [[m] for m in members]
    rng.shuffle(units)
    slots = [s for u in units for s in u]
    pos = {s: k for k, s in enumerate(slots)}
    for ci, c in enumerate(clusters):  # a described reference always points back
        if c.type in ("description", "mention", "role") and pos[(ci, 0)] > pos[(ci, 1)]:
            a, b = pos[(ci, 0)], pos[(ci, 1)]
            slots[a], slots[b] = slots[b], slots[a]
            pos[(ci, 0)], pos[(ci, 1)] = b, a
    targets = _word_targets(rng, len(slots), words_budget)
    min_words = _min_doc_words(words_budget)
    docs = [render(clusters[ci].docs[di], w, world, min_words) for (ci, di), w in zip(slots, targets)]
    records = []
    for q, c in enumerate(asked):  # asked clusters come first: cluster index == q
        support = [pos[(q, di)] for di in (c.support or range(len(c.docs)))]
        _check(c, docs, support)
        rec = {"id": f"s{seed}-{i}-{q}", "documents": docs, "question": c.question, "answers": [c.answer],
               "type": c.type, "supporting": support}
        if meta:
            rec["meta"] = {"entity": c.entity, "relation": c.variant, "bridge": c.bridge, "description": c.description,
                           "distractor_answers": [o.answer for o in clusters
                                                  if o is not c and (o.type, o.variant) == (c.type, c.variant)]}
        records.append(rec)
    return records


def _check_args(n: int, context_tokens: int, questions_per_context: int, tokens_per_word: float, types=TYPES):
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if context_tokens < 1:
        raise ValueError(f"context_tokens={context_tokens} must be >= 1")
    if questions_per_context < 1:
        raise ValueError(f"questions_per_context={questions_per_context} must be >= 1")
    if not tokens_per_word > 0:
        raise ValueError(f"tokens_per_word={tokens_per_word} must be > 0")
    types = (types,) if isinstance(types, str) else tuple(types)
    bad = [t for t in types if t not in ALL_TYPES]
    if not types or bad:
        raise ValueError(f"types={list(types)}: use one or more of {list(ALL_TYPES)}")
    return types


def generate_records(seed: int, n: int, context_tokens: int = 2048, questions_per_context: int = 1,
                     types=TYPES, tokens_per_word: float = 1.3, meta: bool = False) -> list[dict]:
    """``n`` contexts x ``questions_per_context`` records, deterministic for ``seed``.

    Context ``i`` depends only on ``(seed, i)`` (so a smaller ``n`` gives a prefix). Question types
    go round-robin over ``types`` (pairs of questions share a type and variant). Documents fill
    about ``context_tokens`` tokens, estimated as words x ``tokens_per_word``; with many questions
    for a short context, the asked documents alone may exceed it (documents keep >= 150 words).
    """
    types = _check_args(n, context_tokens, questions_per_context, tokens_per_word, types)
    return [r for i in range(n)
            for r in _context_records(seed, i, context_tokens, questions_per_context, types, tokens_per_word, meta)]

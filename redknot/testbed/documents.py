"""Documents: a plan of template sentences about one entity, then its rendered text.

A document is a bio (person) or a profile (company, town, academy): a title line, an intro
sentence, one sentence per fact, and neutral filler of the entity's kind mixed in until it reaches
its word target, 150-400 words where a context holds four documents or more. Shorter contexts (the
curriculum's) get shorter documents: the core sentences and less filler. A plan stays unformatted
until every fact year of its context is drawn (``render``), so that no filler year equals an answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .templates import (ACADEMY_FACTS, ACADEMY_INTRO, CITY_FACTS, CITY_INTRO, COMPANY_FACTS, COMPANY_INTRO,
                        CONTINUATION_INTRO, CONTINUATION_TITLES, FILLER, ORDINALS, PERSON_FACTS, PERSON_INTRO)
from .world import Academy, City, Company, Person, World

MIN_DOC_WORDS, MAX_DOC_WORDS = 150, 400
SHORT_DOC_WORDS = 24  # the floor for contexts too short for four documents of MIN_DOC_WORDS (curriculum stages)


@dataclass
class DocPlan:
    """A document before rendering: title, core sentence templates with their slots (intro first),
    and the filler pool with its slots. Formatting waits until every fact year of the context is
    drawn, so that no filler year can equal an answer."""
    title: str
    core: list[tuple[str, dict]]
    filler_kind: str
    slots: dict


def _article(word: str) -> str:
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _fill(template: str, slots: dict, world: World) -> str:
    """Format a template: list-valued slots pick one value; numbers and filler years are drawn."""
    rng = world.rng
    values = {k: (rng.choice(v) if isinstance(v, list) else v) for k, v in slots.items()}
    values.update(year=world.filler_year(slots.get("since", 1700)), num=rng.randint(3, 90), num2=rng.randint(2, 6),
                  ordinal=rng.choice(ORDINALS))
    return _cap(template.format_map(values))


def _person_slots(p: Person) -> dict:
    return {**p.p, "name": p.name, "N": [p.name, p.first, p.p["Pron"]], "n": [p.name, p.first, p.p["pron"]],
            "a_occupation": _article(p.occupation), "since": p.birth_year + 16, "birth_city": p.birth_city,
            "birth_year": p.birth_year,
            "employer": p.employer, "school": p.school, "residence": p.residence}


def _named_slots(name: str, noun: str) -> dict:
    return {"name": name, "C": [name, name, f"The {noun}"], "c": [name, name, f"the {noun}"]}


def _plan(title: str, intro: list[str], facts: dict, slots: dict, kind: str, world: World,
          extra: tuple[str, ...] = (), extra_slots: dict | None = None) -> DocPlan:
    rng = world.rng
    core = [(rng.choice(intro), slots)] + [(rng.choice(ts), slots) for ts in facts.values()]
    core += [(t, {**slots, **(extra_slots or {})}) for t in extra]
    return DocPlan(title, core, kind, slots)


def person_doc(p: Person, world: World, extra=(), extra_slots=None) -> DocPlan:
    return _plan(p.name, PERSON_INTRO, PERSON_FACTS, _person_slots(p), "person", world, extra, extra_slots)


def company_doc(c: Company, world: World, extra=(), extra_slots=None) -> DocPlan:
    slots = {**_named_slots(c.name, "company"), "since": c.founded_year, "product": c.product,
             "founder": c.founder.name,
             "founded_year": c.founded_year, "hq": c.hq, "engineer": c.engineer.name}
    return _plan(c.name, COMPANY_INTRO, COMPANY_FACTS, slots, "company", world, extra, extra_slots)


def city_doc(c: City, world: World, extra=(), extra_slots=None) -> DocPlan:
    slots = {**_named_slots(c.name, "town"), "a_adj": _article(c.adj), "population": c.population,
             "river": c.river, "mountain": c.mountain, "founded_year": c.founded_year, "mayor": c.mayor.name}
    return _plan(c.name, CITY_INTRO, CITY_FACTS, slots, "city", world, extra, extra_slots)


def academy_doc(a: Academy, world: World, extra=(), extra_slots=None) -> DocPlan:
    slots = {**_named_slots(a.name, "academy"), "since": a.founded_year, "subject": a.subject, "city": a.city,
             "founded_year": a.founded_year}
    return _plan(a.name, ACADEMY_INTRO, ACADEMY_FACTS, slots, "academy", world, extra, extra_slots)


def _words(text: str) -> int:
    return len(text.split())


def _min_doc_words(words_budget: float) -> float:
    """Documents are 150-400 words where a context holds four of them (every context of 1K tokens
    and more); shorter contexts get shorter documents, the core sentences and less filler, so a
    curriculum can start with four short documents."""
    return MIN_DOC_WORDS if words_budget >= 4 * MIN_DOC_WORDS else max(SHORT_DOC_WORDS, words_budget / 4)


def render(plan: DocPlan, target_words: int, world: World, min_words: float = MIN_DOC_WORDS) -> str:
    """Title line, then the core sentences with filler mixed in until about ``target_words``."""
    rng = world.rng
    target = min(max(target_words, min_words), MAX_DOC_WORDS)
    core = [_fill(t, slots, world) for t, slots in plan.core]
    words = _words(plan.title) + sum(_words(s) for s in core)
    pool = rng.sample(FILLER[plan.filler_kind], len(FILLER[plan.filler_kind]))
    pool += rng.sample(FILLER["generic"], len(FILLER["generic"]))
    filler = []
    for template in pool:
        if words >= target - 4:
            break
        s = _fill(template, plan.slots, world)
        if words + _words(s) <= min(target + 8, MAX_DOC_WORDS):
            filler.append(s)
            words += _words(s)
    body = core[1:] + filler
    rng.shuffle(body)
    body = [core[0]] + body
    n_par = max(1, min(3, len(body) // 5))
    cuts = [round(k * len(body) / n_par) for k in range(n_par + 1)]
    paragraphs = [" ".join(body[a:b]) for a, b in zip(cuts, cuts[1:])]
    return plan.title + "\n" + "\n\n".join(paragraphs)


def continuation_doc(x: Person, world: World, fact: str, fact_slots: dict) -> DocPlan:
    """A bio's continuation: a generic title, X only as she/he/her/him, one fact among filler."""
    rng = world.rng
    slots = {**x.p, "N": [x.p["Pron"]], "n": [x.p["pron"]], "since": x.birth_year + 40}
    core = [(rng.choice(CONTINUATION_INTRO), slots), (fact, {**slots, **fact_slots})]
    return DocPlan(rng.choice(CONTINUATION_TITLES), core, "person", slots)

"""Synthetic long-context multi-document QA corpus for the testbed model.

Every context is a set of documents about fictional entities (people, towns, companies, academies,
rivers, mountains) whose names are built from syllables and kept unambiguous within the context (no
name word equals, contains or is contained in another). Documents are bios and profiles written
from templates plus neutral filler, 150-400 words each. Facts come in *clusters*:

- ``single_hop``: one document states the answer ("Which city was Orla Venn born in?").
- ``multi_hop``: document A says X works for company C, document B says where C is headquartered;
  the question asks where X's employer is headquartered. B never names X, A never states the answer.
- ``cross_doc``: document A is a bio of X; the document right after it continues that bio
  without a name ("Later life / She spent her final years in Brar."), and the question names X.
  The pronoun is resolved only by reading A before B: chunks encoded independently lose the link,
  and the same-variant twin (same gender, another continuation) leaves nothing in B's own text to
  tell the two apart.
- ``description``: document A is X's bio and gives X a role ("Orla Venn founded Kestrel Works in
  1820"); a *later* document B refers to X only by that role ("the founder of Kestrel Works") and
  states a fact about them; the question names X. Linked at question time (X's bio gives the role,
  the role finds B's description), so it tests reference by description, not reuse.
- ``mention`` (not among the default types): the first form of ``description``, where document A is
  the role holder's profile and names X once ("Kestrel Works was founded by Orla Venn"), so the first
  hop runs backwards from X's single mention. No testbed model learned that hop above the coin flip
  between X and its twin (runs V–Z, `git show 21f14ac:docs/results/testbed.md`), so it measures the model, not the
  methods. ``--types single_hop multi_hop cross_doc mention`` regenerates the earlier held-out files
  exactly (type ``mention`` where they said ``description``).
- ``role`` (for training stages only, not among the default types): a ``mention`` cluster asked
  for the holder of X's role ("Which city is Orla Venn the mayor of?" -> the city whose document
  names X as its mayor), the backward first hop of ``mention`` on its own.

Every asked cluster has a twin of the same variant with other names (asked too when there is more
than one question per context), and the rest of the budget is filled with clusters of the same
styles, so "any entity of the right type" is never a safe answer.

A record is ``{"id", "documents", "question", "answers", "type"}`` plus ``"supporting"`` (indices of
the documents needed, in reasoning order; the answer is in the last one) and, on request,
``"meta"`` (question entity, relation, bridge entity, description, answers of same-variant twins).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

from ..qa.answers import ANSWER_MARK, DESCRIPTIONS, EASY_FACTS, MAX_ANSWER_TOKENS, restated_fact  # noqa: F401
from ..qa.records import REQUIRED_FIELDS, RecordError, check_record, read_jsonl, write_jsonl  # noqa: F401
from .templates import *  # noqa: F401,F403  (the corpus's words and sentence templates)
from .templates import _TEMPLATE_WORDS

TYPES = ("single_hop", "multi_hop", "cross_doc", "description")
# asked only where a stage or make-data names them: the default records (held-out seeds) stay as they were
TRAINING_TYPES = ("mention", "role")
ALL_TYPES = TYPES + TRAINING_TYPES
BRIDGED_TYPES = ("multi_hop", "description", "mention")  # the types whose records name a bridge entity
MIN_DOC_WORDS, MAX_DOC_WORDS = 150, 400
SHORT_DOC_WORDS = 24  # the floor for contexts too short for four documents of MIN_DOC_WORDS (curriculum stages)
TARGET_DOC_WORDS = 270  # documents per context ~ words budget / this

# ---- entities -----------------------------------------------------------------------------------
@dataclass
class Person:
    name: str
    first: str
    last: str
    gender: str
    occupation: str
    birth_city: str
    birth_year: int
    employer: str
    school: str
    residence: str

    @property
    def p(self) -> dict:
        return PRONOUNS[self.gender]


@dataclass
class Company:
    name: str
    product: str
    founder: Person
    founded_year: int
    hq: str
    engineer: Person


@dataclass
class City:
    name: str
    adj: str
    population: int
    river: str
    mountain: str
    founded_year: int
    mayor: Person


@dataclass
class Academy:
    name: str
    subject: str
    city: str
    founded_year: int


@dataclass
class DocPlan:
    """A document before rendering: title, core sentence templates with their slots (intro first),
    and the filler pool with its slots. Formatting waits until every fact year of the context is
    drawn, so that no filler year can equal an answer."""
    title: str
    core: list[tuple[str, dict]]
    filler_kind: str
    slots: dict


@dataclass
class Cluster:
    type: str
    variant: str
    docs: list[DocPlan]  # cross_doc: [A, B], B right after A; description: [A, B], A before B
    question: str
    answer: str
    entity: str  # named in the question
    bridge: str | None = None
    description: str | None = None
    forbidden: dict = field(default_factory=dict)  # doc index -> words it must not contain
    gender: str | None = None  # of the question's person where the text refers to them by pronoun
    support: tuple[int, ...] | None = None  # docs needed, in reasoning order (default: all of them)


class World:
    """Fresh, mutually unambiguous names and unique fact years for one context."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.words: list[str] = []  # distinctive name words, lower case
        self._word_set: set[str] = set()
        self._word_substrings: set[str] = set()  # every substring of a used name word
        self.fact_years: set[int] = set()

    # names
    def _syllables(self, k: int) -> str:
        """``k`` syllables: a consonant cluster may open the word, later onsets are single consonants,
        codas are rare inside the word (pronounceable names of a few tokens)."""
        rng, parts = self.rng, []
        for i in range(k):
            onset = (rng.choice(ONSETS) if rng.random() < 0.8 else "") if i == 0 else rng.choice(INNER_ONSETS)
            coda = rng.choice(CODAS) if rng.random() < (0.5 if i == k - 1 else 0.2) else ""
            parts.append(onset + rng.choice(VOWELS) + coda)
        return "".join(parts)

    def _claim(self, make) -> str:
        """A word from ``make()`` that is not a template word and shares no substring relation with
        a name word already used in this context."""
        for _ in range(1000):
            w = make()
            lw = w.lower()
            if not (4 <= len(w) <= 10 and lw not in _TEMPLATE_WORDS and not re.search(r"(.)\1\1", lw)):
                continue
            # substring relation with a used word, in O(len^2) with sets instead of a scan of all words
            subs = {lw[i:j] for i in range(len(lw)) for j in range(i + 1, len(lw) + 1)}
            if lw not in self._word_substrings and not subs & self._word_set:
                self.words.append(lw)
                self._word_set.add(lw)
                self._word_substrings |= subs
                return w.capitalize()
        raise RuntimeError("could not find a fresh name")  # pragma: no cover

    def year(self, lo: int, hi: int) -> int:
        for _ in range(1000):
            y = self.rng.randint(lo, hi)
            if y not in self.fact_years:
                self.fact_years.add(y)
                return y
        raise RuntimeError("ran out of distinct years")  # pragma: no cover

    def filler_year(self, since: int = 1700) -> int:
        """A year for filler (after ``since`` where possible), never a fact year of the context."""
        lo = min(max(since, 1700), 2010)
        while True:
            y = self.rng.randint(lo, 2024)
            if y not in self.fact_years:
                return y

    def city_name(self) -> str:
        return self._claim(lambda: self._syllables(self.rng.choice([1, 2])) + self.rng.choice(CITY_SUFFIXES))

    def company_name(self) -> str:
        return f"{self._claim(lambda: self._syllables(2))} {self.rng.choice(list(COMPANY_KINDS))}"

    def academy_name(self) -> str:
        return f"{self._claim(lambda: self._syllables(2))} {self.rng.choice(ACADEMY_KINDS)}"

    def river_name(self) -> str:
        return f"{self._claim(lambda: self._syllables(2))} River"

    def mountain_name(self) -> str:
        return f"Mount {self._claim(lambda: self._syllables(2))}"

    # entities
    def person(self, gender: str | None = None) -> Person:
        rng = self.rng
        first = self._claim(lambda: self._syllables(2))
        last = self._claim(lambda: self._syllables(rng.choice([1, 2])) + rng.choice(SURNAME_SUFFIXES))
        gender = rng.choice(list(PRONOUNS)) if gender is None else gender
        return Person(f"{first} {last}", first, last, gender, rng.choice(OCCUPATIONS),
                      self.city_name(), self.year(1800, 1995), self.company_name(), self.academy_name(),
                      self.city_name())

    def company(self) -> Company:
        name = self.company_name()
        product = self.rng.choice(COMPANY_KINDS[name.split()[-1]])
        return Company(name, product, self.person(), self.year(1750, 1990), self.city_name(), self.person())

    def city(self) -> City:
        return City(self.city_name(), self.rng.choice(TOWN_ADJECTIVES), self.rng.randint(3, 400), self.river_name(),
                    self.mountain_name(), self.year(1100, 1850), self.person())

    def academy(self) -> Academy:
        return Academy(self.academy_name(), self.rng.choice(ACADEMY_SUBJECTS), self.city_name(),
                       self.year(1600, 1950))


# ---- documents ----------------------------------------------------------------------------------
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
    and more, so those records never change); shorter contexts get shorter documents, the core
    sentences and less filler, so a curriculum can start with four short documents."""
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


# ---- clusters -----------------------------------------------------------------------------------
def single_hop_cluster(world: World, relation: str) -> Cluster:
    kind, attr, questions = SINGLE_HOP[relation]
    entity = {"person": world.person, "company": world.company, "city": world.city}[kind]()
    doc = {"person": person_doc, "company": company_doc, "city": city_doc}[kind](entity, world)
    answer = getattr(entity, attr)
    answer = answer.name if isinstance(answer, Person) else str(answer)
    q = world.rng.choice(questions).format(X=entity.name)
    return Cluster("single_hop", relation, [doc], q, answer, entity.name)


def multi_hop_cluster(world: World, variant: str) -> Cluster:
    """A: bio of X naming the bridge entity; B: profile of the bridge entity stating the answer."""
    link, attr = variant.split("->")
    x = world.person()
    if link == "employer":
        bridge = world.company()
        x.employer = bridge.name
        b_doc = company_doc(bridge, world)
    elif link == "school":
        bridge = world.academy()
        x.school = bridge.name
        b_doc = academy_doc(bridge, world)
    else:  # birth_city, residence
        bridge = world.city()
        setattr(x, link, bridge.name)
        b_doc = city_doc(bridge, world)
    answer = getattr(bridge, attr)
    answer = answer.name if isinstance(answer, Person) else str(answer)
    q = world.rng.choice(MULTI_HOP[(link, attr)]).format(X=x.name)
    return Cluster("multi_hop", variant, [person_doc(x, world), b_doc], q, answer, x.name, bridge=bridge.name,
                   forbidden={1: [x.first, x.last]})


def continuation_doc(x: Person, world: World, fact: str, fact_slots: dict) -> DocPlan:
    """A bio's continuation: a generic title, X only as she/he/her/him, one fact among filler."""
    rng = world.rng
    slots = {**x.p, "N": [x.p["Pron"]], "n": [x.p["pron"]], "since": x.birth_year + 40}
    core = [(rng.choice(CONTINUATION_INTRO), slots), (fact, {**slots, **fact_slots})]
    return DocPlan(rng.choice(CONTINUATION_TITLES), core, "person", slots)


def cross_doc_cluster(world: World, variant: str, gender: str | None = None) -> Cluster:
    """A: X's bio; B, placed right after A: its continuation, which never names X, states the answer."""
    rng = world.rng
    x = world.person(gender)
    if variant in ("final_years", "statue"):
        answer = world.city_name()
        slots = {"town": answer}
    elif variant == "honorary":
        answer = str(world.year(1800, 2000))
        slots = {"hon_year": answer, "academy": world.academy_name()}
    else:  # married
        answer = world.person().name
        slots = {"spouse": answer}
    b_doc = continuation_doc(x, world, rng.choice(CONTINUATION_FACTS[variant]), slots)
    q = rng.choice(CROSS_DOC_QUESTIONS[variant]).format(X=x.name, xposs=x.p["poss"])
    return Cluster("cross_doc", variant, [person_doc(x, world), b_doc], q, answer, x.name,
                   forbidden={1: [x.first, x.last]}, gender=x.gender)


def role_holder(world: World, role: str):
    """A new town (mayor) or company (founder, engineer) and the person who holds ``role`` there."""
    if role == "mayor":
        holder = world.city()
        return holder, holder.mayor
    holder = world.company()
    return holder, holder.founder if role == "founder" else holder.engineer


def _described_cluster(world: World, variant: str, kind: str) -> Cluster:
    """A gives X a role; a later B describes X only by that role and states the answer. ``kind``
    says what A is: X's bio stating the role (``description``) or the holder's profile naming X
    (``mention``, the first form: draws exactly what it always drew, so its records never change)."""
    role, later = variant.split("->")
    rng = world.rng
    holder, x = role_holder(world, role)
    anchor = {"city": holder.name} if role == "mayor" else {"company": holder.name}
    if kind == "mention":
        a_doc = city_doc(holder, world) if role == "mayor" else company_doc(holder, world)
    else:
        slots = {"holder": holder.name, "founded_year": holder.founded_year}
        a_doc = person_doc(x, world, [rng.choice(ROLE_FACTS[role])], slots)
    desc = rng.choice(DESCRIPTIONS[role]).format(person=x.p["person"], **anchor)
    ref = {"desc": desc, "Desc": _cap(desc), "dposs": x.p["poss"]}
    template = [rng.choice(LATER_FACTS[later])]
    if later in ("final_years", "statue"):
        town = world.city()
        b_doc, answer = city_doc(town, world, template, ref), town.name
    elif later == "honorary":
        academy = world.academy()
        hon_year = world.year(1800, 2000)
        b_doc, answer = academy_doc(academy, world, template, {**ref, "hon_year": hon_year}), str(hon_year)
    else:  # married
        spouse = world.person()
        b_doc, answer = person_doc(spouse, world, template, ref), spouse.name
    q = rng.choice(CROSS_DOC_QUESTIONS[later]).format(X=x.name, xposs=x.p["poss"])
    return Cluster(kind, variant, [a_doc, b_doc], q, answer, x.name, bridge=holder.name, description=desc,
                   forbidden={1: [x.first, x.last]})


def description_cluster(world: World, variant: str) -> Cluster:
    """A: X's bio, which gives X a role; a later B describes X only by that role and states the answer."""
    return _described_cluster(world, variant, "description")


def mention_cluster(world: World, variant: str) -> Cluster:
    """A: the role holder's profile, which names X once; a later B describes X only by that role."""
    return _described_cluster(world, variant, "mention")


ROLE_QUESTIONS = {
    "founder": ["Which company did {X} found?", "What company was founded by {X}?"],
    "mayor": ["Which city is {X} the mayor of?", "Of which city is {X} the mayor?"],
    "engineer": ["Which company is {X} the chief engineer of?", "Where is {X} the chief engineer?"],
}


def role_cluster(world: World, variant: str) -> Cluster:
    """A ``mention`` cluster (A names X in a role, a later B describes X by it) asked for the holder
    of the role: the answer is the subject of the document that names X, found from X backwards."""
    later = world.rng.choice(list(LATER_FACTS))
    c = mention_cluster(world, f"{variant}->{later}")
    q = world.rng.choice(ROLE_QUESTIONS[variant]).format(X=c.entity)
    return Cluster("role", variant, c.docs, q, c.bridge, c.entity, description=c.description,
                   forbidden=c.forbidden, support=(0,))


MAKERS = {"single_hop": single_hop_cluster, "multi_hop": multi_hop_cluster, "cross_doc": cross_doc_cluster,
          "description": description_cluster, "mention": mention_cluster, "role": role_cluster}


# ---- contexts -----------------------------------------------------------------------------------
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


def target_answer(record: dict, reasoned=(), restate: bool = False) -> str:
    """The text a model is trained to answer ``record`` with: its first gold answer or, when its type is
    in ``reasoned`` (a subset of BRIDGED_TYPES; the record made with ``meta``), the bridge entity first:
    ``"Kestrel Works => Brar"``, so the second lookup reads a name the model has just written instead
    of one it must compose internally. With ``restate`` the answer first writes its first hop as a fact
    (``restated_fact``), ``"Sagern Ikethov was born in Gubury => Orgai River"``, ``"Orla Venn is the
    founder of Kestrel Works => Brar"``: the bridge is then looked up right after the entity's name,
    as a single-hop answer is, and written last, right before the second lookup it keys. Scoring reads
    the part after ``=>`` (bench.quality.final_answer)."""
    answer = record["answers"][0]
    if record.get("type") not in reasoned:
        return answer
    bridge = (record.get("meta") or {}).get("bridge")
    if not bridge:
        raise ValueError(f"record {record.get('id')!r}: a reasoned answer needs the bridge entity "
                         f"(generate_records(meta=True) / make-data --meta)")
    fact = restated_fact(record) if restate else None
    return f"{fact + ' ' if fact else ''}{bridge} {ANSWER_MARK} {answer}"


# ---- multi_hop split into its hops ----------------------------------------------------------------
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


# ---- easy curriculum ----------------------------------------------------------------------------
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

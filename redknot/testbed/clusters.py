"""Question clusters: the documents that together answer one question, and the question.

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
- ``mention`` (not among the default types): ``description`` with document A the role holder's
  profile, which names X once ("Kestrel Works was founded by Orla Venn"), so the first hop runs
  backwards from X's single mention. Testbed models stay at the coin flip between X and its twin on
  that hop (runs V–Z, ``git show 21f14ac:docs/results/testbed.md``), so the type measures the model,
  not the reuse methods. Held-out files whose ``description`` records have this form are what
  ``--types single_hop multi_hop cross_doc mention`` draws (type ``mention`` where they say
  ``description``): ``mention`` takes from the generator exactly what those records took.
- ``role`` (for training stages only, not among the default types): a ``mention`` cluster asked
  for the holder of X's role ("Which city is Orla Venn the mayor of?" -> the city whose document
  names X as its mayor), the backward first hop of ``mention`` on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .documents import DocPlan, _cap, academy_doc, city_doc, company_doc, continuation_doc, person_doc
from .templates import (CONTINUATION_FACTS, CROSS_DOC_QUESTIONS, DESCRIPTIONS, LATER_FACTS, MULTI_HOP, ROLE_FACTS,
                        SINGLE_HOP)
from .world import Person, World, role_holder


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


def _described_cluster(world: World, variant: str, kind: str) -> Cluster:
    """A gives X a role; a later B describes X only by that role and states the answer. ``kind``
    says what A is: X's bio stating the role (``description``) or the holder's profile naming X
    (``mention``, which takes from the generator exactly what held-out ``description`` records of
    that form took)."""
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

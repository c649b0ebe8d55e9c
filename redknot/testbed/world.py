"""The entities of one context and the names they carry.

A ``World`` draws every name of one context from syllables and keeps them unambiguous within it: a
name word is never a template word and never equals, contains or is contained in another name word
of the context, so finding a name in a document finds that entity and no other. It also hands out
fact years, each at most once per context, and filler years that never equal a fact year, so that
no year in the text can be mistaken for an answer.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from .templates import (ACADEMY_KINDS, ACADEMY_SUBJECTS, CITY_SUFFIXES, CODAS, COMPANY_KINDS, INNER_ONSETS,
                        OCCUPATIONS, ONSETS, PRONOUNS, SURNAME_SUFFIXES, TOWN_ADJECTIVES, VOWELS, _TEMPLATE_WORDS)


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


def role_holder(world: World, role: str):
    """A new town (mayor) or company (founder, engineer) and the person who holds ``role`` there."""
    if role == "mayor":
        holder = world.city()
        return holder, holder.mayor
    holder = world.company()
    return holder, holder.founder if role == "founder" else holder.engineer

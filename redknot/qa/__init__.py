"""Question-answer records and their scoring, shared by the benchmarks and the testbed.

``records``: the record schema and its JSON-lines files; ``answers``: the answer format and SQuAD
exact match / F1. Neither module imports anything else of redknot, so ``bench`` and ``testbed``
both build on them without importing each other.
"""

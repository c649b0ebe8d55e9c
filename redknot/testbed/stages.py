"""Training stages: the curriculum's syntax and the records each stage draws.

A model trained with a plain LM loss over whole sequences at 2K learns to *copy an entity of the
right type* long before it learns key-based lookup: its exact match sits at ≈ 1/candidates, a guess
among the names of the asked-for type in the context. So the curriculum runs ``easy`` stages first
(key → value adjacent, one-sentence facts, ``easy``) so the lookup circuit (match the key, copy what
follows it) forms where it is easy to find, then ``qa`` stages at growing context lengths
(``records``). The number of same-type candidates is what makes lookup hard to find (at
``easy:512``, ~60 facts, a model copies names but does not pick the asked one within 1,500 steps),
so a curriculum starts with 4 facts and 2 questions (``easy:64/2``: one distractor per question)
and doubles from there; ``--advance-em`` moves on once a stage is learned. ``easy:64/2@role``
states roles with the name last ("The mayor of V is X.", asked for V): the backward hop of
``mention``, which a model learns in one-sentence facts this way.

``qa:N`` asks the corpus for N tokens of documents, calibrated to the run's tokenizer
(``packing.plan_stage``); with many questions the documents they need can pass a short budget
(8 questions: ~2.6K tokens at qa:2048). ``qa:8192+2048`` draws both lengths into every batch,
``@TYPE+TYPE`` asks only those question types, round-robin.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from .easy import EASY_TYPES, easy_records
from .records import ALL_TYPES, generate_records

HELDOUT_SEED = 10_000         # held-out EM of stage i uses seed HELDOUT_SEED + i
_MIX_SEED_STRIDE = 1_000_003  # seed offset of a mixed stage's k-th context length


@dataclass(frozen=True)
class Stage:
    kind: str              # "easy" or "qa"
    context_tokens: int    # the longest context of the stage (rows are sized for it)
    questions: int | None = None  # questions per context; None: --questions-per-context
    mix: tuple[int, ...] = ()     # shorter context lengths drawn into the same batches
    types: tuple[str, ...] = ()   # qa question types, round-robin (a repeat weights a type); () = all
    reasoned: tuple[str, ...] = ()  # types answered "BRIDGE => ANSWER" (answers.target_answer)
    restate: bool = False  # reasoned answers restate the first hop: "X was born in BRIDGE => ANSWER"

    def __post_init__(self):
        object.__setattr__(self, "mix", tuple(self.mix))  # a saved state gives a list
        object.__setattr__(self, "types", tuple(self.types))
        object.__setattr__(self, "reasoned", tuple(self.reasoned))

    @property
    def lengths(self) -> tuple[int, ...]:
        return (self.context_tokens,) + self.mix

    def as_dict(self) -> dict:
        """For the saved state: ``mix``, ``types``, ``reasoned`` and ``restate`` only when the stage has them,
        so a stage without them is saved, and read back, as ``kind``, ``context_tokens`` and ``questions``."""
        d = asdict(self)
        for k in ("mix", "types", "reasoned", "restate"):
            if not d[k]:
                del d[k]
        return d

    @property
    def name(self) -> str:
        return (f"{self.kind}:{'+'.join(map(str, self.lengths))}" + (f"/{self.questions}" if self.questions else "")
                + (f"@{'+'.join(self.types)}" if self.types else "")
                + (f" reasoned:{'+'.join(self.reasoned)}" if self.reasoned else "")
                + (" restated" if self.restate else ""))


def parse_stages(spec: str) -> list[Stage]:
    """``KIND:CONTEXT[+CONTEXT...][/QUESTIONS][@TYPE[+TYPE...]]`` per stage, stages comma-separated."""
    stages = []
    for part in spec.split(","):
        part, at, type_spec = part.strip().partition("@")
        kind, _, rest = part.partition(":")
        ctx, slash, questions = rest.partition("/")
        lengths = ctx.split("+")
        types = tuple(type_spec.split("+")) if at else ()
        if (kind not in ("easy", "qa") or not all(x.isdigit() and int(x) > 0 for x in lengths)
                or len(set(lengths)) != len(lengths)
                or (slash and (not questions.isdigit() or int(questions) <= 0))
                or (at and not all(t in (ALL_TYPES if kind == "qa" else EASY_TYPES) for t in types))):
            raise ValueError(f"--stages: {part + at + type_spec!r} is not KIND:CONTEXT_TOKENS[+CONTEXT_TOKENS...]"
                             f"[/QUESTIONS][@TYPE[+TYPE...]] with KIND easy or qa, distinct lengths, qa types "
                             f"from {list(ALL_TYPES)} and easy types from {list(EASY_TYPES)} (e.g. qa:2048, "
                             f"easy:64/2, easy:64/2@role, qa:8192+2048 or qa:2048@cross_doc+cross_doc+single_hop)")
        lengths = sorted(map(int, lengths), reverse=True)
        stages.append(Stage(kind, lengths[0], int(questions) if questions else None, tuple(lengths[1:]), types))
    return stages


def stage_records(stage: Stage, seed: int, contexts: int, questions_per_context: int = 1,
                  tokens_per_word: float = 1.3) -> list[dict]:
    """``contexts`` x ``questions_per_context`` records of the stage's kind, deterministic for ``seed``."""
    fn = easy_records if stage.kind == "easy" else generate_records
    if stage.types:
        fn = functools.partial(fn, types=stage.types)
    if stage.reasoned:  # the bridge entity a reasoned answer names comes from the records' meta
        fn = functools.partial(fn, meta=True)
    if not stage.mix:
        return fn(seed, contexts, context_tokens=stage.context_tokens, questions_per_context=questions_per_context,
                  tokens_per_word=tokens_per_word)
    # a mixed stage: every length gets about the same share of the tokens (so more short contexts),
    # each from its own seed; the first length keeps the stage's seed
    inv = [1 / n for n in stage.lengths]
    records = []
    for k, n in enumerate(stage.lengths):
        count = max(1, round(contexts * inv[k] / sum(inv)))
        records += fn(seed + k * _MIX_SEED_STRIDE, count, context_tokens=n,
                      questions_per_context=questions_per_context, tokens_per_word=tokens_per_word)
    return records


def group_records(records: list[dict]) -> list[list[dict]]:
    """Consecutive records with the same documents form one group (one context, many questions)."""
    groups: list[list[dict]] = []
    for r in records:
        if groups and groups[-1][0]["documents"] == r["documents"]:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups

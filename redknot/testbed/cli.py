"""``redknot testbed ...``: the synthetic corpus (``make-data``), the model training (``train``) and
the multi_hop diagnostic (``hops``).

Wiring (in ``redknot/cli.py``)::

    t = sub.add_parser("testbed", help="synthetic QA corpus and the testbed model")
    testbed_cli.add_arguments(t)
    t.set_defaults(func=testbed_cli.run)

``add_arguments`` returns the sub-command action, so more commands can be added next to ``make-data``
with ``set_defaults(testbed_func=...)``.
"""

from __future__ import annotations

import argparse
from collections import Counter

from ..qa.records import write_jsonl
from .easy import EASY_TYPES, easy_records
from .records import ALL_TYPES, TRAINING_TYPES, TYPES, generate_records


def add_arguments(parser: argparse.ArgumentParser):
    sub = parser.add_subparsers(dest="testbed_command", required=True)
    m = sub.add_parser("make-data", help="write synthetic multi-document QA records (JSON lines)",
                       description="Write n contexts x questions-per-context records of the synthetic corpus.")
    m.add_argument("--seed", type=int, default=0, help="corpus seed (the output is a function of it)")
    m.add_argument("--n", type=int, required=True, help="number of contexts")
    m.add_argument("--context-tokens", type=int, default=2048, help="document tokens per context (estimated)")
    m.add_argument("--out", required=True, help="JSON-lines file to write")
    m.add_argument("--questions-per-context", type=int, default=1, help="records per context sharing its documents")
    m.add_argument("--types", nargs="+", choices=ALL_TYPES, default=None,
                   help="question types, round-robin (default: all but the training-only "
                        + ", ".join(TRAINING_TYPES) + "); with --easy, " + " and/or ".join(EASY_TYPES)
                        + " (default single_hop)")
    m.add_argument("--tokens-per-word", type=float, default=1.3, help="token estimate per word")
    m.add_argument("--meta", action="store_true",
                   help="add each record's meta (question entity, relation, bridge entity, twins' answers)")
    m.add_argument("--easy", action="store_true",
                   help="curriculum stage 1: one-sentence facts, short context")
    m.set_defaults(testbed_func=make_data)
    from . import train

    t = sub.add_parser("train", help="train the testbed model (GPU; resumable, curriculum stages)",
                       description=train.__doc__.split("\n\n")[0] if train.__doc__ else None)
    train.add_arguments(t)
    t.set_defaults(testbed_func=train.run)
    from . import hops

    h = sub.add_parser("hops", help="split a model's multi_hop answers into first hop, second hop and composition",
                       description=hops.__doc__.split("\n\n")[0])
    hops.add_arguments(h)
    h.set_defaults(testbed_func=hops.run)
    return sub


def make_data(args) -> int:
    if args.easy and args.meta:
        raise ValueError("--meta describes the qa corpus's clusters; --easy records have none")
    if args.easy:
        if args.types and not set(args.types) <= set(EASY_TYPES):
            raise ValueError(f"--easy --types {' '.join(args.types)}: easy facts are {' or '.join(EASY_TYPES)}")
        records = easy_records(args.seed, args.n, args.context_tokens, args.questions_per_context,
                               tokens_per_word=args.tokens_per_word, types=tuple(args.types or ("single_hop",)))
    else:
        records = generate_records(args.seed, args.n, args.context_tokens, args.questions_per_context,
                                   types=tuple(args.types or TYPES), tokens_per_word=args.tokens_per_word,
                                   meta=args.meta)
    path = write_jsonl(records, args.out)
    words = [sum(len(d.split()) for d in r["documents"]) for r in records]
    mean_tokens = args.tokens_per_word * sum(words) / max(len(words), 1)
    counts = ", ".join(f"{k}={v}" for k, v in sorted(Counter(r["type"] for r in records).items()))
    print(f"wrote {len(records)} records ({counts or 'none'}) to {path}; "
          f"~{mean_tokens:.0f} document tokens per context (words x {args.tokens_per_word})")
    return 0


def run(args) -> int:
    return args.testbed_func(args)

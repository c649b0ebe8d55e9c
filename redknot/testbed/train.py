"""`redknot testbed train`: train the bundled testbed model on the synthetic multi-document QA corpus.

The command line of the trainer (``python -m redknot.testbed.train`` is the same command). The
model is a standard HF ``LlamaForCausalLM`` with a byte-level BPE trained on the corpus
(``architecture``, ``tokenizer``); it trains through a curriculum of stages (``stages``) on packed
rows in which every question shares its context and sees exactly the prompt redknot serves
(``packing``, ``masks``), with an answer-weighted loss (``step``) and held-out exact match per
stage (``evaluate``); ``trainer`` runs it, ``checkpoint`` writes what it leaves in ``--out``:
``tokenizer.json`` (trained once, reused), ``train_state.pt``, ``train_log.jsonl`` and ``model/``.

Running it (``--time-budget`` stops an invocation cleanly; the same command with ``--resume``
continues it, until the log says "done")::

    python -m redknot.testbed.train --out out/testbed --size small \
        --stages easy:512,qa:2048,qa:4096 --steps-per-stage 800 2000 2000 \
        --batch-tokens 131072 --eval-every 200 --time-budget 540

Data parallel over the GPUs of one host: the same command under ``torchrun --standalone
--nproc_per_node N -m redknot.testbed.train ...`` (``trainer``).
"""

from __future__ import annotations

import argparse

from .architecture import SIZES
from .records import BRIDGED_TYPES, TYPES
from .trainer import FIT_AFTER_STEPS, run

__all__ = ["add_arguments", "main", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="run directory (tokenizer, state, log, model/)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    p.add_argument("--stages", default="easy:512,qa:2048,qa:4096",
                   help="curriculum, KIND:CONTEXT_TOKENS[/QUESTIONS] in order; KIND is easy or qa; QUESTIONS "
                        "per context overrides --questions-per-context for the stage; several lengths joined "
                        "by + (qa:8192+2048) share every batch, each with an equal share of the tokens; "
                        "@TYPE+TYPE after a qa stage asks only those question types, round-robin, a repeat "
                        "weighting one (qa:2048@cross_doc+cross_doc+single_hop)")
    p.add_argument("--steps-per-stage", type=int, nargs="+", default=[1000],
                   help="optimizer steps of each stage (one value for all, or one per stage)")
    p.add_argument("--batch-tokens", type=int, default=131072, help="tokens per optimizer step (packed rows)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=100, help="warmup steps at the start of each stage")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--lm-weight", type=float, default=0.1, help="weight of the non-answer (text) loss")
    p.add_argument("--first-weight", type=float, default=1.0,
                   help="extra weight of each answer's first token, where the lookup happens")
    p.add_argument("--init-weights", default=None,
                   help="start a new run from these weights: a train_state.pt of the same architecture, or an "
                        "HF checkpoint directory (e.g. the bundled model; its tokenizer and architecture too)")
    p.add_argument("--grow-layers", type=int, default=None,
                   help="with --init-weights DIR: deepen the checkpoint to this many layers, computing the same "
                        "function at the start (new layers spread evenly, their output projections zeroed)")
    p.add_argument("--questions-per-context", type=int, default=8)
    default_reasoned = "+".join(t for t in BRIDGED_TYPES if t in TYPES)
    p.add_argument("--reasoned-answers", nargs="?", const=default_reasoned, default=None, metavar="TYPES",
                   help="qa stages: questions of these two-hop types (default " + default_reasoned + "; any of "
                        + ", ".join(BRIDGED_TYPES) + ") are "
                        "answered 'BRIDGE => ANSWER', naming the entity that links the two documents first "
                        "(scoring reads the part after '=>')")
    p.add_argument("--restate-bridge", action="store_true",
                   help="with --reasoned-answers: a reasoned answer first states its first hop as a fact, "
                        "'X was born in BRIDGE => ANSWER' (multi_hop), 'X is the founder of BRIDGE => ANSWER' "
                        "(description), so the bridge is looked up right after X's name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary (default: by --size)")
    p.add_argument("--tokenizer-contexts", type=int, default=None,
                   help="contexts of text the tokenizer trains on (default: by --size)")
    p.add_argument("--eval-every", type=int, default=250, help="held-out EM every N steps (and at stage ends)")
    p.add_argument("--eval-n", type=int, default=128, help="held-out questions per evaluation")
    p.add_argument("--advance-em", type=float, default=None,
                   help="end a stage early once its held-out EM reaches this (the step counts are then maxima)")
    p.add_argument("--export", action="store_true",
                   help="only write OUT/model from OUT/train_state.pt, without training")
    p.add_argument("--save-every", type=int, default=250, help="write OUT/train_state.pt every N steps")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--attn", choices=("auto", "sdpa", "flex"), default="auto",
                   help="flex: FlexAttention with a block mask (skips the blocks no query sees; 1.5x the tokens/s "
                        "of sdpa on an H200; training needs CUDA); sdpa: masked SDPA (computes every pair of a row); "
                        "auto: flex on CUDA, else sdpa")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    p.add_argument("--workers", type=int, default=None,
                   help="data-building processes (default: all cores but two on GPU, 0 = in-process on CPU)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: stop cleanly (state + model saved) before this much wall time has passed")
    p.add_argument("--fit-steps", action="store_true",
                   help="with --time-budget: once the last stage's step time is measured (%d steps), shorten that "
                        "stage so its schedule ends inside the budget (its count stays the most it runs); a resume "
                        "keeps the fitted count" % FIT_AFTER_STEPS)
    p.add_argument("--stop-after-steps", type=int, default=None, help="stop after N steps in this invocation")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot testbed train", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

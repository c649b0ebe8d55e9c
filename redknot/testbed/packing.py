"""Packing a stage's records into fixed-shape rows: one training step's batch.

Every context carries ``--questions-per-context`` (default 8) questions. They share the context in
one packed sequence: each QA block sits after the context, sees the context and itself but no
other block (``masks``), and its positions continue from the end of the context. That is *exactly*
the prompt redknot serves (``build_prompt(tokenizer, question, documents).token_ids`` + answer +
``</s>``) for every question, at the cost of computing the context once.

Groups are packed into rows of ``--batch-tokens`` per step (static shapes, torch.compile-friendly).
A batch is a pure function of (seed, stage, step, data-parallel shard), so a resumed run sees the
same data and DataLoader workers can build batches ahead of the training loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..reuse.prompt import build_prompt
from .answers import target_answer
from .stages import HELDOUT_SEED, Stage, group_records, stage_records

_TRAIN_SEED_BASE = 1 << 40    # training batches draw seeds far above every fixed seed
_SHARD_SHIFT = 52             # batch-seed offset of data-parallel rank r: r << 52, above every one-process seed


@dataclass
class Group:
    context: list[int]                       # chat prefix + documents: shared by every question
    blocks: list[tuple[list[int], list[int]]]  # per question: (question suffix, answer + </s>)


def tokenize_group(tokenizer, records: list[dict], reasoned=(), restate: bool = False) -> Group:
    """Tokens of one context and its questions, identical to what redknot serves.

    build_prompt tokenizes the prefix, each document and the suffix separately, so
    ``context + suffix_i == build_prompt(tokenizer, question_i, documents).token_ids``.
    """
    cp = build_prompt(tokenizer, records[0]["question"], records[0]["documents"])
    context = list(cp.prefix) + [t for chunk in cp.chunks for t in chunk]
    blocks = []
    for r in records:
        suffix = list(build_prompt(tokenizer, r["question"], []).suffix)
        answer = tokenizer.encode(target_answer(r, reasoned, restate), add_special_tokens=False)
        answer.append(tokenizer.eos_token_id)
        blocks.append((suffix, answer))
    return Group(context, blocks)


class Rows:
    """Fixed-shape rows being filled with groups; numpy so data workers build them cheaply.

    Per token: ``seg`` (group within the row, -1 = padding), ``qa`` (0 = context, k = k-th QA
    block), positions, next-token labels (-100 = none) and whether the label is an answer token.
    """

    def __init__(self, rows: int, row_len: int, pad_id: int):
        self.row_len = row_len
        self.input_ids = np.full((rows, row_len), pad_id, np.int64)
        self.position_ids = np.zeros((rows, row_len), np.int64)
        self.seg = np.full((rows, row_len), -1, np.int32)
        self.qa = np.zeros((rows, row_len), np.int32)
        self.labels = np.full((rows, row_len), -100, np.int64)
        self.answer = np.zeros((rows, row_len), bool)
        self.used = [0] * rows
        self.groups = [0] * rows
        self.questions = 0

    def free(self) -> int:
        return max(self.row_len - u for u in self.used)

    def add(self, g: Group) -> bool:
        """First-fit: the first row with room for the context and one QA block; the blocks that
        do not fit are dropped (never truncated, so no answer is cut)."""
        need = len(g.context) + sum(map(len, g.blocks[0]))
        for r, used in enumerate(self.used):
            if self.row_len - used >= need:
                self._write(r, g)
                return True
        return False

    def _write(self, r: int, g: Group) -> None:
        o, C, gid = self.used[r], len(g.context), self.groups[r]
        blocks, room = [], self.row_len - o - C
        for q, a in g.blocks:
            if len(q) + len(a) > room:
                break
            blocks.append(q + a)
            room -= len(q) + len(a)
        self.input_ids[r, o:o + C] = g.context
        self.position_ids[r, o:o + C] = np.arange(C)
        self.seg[r, o:o + C] = gid
        self.labels[r, o:o + C - 1] = g.context[1:]
        self.labels[r, o + C - 1] = blocks[0][0]   # the context's last token predicts a question start
        o += C
        for k, (blk, (q, _)) in enumerate(zip(blocks, g.blocks), start=1):
            n = len(blk)
            self.input_ids[r, o:o + n] = blk
            self.position_ids[r, o:o + n] = np.arange(C, C + n)  # every block continues the context
            self.seg[r, o:o + n] = gid
            self.qa[r, o:o + n] = k
            self.labels[r, o:o + n - 1] = blk[1:]               # </s> ends the block: no label
            self.answer[r, o + len(q) - 1:o + n - 1] = True     # labels that are answer tokens or </s>
            o += n
        self.used[r], self.groups[r] = o, gid + 1
        self.questions += len(blocks)

    def arrays(self) -> dict:
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, seg=self.seg, qa=self.qa,
                    labels=self.labels, answer=self.answer,
                    stats=np.array([sum(self.used), self.questions, sum(self.groups)], np.int64))


def batch_seed(seed: int, stage_index: int, step: int, call: int, shard: int = 0) -> int:
    # shard: the data-parallel rank; shard 0 draws what a one-process run draws
    return _TRAIN_SEED_BASE + ((seed * 64 + stage_index) * 10_000_000 + step) * 64 + call + (shard << _SHARD_SHIFT)


def build_batch(tokenizer, stage: Stage, stage_index: int, step: int, seed: int, rows: int, row_len: int,
                questions_per_context: int, tokens_per_word: float, est_group_tokens: int, shard: int = 0) -> dict:
    """The packed batch of (seed, stage, step, shard): deterministic, so a resumed run sees the same data;
    each data-parallel rank (shard) gets its own."""
    packed = Rows(rows, row_len, tokenizer.pad_token_id)
    min_need = None
    for call in range(16):
        contexts = max(1, math.ceil(packed.free() * rows / est_group_tokens * 1.2) if call else
                       math.ceil(rows * row_len / est_group_tokens * 1.1))
        records = stage_records(stage, batch_seed(seed, stage_index, step, call, shard), contexts,
                                questions_per_context, tokens_per_word)
        for grp in group_records(records):
            g = tokenize_group(tokenizer, grp, stage.reasoned, stage.restate)
            need = len(g.context) + sum(map(len, g.blocks[0]))
            min_need = need if min_need is None else min(min_need, need)
            packed.add(g)
        if packed.free() < min_need:   # no row can take even the smallest group seen
            break
    return packed.arrays()


class StageBatches(torch.utils.data.Dataset):
    """Map-style: item ``step`` is that step's batch, so DataLoader workers build batches ahead."""

    def __init__(self, tokenizer, stage: Stage, stage_index: int, seed: int, rows: int, row_len: int,
                 questions_per_context: int, tokens_per_word: float, est_group_tokens: int, steps: int,
                 shard: int = 0):
        self.kw = dict(tokenizer=tokenizer, stage=stage, stage_index=stage_index, seed=seed, rows=rows,
                       row_len=row_len, questions_per_context=questions_per_context,
                       tokens_per_word=tokens_per_word, est_group_tokens=est_group_tokens, shard=shard)
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> dict:
        return build_batch(step=step, **self.kw)


@dataclass
class StagePlan:
    """How a stage's batches are shaped; measured once on held-out records and stored in the state."""
    rows: int
    row_len: int
    tokens_per_word: float
    est_group_tokens: int
    mean_context_tokens: int = 0


def plan_stage(tokenizer, stage: Stage, stage_index: int, batch_tokens: int, questions_per_context: int,
               min_row: int = 0, probe_contexts: int = 16) -> StagePlan:
    """Calibrate the corpus' tokens-per-word estimate to this tokenizer (so ``qa:2048`` means 2048 of
    *our* tokens; calibrated with one question per context, since the documents of many asked
    questions can exceed a short budget), then pick a row length that holds the longest probed
    context with all its questions (at least ``min_row``). Masked SDPA computes every (query, key)
    pair of a row, so its rows stay short (about one context each); FlexAttention skips the blocks
    between groups, so it takes long rows (``min_row`` 2048) that pack short contexts with less padding."""
    seed = HELDOUT_SEED + 100 + stage_index  # neither a held-out nor a training seed

    def probe(st: Stage, questions: int, tpw: float) -> list[Group]:
        records = stage_records(st, seed, probe_contexts, questions, tpw)
        return [tokenize_group(tokenizer, g, st.reasoned, st.restate) for g in group_records(records)]

    tpw = 1.3  # calibrated on the longest length alone (a mixed stage's mean context is shorter)
    mean_ctx = sum(len(g.context) for g in probe(replace(stage, mix=()), 1, tpw)) / probe_contexts
    tpw = round(tpw * mean_ctx / stage.context_tokens, 3)
    groups = probe(stage, questions_per_context, tpw)
    lens = [len(g.context) + sum(len(q) + len(a) for q, a in g.blocks) for g in groups]
    row_len = _round_up(max(max(lens) * 1.05, min(min_row, batch_tokens)), 128)
    return StagePlan(rows=max(1, batch_tokens // row_len), row_len=row_len, tokens_per_word=tpw,
                     est_group_tokens=int(sum(lens) / len(lens)),
                     mean_context_tokens=int(sum(len(g.context) for g in groups) / len(groups)))


def _round_up(x: float, m: int) -> int:
    return int(math.ceil(x / m) * m)

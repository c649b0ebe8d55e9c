"""`redknot testbed train`: train the bundled testbed model on the synthetic multi-document QA corpus.

The model is a standard HF ``LlamaForCausalLM`` (GQA, RoPE, SwiGLU, RMSNorm) with a byte-level BPE
tokenizer trained on the corpus, so redknot serves it through exactly the path it serves any user's
checkpoint.

How it trains, and why
----------------------
A model trained with a plain LM loss over whole sequences at 2K learns to *copy an entity of the
right type* long before it learns key-based lookup: its exact match sits at ≈ 1/candidates, a guess
among the names of the asked-for type in the context. The trainer is built against that:

* **Curriculum.** ``easy`` stages first (key → value adjacent, one-sentence facts) so the lookup
  circuit (match the key, copy what follows it) forms where it is easy to find, then ``qa`` stages at
  growing context lengths. The number of same-type candidates is what makes lookup hard to find
  (at ``easy:512``, ~60 facts, a model copies names but does not pick the asked one within 1,500
  steps), so the curriculum starts with 4 facts and 2 questions (``easy:64/2``: one distractor per
  question) and doubles from there; ``--advance-em`` moves on once a stage is learned.
  ``easy:64/2@role`` states roles with the name last ("The mayor of V is X.", asked for V): the
  backward hop of ``mention``, which a model learns in one-sentence facts this way.
* **Dense supervision.** Every context carries ``--questions-per-context`` (default 8) questions.
  They share the context in one packed sequence: each QA block sits after the context, sees the
  context and itself but no other block (block attention mask), and its positions continue from
  the end of the context. That is *exactly* the prompt redknot serves
  (``build_prompt(tokenizer, question, documents).token_ids`` + answer + ``</s>``) for every
  question, at the cost of computing the context once.
* **Answer-weighted loss.** ``loss = mean CE(answer tokens and </s>) + first_weight · mean CE(first
  answer tokens) + lm_weight · mean CE(other tokens)``, each term averaged on its own: answers are ~1–2% of the tokens, so one plain token
  average would be dominated by the text. ``lm_weight`` (0.1) keeps the model learning the text.
  The log also shows the CE of each answer's *first* token, where the lookup happens: a model that
  only guesses an entity of the right type stays near log(candidates) there.
* **Held-out EM per stage.** Greedy decoding on a fixed held-out seed (``10_000 + stage index``,
  never a training seed; contexts drawn like the training ones), SQuAD-normalised exact match,
  logged per question type at ``--eval-every`` steps and at every stage end: a falling loss alone
  does not show lookup.

Efficiency (a run is ~10 minutes at a time on one H200, resumed across invocations): examples are
packed into fixed-shape rows of ``--batch-tokens`` per step (static shapes, torch.compile-friendly),
attention through FlexAttention on CUDA (a block mask skips the blocks between a row's contexts and
QA blocks; masked SDPA on CPU), bf16 autocast, TF32 matmuls, fused AdamW, cosine schedule with warmup
per stage, background data workers. ``--time-budget`` stops cleanly (state + model saved) before a
wall-clock limit; with ``--fit-steps`` the last stage is shortened instead, so its cosine ends
inside the budget.
Batches are a pure function of (seed, stage, step), so ``--resume`` from an exact state continues
exactly. ``qa:N`` asks the corpus for N tokens of documents, calibrated to this tokenizer; with many
questions the documents they need can pass a short budget (8 questions: ~2.6K tokens at qa:2048).

Outputs in ``--out``: ``tokenizer.json`` (trained once, reused), ``train_state.pt``,
``train_log.jsonl`` and ``model/`` (HF safetensors checkpoint + tokenizer, bf16 when fp32 would
pass 40 MB, written at every stage end and whenever a run stops; ``redknot.LLM(model=OUT/model)``).
``train_state.pt`` stays under ``--state-mb`` (60) so it stays small enough to copy elsewhere: exact
(fp32 weights, AdamW moments, RNG states) when that fits, else bf16 weights only, resumed with fresh
moments and a 50-step learning-rate re-warmup; the exact state then also goes to
``train_state_full.pt``, which a resume on the same disk prefers.

Running it (one H200; each invocation stops itself within ``--time-budget`` seconds)::

    python -m redknot.testbed.train --out out/testbed --size small \
        --stages easy:512,qa:2048,qa:4096 --steps-per-stage 800 2000 2000 \
        --batch-tokens 131072 --eval-every 200 --time-budget 540
    # then the same command with --resume until the log says "done"

Data parallel over the GPUs of one host: the same command under ``torchrun --standalone
--nproc_per_node N -m redknot.testbed.train ...``. Each rank trains on its own batches (rank r draws
shard r of every step; rank 0's are a one-process run's), DDP averages the gradients, so a step sees
N x ``--batch-tokens``; rank 0 logs, evaluates and saves, and the ranks agree on stopping at log,
eval and save steps.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import os
import random
import shutil
import signal
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..qa.answers import exact_match
from ..reuse.prompt import build_prompt
from .data import BRIDGED_TYPES, TYPES, target_answer

# Architectures. "small": ≈19.4M parameters, ≈39 MB in bf16; 8 query / 4 KV heads of dim 64 so the
# head profiler has a real GQA layout to classify. The shipped model is "small" grown to 12 layers
# (--grow-layers 12: ≈28M parameters, 56 MB in bf16, under the package's 60 MB budget). "tiny" is for CPU tests.
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=16, vocab_size=512),
    "small": dict(hidden_size=512, intermediate_size=896, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=4096),
}
ROPE_THETA = 500_000.0        # long enough wavelengths for 8K+ positions (Llama-3 uses the same for 8K)
MAX_POSITIONS = 16384         # ≥ 8192: the model is trained at 4K and evaluated beyond
SPECIALS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]  # role markers: one token each
HELDOUT_SEED = 10_000         # held-out EM of stage i uses seed HELDOUT_SEED + i
TOKENIZER_SEED = 30_000       # the tokenizer's training text: neither held-out nor a training batch
_TRAIN_SEED_BASE = 1 << 40    # training batches draw seeds far above every fixed seed
MAX_MODEL_BYTES = 40 << 20    # fp32 if the checkpoint fits in this, else bf16
STATE_FILE, LOG_FILE, MODEL_DIR, TOKENIZER_FILE = "train_state.pt", "train_log.jsonl", "model", "tokenizer.json"
FULL_STATE_FILE = "train_state_full.pt"  # the exact state, beside a lossy train_state.pt
_MIX_SEED_STRIDE = 1_000_003  # seed offset of a mixed stage's k-th context length
_SHARD_SHIFT = 52             # batch-seed offset of data-parallel rank r: r << 52, above every one-process seed
FIT_AFTER_STEPS = 20  # --fit-steps: steps timed (after the invocation's first) before the stage is fitted
REWARMUP_STEPS = 50  # after a resume without optimizer moments: Adam re-estimates them (β2 = 0.95 ≈ 20 steps)


@dataclass(frozen=True)
class Stage:
    kind: str              # "easy" or "qa"
    context_tokens: int    # the longest context of the stage (rows are sized for it)
    questions: int | None = None  # questions per context; None: --questions-per-context
    mix: tuple[int, ...] = ()     # shorter context lengths drawn into the same batches
    types: tuple[str, ...] = ()   # qa question types, round-robin (a repeat weights a type); () = all
    reasoned: tuple[str, ...] = ()  # types answered "BRIDGE => ANSWER" (data.target_answer)
    restate: bool = False  # reasoned answers restate the first hop: "X was born in BRIDGE => ANSWER"

    def __post_init__(self):
        object.__setattr__(self, "mix", tuple(self.mix))  # a saved state gives a list
        object.__setattr__(self, "types", tuple(self.types))
        object.__setattr__(self, "reasoned", tuple(self.reasoned))

    @property
    def lengths(self) -> tuple[int, ...]:
        return (self.context_tokens,) + self.mix

    def as_dict(self) -> dict:
        """For the saved state: ``mix``, ``types``, ``reasoned`` and ``restate`` only when the stage has them
        (earlier states have none)."""
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
    from .data import ALL_TYPES, EASY_TYPES

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


# ---- corpus ---------------------------------------------------------------------------------------
def stage_records(stage: Stage, seed: int, contexts: int, questions_per_context: int = 1,
                  tokens_per_word: float = 1.3) -> list[dict]:
    """``contexts`` x ``questions_per_context`` records of the stage's kind, deterministic for ``seed``."""
    from .data import easy_records, generate_records

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


# ---- tokenizer ------------------------------------------------------------------------------------
def _tokenizer_texts(seed: int, contexts: int):
    """Documents, questions and answers of both corpus kinds, plus the chat scaffolding."""
    per_kind = max(1, contexts // 2)
    for stage in (Stage("easy", 512), Stage("qa", 1024)):
        for r in stage_records(stage, seed, per_kind, questions_per_context=4):
            yield from r["documents"]
            yield r["question"] + "\n" + "\n".join(r["answers"])
    yield "<|user|>\n<|assistant|>\n\n"


def train_tokenizer(vocab_size: int, seed: int = TOKENIZER_SEED, contexts: int = 200):
    """A byte-level BPE trained on generated text, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from ..models.tokenizer import CHAT_TEMPLATE

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_tokenizer_texts(seed, contexts), trainer)
    # Plain (non-chat) encodes start with <s>, like Llama's; build_prompt's chat path adds no specials.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   chat_template=CHAT_TEMPLATE)


def load_or_train_tokenizer(out: Path, vocab_size: int, contexts: int, log=print):
    from transformers import PreTrainedTokenizerFast

    if (out / TOKENIZER_FILE).is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(out))
    t0 = time.time()
    tokenizer = train_tokenizer(vocab_size, contexts=contexts)
    tokenizer.save_pretrained(str(out))
    log(f"trained a {len(tokenizer)}-token byte-level BPE in {time.time() - t0:.1f}s -> {out / TOKENIZER_FILE}")
    return tokenizer


# ---- model ----------------------------------------------------------------------------------------
def make_config(size: str, tokenizer, attn: str = "sdpa"):
    from transformers import LlamaConfig

    shape = dict(SIZES[size])
    shape.pop("vocab_size")
    return LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, initializer_range=0.02, hidden_act="silu",
                       attention_bias=False, mlp_bias=False,
                       rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, attn_implementation=_HF_ATTN[attn], **shape)


_HF_ATTN = {"sdpa": "sdpa", "flex": "flex_attention"}


def build_model(config, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                            attn_implementation=config._attn_implementation)


def grow_depth(weights: dict, layers: int, new_layers: int) -> dict:
    """A checkpoint's weights deepened from ``layers`` to ``new_layers`` decoder layers without changing
    what it computes (block expansion, as LLaMA Pro): the new layers are spread evenly, each a copy
    of the layer before it with its attention output and FFN down projections zeroed, so it adds
    nothing to the residual stream until training moves those projections."""
    if new_layers < layers:
        raise ValueError(f"--grow-layers {new_layers}: the checkpoint already has {layers} layers")
    extra = new_layers - layers
    source, zeroed = [], []  # new layer -> the old layer it copies; the copies (outputs zeroed)
    for i in range(layers):
        source.append(i)
        for _ in range((i + 1) * extra // layers - i * extra // layers):  # copies after layer i
            source.append(i)
            zeroed.append(len(source) - 1)
    out = {k: v for k, v in weights.items() if not k.startswith("model.layers.")}
    for new, old in enumerate(source):
        prefix = f"model.layers.{old}."
        for k, v in weights.items():
            if k.startswith(prefix):
                name = k[len(prefix):]
                zero = new in zeroed and name in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
                out[f"model.layers.{new}.{name}"] = torch.zeros_like(v) if zero else v.clone()
    return out


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embeddings count once


# ---- packing --------------------------------------------------------------------------------------
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


# ---- attention mask and loss ----------------------------------------------------------------------
def visibility(seg: torch.Tensor, qa: torch.Tensor):
    """The one attention rule of a packed batch, as a FlexAttention ``mask_mod``: query q sees key k
    iff k is not after q, both are in the same group, and k is context or in q's own QA block.
    Padding (seg -1, qa 0) sees earlier padding, so no query is left with nothing to attend to."""

    def mask_mod(b, h, q, k):
        return (q >= k) & (seg[b, q] == seg[b, k]) & ((qa[b, k] == 0) | (qa[b, q] == qa[b, k]))

    return mask_mod


def dense_mask(seg: torch.Tensor, qa: torch.Tensor) -> torch.Tensor:
    """``visibility`` materialised for SDPA: [B, 1, L, L] bool, True = attend."""
    B, L = seg.shape
    i = torch.arange(L, device=seg.device)
    b = torch.arange(B, device=seg.device)[:, None, None]
    return visibility(seg, qa)(b, None, i[None, :, None], i[None, None, :])[:, None]


def block_mask(seg: torch.Tensor, qa: torch.Tensor, block: int = 128):
    """``visibility`` as a FlexAttention BlockMask, built from the rows' structure at block level:
    blocks that no query sees are skipped, blocks that every query sees entirely run without the
    mask, the rest apply ``visibility`` per pair. Sound by construction (a block holding a visible
    pair is never skipped; "full" is only claimed when every pair is visible); it may leave a
    full block marked partial, which costs time, not correctness.

    Not ``create_block_mask``: compiled (``_compile=True``) it never left ``ptxas`` on an H200
    (torch 2.11, triton 3.6); eager it evaluates every (query, key) pair, ~12 ms for 3 rows of
    8,832 tokens."""
    from torch.nn.attention.flex_attention import BlockMask

    B, L = seg.shape
    if L % block:
        raise ValueError(f"row length {L} is not a multiple of the {block}-token block")
    nb = L // block
    # padding (-1, at the end of a row) sees only padding: as one more group after the others
    s = torch.where(seg < 0, torch.iinfo(torch.int32).max, seg).view(B, nb, block)
    a = qa.view(B, nb, block)
    s_lo, s_hi, a_lo, a_hi = s.amin(-1), s.amax(-1), a.amin(-1), a.amax(-1)  # [B, nb] per block
    i = torch.arange(nb, device=seg.device)

    def pairs(lo, hi):  # per (q block, kv block): value ranges overlap; both hold one and the same value
        one = lo == hi
        return ((lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None]),
                one[:, :, None] & one[:, None, :] & (lo[:, :, None] == lo[:, None, :]))

    (group_meet, one_group), (qa_meet, one_qa) = pairs(s_lo, s_hi), pairs(a_lo, a_hi)
    # a visible pair needs a key not after the query, a shared group and a context key or a shared QA block
    meet = (i[None, :] <= i[:, None])[None] & group_meet & ((a_lo == 0)[:, None, :] | qa_meet)
    # every pair visible: all keys before all queries, one group, and context keys or one QA block
    full = (i[None, :] < i[:, None])[None] & one_group & ((a_hi == 0)[:, None, :] | one_qa)
    partial = meet & ~full

    def indices(m):  # [B, nb, nb] bool -> counts [B, 1, nb], the True columns first [B, 1, nb, nb]
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)
        return m.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(*indices(partial), *indices(full), BLOCK_SIZE=block,
                                    mask_mod=visibility(seg, qa), seq_lengths=(L, L))


def attention_mask(seg, qa, attn: str):
    return block_mask(seg, qa) if attn == "flex" else dense_mask(seg, qa)


def forward_loss(model, batch: dict, lm_weight: float, attn: str = "sdpa", first_weight: float = 0.0):
    """Answer-weighted loss: mean CE over answer labels + first_weight x mean CE over each answer's
    first token + lm_weight x mean CE over the other labels.

    Also returns, detached, the answer and text CE and the CE of each answer's *first* token: that is
    where the lookup happens (the rest is mostly copying a name once it has started), and a model that
    only guesses an entity of the right type sits at about log(candidates) there."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                attention_mask=attention_mask(batch["seg"], batch["qa"], attn), use_cache=False)
    labels, answer = batch["labels"], batch["answer"]
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                         reduction="none").view_as(labels)
    text = (labels != -100) & ~answer
    first = answer & ~F.pad(answer[:, :-1], (1, 0))
    ans_loss, lm_loss, first_loss = ((ce * m).sum() / m.sum().clamp(min=1) for m in (answer, text, first))
    loss = ans_loss + first_weight * first_loss + lm_weight * lm_loss
    return loss, ans_loss.detach(), lm_loss.detach(), first_loss.detach()


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: torch.as_tensor(v).to(device, non_blocking=True) for k, v in batch.items()}


def autocast(device: torch.device):
    # bf16 autocast on GPU (fp32 master weights and optimizer); CPU stays fp32 (bf16 matmuls are slow there).
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def make_optimizer(model, lr: float, weight_decay: float, device: torch.device):
    decay = [p for p in model.parameters() if p.ndim >= 2]     # matrices (and the tied embedding)
    no_decay = [p for p in model.parameters() if p.ndim < 2]   # RMSNorm gains
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def train_step(model, optimizer, batch: dict, lm_weight: float, attn: str, device: torch.device,
               clip: float = 1.0, first_weight: float = 0.0):
    with autocast(device):
        loss, *metrics = forward_loss(model, batch, lm_weight, attn, first_weight)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (loss.detach(), *metrics)  # loss, answer CE, text CE, first-answer-token CE


def fit_steps(step: int, steps: int, seconds_left: float, step_s: float, eval_every: int, eval_s: float,
              save_every: int = 0, save_s: float = 0.0) -> int:
    """The stage length (at most ``steps``, at least ``step + 1``) whose remaining steps, and the
    held-out evaluations and periodic saves among them, fit in ``seconds_left``, at ``step_s`` per
    step, ``eval_s`` per evaluation and ``save_s`` per save."""
    per_step = step_s + (eval_s / eval_every if eval_every else 0.0) + (save_s / save_every if save_every else 0.0)
    return max(step + 1, min(steps, step + int(max(0.0, seconds_left) / per_step)))


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float = 0.1) -> float:
    """Per stage: linear warmup, then cosine down to min_ratio. A pure function of the position, so
    resuming restores the schedule exactly."""
    warmup = min(warmup, max(1, steps // 10))
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


# ---- evaluation -----------------------------------------------------------------------------------
@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, device: torch.device,
                   batch_tokens: int = 65536) -> list[str]:
    """Greedy decoding of each prompt (left-padded batches of similar length)."""
    batches, current = [], []
    for j in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):  # the newest is the longest
        if current and (len(current) + 1) * (len(prompts[j]) + max_new_tokens) > batch_tokens:
            batches.append(current)
            current = []
        current.append(j)
    batches.append(current)
    texts: list[str] = [""] * len(prompts)
    for idx in batches:
        L = len(prompts[idx[-1]])
        ids = torch.full((len(idx), L), tokenizer.pad_token_id, dtype=torch.long)
        am = torch.zeros((len(idx), L), dtype=torch.long)
        for r, j in enumerate(idx):
            ids[r, L - len(prompts[j]):] = torch.tensor(prompts[j])
            am[r, L - len(prompts[j]):] = 1
        with autocast(device):
            out = model.generate(input_ids=ids.to(device), attention_mask=am.to(device), do_sample=False,
                                 max_new_tokens=max_new_tokens, use_cache=True, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        for r, j in enumerate(idx):
            new = out[r, L:].tolist()
            if tokenizer.eos_token_id in new:
                new = new[:new.index(tokenizer.eos_token_id)]
            texts[j] = tokenizer.decode(new, skip_special_tokens=True)
    return texts


def evaluate(model, tokenizer, records: list[dict], device: torch.device, reasoned=(), restate: bool = False) -> dict:
    """Held-out exact match (of a reasoned answer's conclusion), overall and per question type."""
    prompts = [build_prompt(tokenizer, r["question"], r["documents"]).token_ids for r in records]
    longest = max(len(tokenizer.encode(target_answer(r, reasoned, restate), add_special_tokens=False)) for r in records)
    if model.config._attn_implementation != "sdpa":
        # decoding with a KV cache is SDPA's home ground; a copy leaves the (compiled) training model as it is
        model = copy.deepcopy(model)
        model.set_attn_implementation("sdpa")
    was_training = model.training
    model.eval()
    preds = greedy_answers(model, tokenizer, prompts, min(32, longest + 2), device)
    model.train(was_training)
    hits: dict[str, list[bool]] = {}
    for r, p in zip(records, preds):
        hits.setdefault(r.get("type", "all"), []).append(exact_match(p, r["answers"]))
    total = [h for v in hits.values() for h in v]
    return {"em": sum(total) / len(total), "n": len(total),
            "em_by_type": {k: sum(v) / len(v) for k, v in sorted(hits.items())},
            "examples": [{"q": r["question"], "gold": r["answers"][0], "pred": p} for r, p in
                         list(zip(records, preds))[:3]]}


# ---- checkpointing --------------------------------------------------------------------------------
def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_state(out: Path, model, optimizer, stage: int, step: int, plans: dict, run_args: dict,
               tokens_seen: int, max_bytes: int) -> str:
    """Write ``train_state.pt``, small enough to carry between machines (``max_bytes``), and say how.

    "exact": fp32 weights + AdamW moments + RNG states when that fits (resume continues exactly).
    Otherwise "bf16": bf16 weights only (the moments would triple the size); the exact state then
    also goes to ``train_state_full.pt``, which a resume on the same disk prefers.
    """
    n = count_parameters(model)
    meta = {"version": 1, "stage": stage, "step": step, "config": model.config.to_dict(),
            # the schedule is lr_factor(step, steps, warmup) of the stage: its position is (stage, step)
            "scheduler": {"stage": stage, "step": step, "kind": "per-stage warmup + cosine"},
            "plans": {k: asdict(v) for k, v in plans.items()}, "args": run_args, "tokens_seen": tokens_seen}
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    exact = {**meta, "precision": "exact", "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "rng": rng}
    if 12 * n + (1 << 20) <= max_bytes:
        _atomic_save(exact, out / STATE_FILE)
        (out / FULL_STATE_FILE).unlink(missing_ok=True)
        return "exact"
    _atomic_save(exact, out / FULL_STATE_FILE)
    weights = {k: v.detach().to("cpu", torch.bfloat16) if v.is_floating_point() else v.cpu()
               for k, v in model.state_dict().items()}
    _atomic_save({**meta, "precision": "bf16", "model": weights}, out / STATE_FILE)
    return "bf16"


def load_state(out: Path) -> dict:
    """``train_state.pt``, or the exact ``train_state_full.pt`` written with it when there is one."""
    state = torch.load(out / STATE_FILE, map_location="cpu", weights_only=False)
    full = out / FULL_STATE_FILE
    if state["precision"] != "exact" and full.is_file():
        exact = torch.load(full, map_location="cpu", weights_only=False)
        position = lambda st: (st["stage"], st["step"], st["tokens_seen"])  # noqa: E731
        if position(exact) == position(state):
            return exact
    return state


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def save_model(out: Path, model, tokenizer, meta: dict) -> Path:
    """``out/model``: an HF checkpoint (safetensors) + tokenizer that ``redknot.LLM`` loads.
    fp32 when it fits in 40 MB (the bundled model stays small), bf16 otherwise."""
    path = out / MODEL_DIR
    dtype = torch.float32 if count_parameters(model) * 4 <= MAX_MODEL_BYTES else torch.bfloat16
    export = copy.deepcopy(model).to(device="cpu", dtype=dtype)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per save would drown the log
    export.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    (path / "training.json").write_text(json.dumps(meta, indent=1) + "\n")
    return path


# ---- logging --------------------------------------------------------------------------------------
class Log:
    """One line per event to stdout and one JSON object per event to ``train_log.jsonl``
    (``path`` None: silent, as on every data-parallel rank but the first)."""

    def __init__(self, path: Path | None):
        self.path = path

    def __call__(self, text: str, **record) -> None:
        if self.path is None:
            return
        print(text, flush=True)
        if record:
            with open(self.path, "a") as f:
                f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")


# ---- the run --------------------------------------------------------------------------------------
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
                   help="only write OUT/model from OUT/train_state.pt (e.g. a state carried back from the GPU)")
    p.add_argument("--save-every", type=int, default=250, help="write OUT/train_state.pt every N steps")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--attn", choices=("auto", "sdpa", "flex"), default="auto",
                   help="flex: FlexAttention with a block mask (skips the blocks no query sees; 1.5x the tokens/s "
                        "of sdpa on an H200; training needs CUDA); sdpa: masked SDPA (computes every pair of a row; "
                        "what trained the bundled model); auto: flex on CUDA, else sdpa")
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
    p.add_argument("--state-mb", type=float, default=60.0,
                   help="size limit of OUT/train_state.pt, so it can be carried between machines: exact (fp32 "
                        "weights + optimizer) when that fits, else bf16 weights (+ an exact train_state_full.pt)")


def _reasoned_types(spec: str | None) -> tuple[str, ...]:
    types = tuple(spec.split("+")) if spec else ()
    bad = [t for t in types if t not in BRIDGED_TYPES]
    if bad or len(set(types)) != len(types):
        raise ValueError(f"--reasoned-answers {spec}: give distinct types among {'+'.join(BRIDGED_TYPES)} "
                         f"(the types with a bridge entity)")
    return types


def _steps(args, stages: list[Stage]) -> list[int]:
    s = list(args.steps_per_stage)
    if len(s) == 1:
        s = s * len(stages)
    if len(s) != len(stages) or any(n <= 0 for n in s):
        raise ValueError(f"--steps-per-stage: give one positive count, or one per stage ({len(stages)})")
    return s


def _loader(dataset: StageBatches, start: int, workers: int, pin: bool):
    kw = dict(num_workers=workers, pin_memory=pin)
    if workers:
        kw.update(prefetch_factor=4)
    return torch.utils.data.DataLoader(dataset, batch_size=None, sampler=range(start, len(dataset)), **kw)


def _fast_math(device: torch.device) -> None:
    # TF32 for the fp32 matmuls outside autocast (the optimizer's are elementwise): the same switch
    # as torch.backends.cuda.matmul.allow_tf32 = True, through the API that newer torch prefers
    torch.set_float32_matmul_precision("high")
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = True


class Trainer:
    """One invocation of a training run: set up (new, or resumed from ``train_state.pt``), then run
    the stages until the curriculum is done or the invocation has to stop (time budget, SIGTERM,
    ``--stop-after-steps``), always leaving a state to resume from and a loadable model."""

    def __init__(self, args):
        self.t_start = time.time()
        self.args = args
        self.rank, self.world, local_rank = _distributed()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = Log(self.out / LOG_FILE if self.rank == 0 else None)  # rank 0 logs, evaluates and saves
        reasoned = _reasoned_types(args.reasoned_answers)
        if args.restate_bridge and not reasoned:
            raise ValueError("--restate-bridge restates reasoned answers: add --reasoned-answers")
        self.stages = [replace(st, reasoned=reasoned, restate=args.restate_bridge) if st.kind == "qa" else st
                       for st in parse_stages(args.stages)]
        self.steps = _steps(args, self.stages)
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.world > 1:
            self.device = torch.device("cuda", local_rank)
        _fast_math(self.device)
        if args.attn == "auto":
            args.attn = "flex" if self.device.type == "cuda" else "sdpa"
        if args.attn == "flex" and self.device.type != "cuda" and not args.export:
            raise ValueError(f"--attn flex trains on CUDA only (FlexAttention has no backward on {self.device.type}); "
                             f"use --attn sdpa or auto")
        if args.init_weights and not Path(args.init_weights).exists():
            raise ValueError(f"--init-weights {args.init_weights}: no such file or directory "
                             f"(a train_state.pt or an HF checkpoint directory)")
        state = self._read_state()
        init_dir = Path(args.init_weights) if state is None and args.init_weights else None
        init_dir = init_dir if init_dir is not None and init_dir.is_dir() else None
        if args.grow_layers and state is None and init_dir is None:
            raise SystemExit("--grow-layers deepens a checkpoint: give it with --init-weights DIR")
        size = SIZES[args.size]
        self.tokenizer = None
        if self.rank == 0:  # the run's tokenizer: one process writes it, the others then read it
            if init_dir is not None and not (self.out / TOKENIZER_FILE).is_file():  # its vocabulary, not a new one
                for f in (TOKENIZER_FILE, "tokenizer_config.json", "chat_template.jinja"):
                    if (init_dir / f).is_file():
                        shutil.copy(init_dir / f, self.out / f)
            self.tokenizer = load_or_train_tokenizer(self.out, args.vocab_size or size["vocab_size"],
                                                     args.tokenizer_contexts or (24 if args.size == "tiny" else 400),
                                                     self.log)
        if self.world > 1:
            torch.distributed.barrier()
            if self.tokenizer is None:
                from transformers import PreTrainedTokenizerFast

                self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(self.out))
        if state is not None:
            from transformers import LlamaConfig

            config = LlamaConfig.from_dict(state["config"])
            config._attn_implementation = _HF_ATTN[args.attn]
        elif init_dir is not None:  # the checkpoint's own architecture
            from transformers import LlamaConfig

            config = LlamaConfig.from_pretrained(init_dir)
            config._attn_implementation = _HF_ATTN[args.attn]
            init_layers = config.num_hidden_layers
            if args.grow_layers:
                config.num_hidden_layers = args.grow_layers
        else:
            config = make_config(args.size, self.tokenizer, args.attn)
        self.model = build_model(config, args.seed).to(self.device)
        self.optimizer = make_optimizer(self.model, args.lr, args.weight_decay, self.device)
        self.stage_i, self.step, self.tokens_seen, self.plans = 0, 0, 0, {}
        self.invocation_steps, self.rewarm_until, self._unsynced_tokens = 0, 0, 0
        if state is not None:
            self._restore(state)
        elif init_dir is not None:
            from safetensors.torch import load_file

            weights = load_file(init_dir / "model.safetensors")
            if args.grow_layers:
                weights = grow_depth(weights, init_layers, args.grow_layers)
            missing, unexpected = self.model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
            if unexpected or set(missing) - {"lm_head.weight"}:  # a tied head is not stored
                raise SystemExit(f"--init-weights {init_dir}: not this architecture "
                                 f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
            grown = f", grown from {init_layers} to {args.grow_layers} layers" if args.grow_layers else ""
            self.log(f"initialised from the checkpoint {init_dir}{grown}", event="init", path=str(init_dir),
                     layers=config.num_hidden_layers, grown_from=init_layers if args.grow_layers else None)
        elif args.init_weights:
            init = torch.load(args.init_weights, map_location="cpu", weights_only=False)
            self.model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in init["model"].items()})
            self.log(f"initialised from {args.init_weights} (stage {init['stage'] + 1}, step {init['step']})",
                     event="init", path=str(args.init_weights))
        self.fwd = self.model
        if self.world > 1:  # data parallel: each rank its own batches, gradients averaged in backward
            from torch.nn.parallel import DistributedDataParallel

            self.fwd = DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.index
                                               is not None else None)
        self.fwd = torch.compile(self.fwd) if args.compile else self.fwd
        # Building a batch is Python work (corpus generation + tokenization; ~5 s of one core for an
        # easy batch of 128K tokens), so on GPU every spare core builds batches ahead of the loop.
        self.workers = args.workers if args.workers is not None else (
            max(1, ((os.cpu_count() or 2) - 2) // self.world) if self.device.type == "cuda" else 0)
        self.last_em, self.stop_signal = None, None
        self.seconds = {"save": 30.0, "eval": 0.0, "step": 0.0}  # what a clean stop must leave time for
        self.periodic_save_s = None  # the last --save-every checkpoint's duration
        self.run_args = {"stages": [st.as_dict() for st in self.stages], "steps": self.steps, "size": args.size,
                         "seed": args.seed, "lr": args.lr, "batch_tokens": args.batch_tokens,
                         "lm_weight": args.lm_weight, "first_weight": args.first_weight,
                         "questions_per_context": args.questions_per_context, "init_weights": args.init_weights}
        if args.grow_layers:
            self.run_args["grow_layers"] = args.grow_layers
        self.fitted = dict(state["args"].get("fitted", {})) if state is not None else {}  # stage index -> steps
        for k, n in self.fitted.items():
            if int(k) < len(self.steps):
                self.steps[int(k)] = n
        self.run_args["fitted"] = self.fitted
        self._fit_clock = None  # (time, step) when this invocation's timing of the last stage began
        n, c = count_parameters(self.model), config
        self.log(f"model: {args.size}, {n / 1e6:.2f}M parameters, {c.num_hidden_layers} layers, hidden "
                 f"{c.hidden_size}, {c.num_attention_heads} query / {c.num_key_value_heads} KV heads x {c.head_dim}, "
                 f"vocab {c.vocab_size}; device {self.device}, attention {args.attn}, {self.workers} data workers"
                 f"{f' per rank, {self.world} data-parallel ranks' if self.world > 1 else ''}",
                 event="start", params=n, size=args.size, device=str(self.device), resumed=state is not None,
                 ranks=self.world)

    # -- state --
    def _read_state(self) -> dict | None:
        path = self.out / STATE_FILE
        if not path.is_file():
            if self.args.export:
                raise SystemExit(f"--export: no {path}")
            if self.args.resume:
                self.log(f"--resume: no {path} yet, starting a new run")
            return None
        if not (self.args.resume or self.args.export):
            raise SystemExit(f"{path} exists: pass --resume to continue it, or use a new --out")
        state = load_state(self.out)
        saved = [Stage(**st) for st in state["args"]["stages"]]
        if self.args.export:  # the saved run's curriculum and settings, whatever the command line says
            self.stages, self.steps = saved, list(state["args"]["steps"])
            self.saved_args = state["args"]
        if saved[:len(self.stages)] != self.stages[:len(saved)]:  # a resumed run may only add stages
            raise SystemExit(f"--stages {self.args.stages} does not match the saved run's "
                             f"{','.join(st.name for st in saved)}")
        self.args.size = state["args"]["size"]  # the architecture is the saved one
        return state

    def _restore(self, state: dict) -> None:
        self.model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state["model"].items()})
        if state["precision"] == "exact":
            self.optimizer.load_state_dict(state["optimizer"])
            restore_rng(state["rng"])
        else:  # fresh AdamW moments: ramp the learning rate up again while Adam re-estimates them
            self.rewarm_until = self.invocation_steps + REWARMUP_STEPS
        self.stage_i, self.step, self.tokens_seen = state["stage"], state["step"], state["tokens_seen"]
        self.plans = {k: StagePlan(**v) for k, v in state["plans"].items()}
        self.log(f"resumed {self.out}: stage {self.stage_i + 1}/{len(self.stages)}, step {self.step} "
                 f"({state['precision']} state{'' if state['precision'] == 'exact' else ', lr re-warmup'})",
                 event="resume", stage=self.stage_i, step=self.step, precision=state["precision"])

    def checkpoint(self, write_model: bool = False) -> None:
        if self.rank != 0:
            return
        t0 = time.time()
        save_state(self.out, self.model, self.optimizer, self.stage_i, self.step, self.plans, self.run_args,
                   self.tokens_seen, int(self.args.state_mb * 1e6))
        if write_model:
            save_model(self.out, self.model, self.tokenizer,
                       {"run": self.run_args, "stage": self.stage_i, "step": self.step,
                        "tokens_seen": self.tokens_seen, "heldout": self.last_em})
        self.seconds["save"] = max(self.seconds["save"], 2 * (time.time() - t0))
        if not write_model:
            self.periodic_save_s = time.time() - t0

    # -- the loop --
    def export(self) -> int:
        """Write ``OUT/model`` from the restored state and stop (no training step)."""
        if self.rank != 0:  # under torchrun: one writer
            return 0
        path = save_model(self.out, self.model, self.tokenizer,
                          {"run": self.saved_args, "stage": self.stage_i, "step": self.step,
                           "tokens_seen": self.tokens_seen, "heldout": self._last_logged_em()})
        self.log(f"exported stage {self.stage_i + 1} step {self.step} -> {path}")
        return 0

    def _last_logged_em(self) -> dict | None:
        path = self.out / LOG_FILE
        evals = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        evals = [e for e in evals if e.get("event") == "eval"]
        return {k: evals[-1][k] for k in ("stage_name", "step", "em", "em_by_type", "n")} if evals else None

    def run(self) -> int:
        if self.args.export:
            return self.export()
        previous = _on_sigterm(lambda *_: setattr(self, "stop_signal", "SIGTERM"))
        try:
            while self.stage_i < len(self.stages):
                if not self._train_stage():
                    return 0
        finally:
            _on_sigterm(previous)
        self.log(f"done: {len(self.stages)} stages, {self.tokens_seen:,} tokens, {time.time() - self.t_start:.0f}s; "
                 f"model in {self.out / MODEL_DIR}", event="done", tokens_seen=self.tokens_seen,
                 model=str(self.out / MODEL_DIR), heldout=self.last_em)
        return 0

    def _plan(self) -> StagePlan:
        key, stage = str(self.stage_i), self.stages[self.stage_i]
        if key not in self.plans:
            self.plans[key] = plan_stage(self.tokenizer, stage, self.stage_i, self.args.batch_tokens,
                                         self._questions(stage), 2048 if self.args.attn == "flex" else 0)
        plan = self.plans[key]
        if self.step == 0:
            self.log(f"stage {self.stage_i + 1}/{len(self.stages)} {stage.name}: {self.steps[self.stage_i]} steps, "
                     f"{plan.rows} rows of {plan.row_len} tokens, contexts ~{plan.mean_context_tokens} tokens "
                     f"(tokens/word {plan.tokens_per_word})", event="stage", stage=self.stage_i,
                     stage_name=stage.name, plan=asdict(plan))
        return plan

    def _train_stage(self) -> bool:
        """Train the current stage to its end (True) or until the invocation must stop (False)."""
        plan, stage, steps = self._plan(), self.stages[self.stage_i], self.steps[self.stage_i]
        data = StageBatches(self.tokenizer, stage, self.stage_i, self.args.seed, plan.rows, plan.row_len,
                            self._questions(stage), plan.tokens_per_word, plan.est_group_tokens, steps, self.rank)
        self._window = (time.time(), self.tokens_seen, [])  # since the last log line: start, tokens seen, losses
        evaluated = False
        args = self.args
        for batch in _loader(data, self.step, self.workers, self.device.type == "cuda"):
            step = self.step + 1
            eval_now = bool(args.eval_every and step % args.eval_every == 0)
            save_now = bool(args.save_every and step % args.save_every == 0)
            # ranks meet (losses and token counts summed, the stop agreed) only at these steps
            sync = (step % args.log_every == 0 or step == steps or self.invocation_steps == 0 or eval_now
                    or save_now)
            self._train_step(batch, plan, sync)
            evaluated = False
            steps = self._maybe_fit(steps)
            if self.step == steps:
                break
            if eval_now:
                self.heldout()
                evaluated = True
                if self._agree(self._learned()):
                    break
            if save_now:
                self.checkpoint()
            why = self._stop_reason() if self.world == 1 or sync else None
            if self.world > 1 and sync:
                why = self._agree(why)
            if why:
                return self._stop(why)
        if not evaluated:
            self.heldout()
        if self.step < steps and self.rank == 0:
            self.log(f"stage {stage.name} learned at step {self.step}/{steps}: held-out EM {self.last_em['em']:.3f} "
                     f">= --advance-em {self.args.advance_em}", event="advance", stage=self.stage_i, step=self.step)
        self.stage_i, self.step = self.stage_i + 1, 0
        self.checkpoint(write_model=True)
        why = self._agree(self._stop_reason()) if self.stage_i < len(self.stages) else None
        if why:
            return self._stop(why)
        return True

    def _train_step(self, batch: dict, plan: StagePlan, sync: bool) -> None:
        t0, args, steps = time.time(), self.args, self.steps[self.stage_i]
        for g in self.optimizer.param_groups:
            g["lr"] = args.lr * lr_factor(self.step, steps, args.warmup) * min(
                1.0, (self.invocation_steps + 1) / max(1, self.rewarm_until))
        stats = batch.pop("stats").tolist()  # real tokens, questions, contexts
        losses = train_step(self.fwd, self.optimizer, to_device(batch, self.device), args.lm_weight, args.attn,
                            self.device, first_weight=args.first_weight)
        self.step += 1
        self.invocation_steps += 1
        self._unsynced_tokens += stats[0]
        start, seen_at_start, acc = self._window
        acc.append(torch.stack(losses))
        log_now = not (self.step % args.log_every and self.step != steps and self.invocation_steps != 1)
        if self.world == 1:
            self.tokens_seen, self._unsynced_tokens = self.tokens_seen + self._unsynced_tokens, 0
            if not log_now:
                return
            loss, answer, text, first = torch.stack(acc).mean(0).tolist()  # the one host sync per log line
        else:  # every log step is a sync step: all ranks' tokens (sum) and, to log, losses (mean)
            if not sync:
                return
            vec = torch.tensor([float(self._unsynced_tokens)], device=self.device)
            if log_now:
                vec = torch.cat([vec, torch.stack(acc).mean(0).float() / self.world])
            torch.distributed.all_reduce(vec)
            tokens, *mean = vec.tolist()
            self.tokens_seen, self._unsynced_tokens = self.tokens_seen + int(round(tokens)), 0
            if not log_now:
                return
            loss, answer, text, first = mean
        tokens = self.tokens_seen - seen_at_start
        dt = time.time() - start
        fill, lr = stats[0] / (plan.rows * plan.row_len), self.optimizer.param_groups[0]["lr"]
        self.seconds["step"] = max(self.seconds["step"], 2 * (time.time() - t0))
        self.log(f"[{self.stages[self.stage_i].name}] step {self.step}/{steps} loss {loss:.4f} (answer {answer:.4f}, "
                 f"first {first:.3f}, text {text:.4f}) lr {lr:.2e} {tokens / dt:,.0f} tok/s fill {fill:.0%} "
                 f"q/step {stats[1]}", event="train", stage=self.stage_i, stage_name=self.stages[self.stage_i].name,
                 step=self.step, loss=loss, answer_loss=answer, first_token_loss=first, text_loss=text, lr=lr,
                 tokens_per_s=tokens / dt, fill=fill,
                 questions=stats[1], tokens_seen=self.tokens_seen)
        self._window = (time.time(), self.tokens_seen, [])

    def _maybe_fit(self, steps: int) -> int:
        """--fit-steps: shorten the last stage once, from its measured step time (the invocation's first
        step, which carries start-up costs, is not timed), so the cosine ends inside --time-budget."""
        a = self.args
        if (not a.fit_steps or a.time_budget is None or self.stage_i != len(self.stages) - 1
                or str(self.stage_i) in self.fitted):
            return steps
        if self._fit_clock is None:
            self._fit_clock = (time.time(), self.step)
            return steps
        t0, s0 = self._fit_clock
        if self.step - s0 < FIT_AFTER_STEPS:
            return steps
        now = time.time()
        # what the stop rule keeps in reserve (a final save, an evaluation, a slow step) is not the stage's
        left = a.time_budget - (now - self.t_start) - sum(self.seconds.values())
        eval_s = max(self.seconds["eval"], 5.0)  # before the stage's first evaluation: a guess
        save_s = self.periodic_save_s if self.periodic_save_s is not None else 5.0  # before the first: a guess
        fitted = self._agree(fit_steps(self.step, steps, left, (now - t0) / (self.step - s0), a.eval_every, eval_s,
                                       a.save_every, save_s))
        self.fitted[str(self.stage_i)] = self.steps[self.stage_i] = fitted
        self.log(f"fitted stage {self.stages[self.stage_i].name} to {fitted} steps (asked {steps}) for --time-budget "
                 f"{a.time_budget:g}s: {(now - t0) / (self.step - s0):.3f}s a step", event="fit", stage=self.stage_i,
                 step=self.step, steps=fitted, asked=steps)
        return fitted

    def _questions(self, stage: Stage) -> int:
        return stage.questions or self.args.questions_per_context

    def _learned(self) -> bool:
        return (self.args.advance_em is not None and self.last_em is not None
                and self.last_em["em"] >= self.args.advance_em)

    def _agree(self, value):
        """Rank 0's value (a bool or None-or-str stop reason) on every rank; as is in one process."""
        if self.world == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def heldout(self) -> None:
        """Held-out EM of the current stage (greedy, SQuAD-normalised), overall and per type; rank 0
        evaluates while the other ranks wait at the next step's gradient exchange."""
        if self.rank != 0:
            return
        t0, s_i = time.time(), self.stage_i
        stage = self.stages[s_i]
        # the training distribution (same questions per context), on contexts no training batch draws
        qpc = self._questions(stage)
        records = stage_records(stage, HELDOUT_SEED + s_i, math.ceil(self.args.eval_n / qpc), qpc,
                                self.plans[str(s_i)].tokens_per_word)[:self.args.eval_n]
        res = evaluate(self.model, self.tokenizer, records, self.device, stage.reasoned, stage.restate)
        self.last_em = {"stage": stage.name, **{k: res[k] for k in ("em", "em_by_type", "n")}}
        self.seconds["eval"] = time.time() - t0
        by_type = " ".join(f"{k} {v:.3f}" for k, v in res["em_by_type"].items())
        self.log(f"  eval {stage.name} step {self.step}: EM {res['em']:.3f} ({by_type}) n={res['n']} "
                 f"[{self.seconds['eval']:.1f}s] e.g. {res['examples'][0]}", event="eval", stage=s_i,
                 stage_name=stage.name, step=self.step, em=res["em"], em_by_type=res["em_by_type"], n=res["n"],
                 examples=res["examples"])

    # -- stopping --
    def _stop_reason(self) -> str | None:
        if self.stop_signal:
            return self.stop_signal
        if self.args.stop_after_steps and self.invocation_steps >= self.args.stop_after_steps:
            return "--stop-after-steps"
        if self.args.time_budget is not None:
            # the next step may bring an evaluation, and the stop a save: leave time for both
            left = self.args.time_budget - (time.time() - self.t_start)
            if left < sum(self.seconds.values()):
                return "time budget"
        return None

    def _stop(self, why: str) -> bool:
        self.checkpoint(write_model=True)
        self.log(f"stopped ({why}) at stage {self.stage_i + 1}/{len(self.stages)} step {self.step}: "
                 f"rerun with --resume", event="stop", reason=why, stage=self.stage_i, step=self.step,
                 tokens_seen=self.tokens_seen)
        return False


def _on_sigterm(handler):
    """Install a SIGTERM handler (main thread only) and return the previous one."""
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        return None if handler is None else signal.SIG_DFL


def _distributed() -> tuple[int, int, int]:
    """(rank, world size, local rank) under torchrun; (0, 1, 0) in one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, 0
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0"))


def run(args) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # data workers fork after the tokenizer is used
    rank, world, local_rank = _distributed()
    if world == 1 or torch.distributed.is_initialized():
        return Trainer(args).run()
    cuda = torch.cuda.is_available() and (args.device or "cuda").startswith("cuda")
    if cuda:
        torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    try:
        code = Trainer(args).run()
        # rank 0 may still be saving: a gloo rank that tears its group down while its peer is busy
        # can abort ("terminate called without an active exception"), so every rank leaves together
        torch.distributed.barrier()
        return code
    finally:
        torch.distributed.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot testbed train", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

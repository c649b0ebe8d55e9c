"""Held-out exact match: greedy answers to questions of a stage's own distribution.

Greedy decoding on records from a fixed held-out seed (``stages.HELDOUT_SEED + stage index``, never
a training seed; contexts drawn like the training ones), SQuAD-normalised exact match, overall and
per question type: a falling loss alone does not show lookup.
"""

from __future__ import annotations

import copy

import torch

from ..qa.answers import exact_match
from ..reuse.prompt import build_prompt
from .answers import target_answer
from .step import autocast


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

"""One optimizer step: the answer-weighted loss, AdamW, bf16 autocast.

``loss = mean CE(answer tokens and </s>) + first_weight · mean CE(first answer tokens) + lm_weight ·
mean CE(other tokens)``, each term averaged on its own: answers are ~1–2% of the tokens, so one
plain token average would be dominated by the text. ``lm_weight`` (0.1) keeps the model learning
the text. The CE of each answer's *first* token is where the lookup happens: a model that only
guesses an entity of the right type stays near log(candidates) there.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .masks import attention_mask


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

"""What a run leaves in ``--out``: the training state to resume from, and the model.

``train_state.pt`` holds the run's position and settings with fp32 weights, AdamW moments and RNG
states when that fits in ``--state-mb``, else bf16 weights only (the exact state then also goes
to ``train_state_full.pt``, which a resume on the same disk prefers); batches are a pure function
of (seed, stage, step), so ``--resume`` from an exact state continues exactly. ``model/`` is an HF
safetensors checkpoint + tokenizer (``redknot.LLM(model=OUT/model)``), fp32 when it fits in 40 MB,
else bf16, written at every stage end and whenever a run stops. A state is written to a temporary
name and renamed, so a stop mid-write leaves the previous one.
"""
from __future__ import annotations

import copy
import json
import os
import random
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from .architecture import count_parameters

MAX_MODEL_BYTES = 40 << 20    # fp32 if the checkpoint fits in this, else bf16
STATE_FILE, MODEL_DIR = "train_state.pt", "model"
FULL_STATE_FILE = "train_state_full.pt"  # the exact state, beside a lossy train_state.pt


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

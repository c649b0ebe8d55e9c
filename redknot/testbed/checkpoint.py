"""What a run leaves in ``--out``: the exact training state to resume from, and the model.

``train_state.pt`` holds fp32 weights, AdamW moments, RNG states and the run's position and
settings; batches are a pure function of (seed, stage, step), so ``--resume`` continues exactly.
``model/`` is an HF safetensors checkpoint + tokenizer (``redknot.LLM(model=OUT/model)``), fp32 when
it fits in 40 MB, else bf16, written at every stage end and whenever a run stops. The state is
written to a temporary name and renamed, so a stop mid-write leaves the previous one.
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


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_state(out: Path, model, optimizer, stage: int, step: int, plans: dict, run_args: dict,
               tokens_seen: int) -> None:
    """Write ``train_state.pt``: fp32 weights, AdamW moments and RNG states with the run's position
    and settings, everything a resume needs to continue exactly."""
    meta = {"version": 1, "stage": stage, "step": step, "config": model.config.to_dict(),
            # the schedule is lr_factor(step, steps, warmup) of the stage: its position is (stage, step)
            "scheduler": {"stage": stage, "step": step, "kind": "per-stage warmup + cosine"},
            "plans": {k: asdict(v) for k, v in plans.items()}, "args": run_args, "tokens_seen": tokens_seen}
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    _atomic_save({**meta, "precision": "exact", "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "rng": rng}, out / STATE_FILE)


def load_state(out: Path) -> dict:
    """``train_state.pt``. A state of weights alone (no optimizer moments) cannot continue its run:
    it can start a new one (``--init-weights``)."""
    path = out / STATE_FILE
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("precision", "exact") != "exact":
        raise SystemExit(f"{path} holds {state['precision']} weights without optimizer moments, so it cannot "
                         f"resume: start a new run from it with --init-weights {path}")
    return state


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def save_model(out: Path, model, tokenizer, meta: dict) -> Path:
    """``out/model``: an HF checkpoint (safetensors) + tokenizer that ``redknot.LLM`` loads.
    fp32 when it fits in 40 MB, bf16 otherwise (the bundled 28M-parameter model: 56 MB in bf16)."""
    path = out / MODEL_DIR
    dtype = torch.float32 if count_parameters(model) * 4 <= MAX_MODEL_BYTES else torch.bfloat16
    export = copy.deepcopy(model).to(device="cpu", dtype=dtype)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per save would drown the log
    export.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    (path / "training.json").write_text(json.dumps(meta, indent=1) + "\n")
    return path

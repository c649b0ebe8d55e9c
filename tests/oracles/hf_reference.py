"""What transformers gives for a prompt, and tiny checkpoints with an edited config: shared by the
model-family tests."""

import json
import shutil

import torch


def hf_last_logits_and_greedy(hf, ids: torch.Tensor, n: int = 20) -> tuple[torch.Tensor, list[int]]:
    """transformers' last-position logits for ``ids`` [1, T] and its next ``n`` greedy tokens."""
    with torch.no_grad():
        ref = hf(ids).logits[0, -1]
        gen = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
    return ref, gen


def edited_checkpoint(src, dst, edit):
    """A copy of checkpoint ``src`` at ``dst`` with ``edit(config_dict)`` applied to its config.json."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst

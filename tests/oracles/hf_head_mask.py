"""transformers under redknot's per-head visibility rule: the oracle for ``headsparse``.

An attention function registered with transformers applies each (layer, KV head)'s window and
sink from a head plan (the model's own sliding windows folded in, as the plan does) to its query
heads; with learned sinks (gpt-oss's ``s_aux``) their logit joins the softmax denominator, as in
transformers' eager gpt-oss attention. Scores and softmax run in float64.
"""

from __future__ import annotations

import torch
import transformers
from transformers import AttentionInterface

from redknot.kernels.reference import visibility_mask


def head_masked_attention(head_config, cfg):
    """The attention function (transformers' signature) for ``head_config`` on model config ``cfg``."""
    window, sink = head_config.visibility(model_windows=cfg.sliding_windows)

    def attend(module, query, key, value, attention_mask, scaling, dropout=0.0, s_aux=None, **kwargs):
        layer = module.layer_idx
        g = query.shape[1] // key.shape[1]
        tq, tk = query.shape[2], key.shape[2]
        qpos, kpos = torch.arange(tk - tq, tk), torch.arange(tk)
        masks = torch.stack([visibility_mask(qpos, kpos, int(window[layer, h]), int(sink[layer, h]))
                             for h in range(key.shape[1])])  # [Hkv, Tq, Tk]
        mask = masks.repeat_interleave(g, dim=0)[None]
        k, v = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
        scores = (query.double() @ k.double().transpose(-1, -2)) * scaling
        scores = scores.masked_fill(~mask, float("-inf"))
        if s_aux is not None:  # a sink column that takes no value
            sinks = s_aux.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            scores = torch.cat([scores, sinks], -1)
        probs = torch.softmax(scores - scores.max(-1, keepdim=True).values, -1)
        if s_aux is not None:
            probs = probs[..., :-1]
        return (probs @ v.double()).to(query.dtype).transpose(1, 2).contiguous(), None

    return attend


def hf_with_head_mask(path, head_config, cfg, load=None):
    """The checkpoint at ``path`` in transformers (float32) with ``head_masked_attention``.
    ``load(path, attn_implementation)``: how to load it (default ``AutoModelForCausalLM``)."""
    AttentionInterface.register("redknot_head_mask", head_masked_attention(head_config, cfg))
    if load is not None:
        return load(path, "redknot_head_mask")
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="redknot_head_mask").eval()

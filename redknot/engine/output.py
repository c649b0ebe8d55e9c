"""Turning sampled tokens into output: detokenisation, EOS, stop tokens and strings, length.

One place for both fronts: the engine appends every sampled token here, and the serving front asks
``streamable_text`` what it may send before the request ends (a stop string may still be forming).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""


class OutputProcessor:
    def __init__(self, eos_token_ids, max_model_len: int):
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, token: int) -> StepOutput:
        """Append a sampled token; finishes the request where the token ends it."""
        p = seq.params
        seq.token_ids.append(token)
        out = StepOutput(seq, [token])
        if not p.ignore_eos and token in self.eos_token_ids or token in p.stop_token_ids:
            seq.finish("stop")  # the stop token's text is not part of the output
            out.new_text = seq.detok.flush()
            return out
        delta = seq.detok.add(token)
        if p.stop:  # held-back text counts too: a stop string may end inside a split character
            text = seq.detok.text + seq.detok.pending()
            tail_start = max(0, len(text) - len(delta) - len(seq.detok.pending()) - _longest(p.stop) + 1)
            hits = [h for h in (text.find(x, tail_start) for x in p.stop) if h >= 0]
            if hits:
                seq.detok.text = text[:min(hits)]  # the stop string is not part of the output
                seq.finish("stop")
                return out
        if len(seq.token_ids) - seq.num_prompt >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            delta += seq.detok.flush()
            seq.finish("length")
        out.new_text = delta
        return out


def streamable_text(seq: Sequence) -> str:
    """The request's text that no later token can change: all of it once finished; before that,
    without a trailing partial character and without what could still become a stop string."""
    text = seq.text
    if seq.finished:
        return text
    keep = len(text.rstrip("\ufffd"))
    if seq.params.stop:
        keep = min(keep, len(text) - _longest(seq.params.stop) + 1)
    return text[:max(keep, 0)]


def _longest(stops) -> int:
    return max(len(x) for x in stops)

"""Async decode: the next decode step is launched from the device-side samples of the current one,
before the host reads them, so the host's bookkeeping overlaps the GPU's next forward."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import kv_loading
from .sampling import needs_each_sample
from .sequence import Sequence


class TokensToHost:
    """Sampled token ids on their way to the host. On CUDA the copy goes into pinned memory as
    soon as it is enqueued, with its own event, so reading it waits for the step that sampled
    them and not for a step launched after it (a plain ``tolist`` would wait for the stream)."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens
        self.host = self.event = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def tolist(self) -> list[int]:
        if self.event is None:
            return self.tokens.tolist()
        self.event.synchronize()
        return self.host.tolist()


@dataclass
class Ahead:
    """A decode forward launched before the host has read the tokens it continues from."""
    plan: str
    seqs: list[Sequence]
    tokens: TokensToHost  # what it samples, on the device [len(seqs)], on its way to the host


def launch_ahead(engine, plan: str, seqs: list[Sequence], tokens: torch.Tensor) -> Ahead | None:
    """Launch the decode of ``tokens`` (sampled on the device, one per sequence, not yet appended)
    at each sequence's next position; sequences the token ends by length are left out. None when
    nothing is launched (no page to spare, a step the selection must see, or the forward fails:
    the next step then computes these positions as usual and meets the error itself)."""
    picks = [i for i, s in enumerate(seqs) if len(s.token_ids) + 1 - s.num_prompt < s.params.max_tokens
             and len(s.token_ids) + 1 < engine.max_model_len]
    if not picks:
        return None
    chosen = [seqs[i] for i in picks]
    if engine.selection is not None and engine.selection.needed_by_decode(plan, chosen):
        return None  # it runs as a plain step, with the selection around its forward
    try:
        for s in chosen:
            engine.pool.ensure(s.seq_id, s.num_computed + 1)
        ids = tokens if len(picks) == len(seqs) else tokens[torch.tensor(picks, device=tokens.device)]
        logits = engine.runner.forward(plan, [s.seq_id for s in chosen], ids, [s.num_computed for s in chosen])
        nxt = TokensToHost(engine.sampler(logits, chosen))
    except Exception:
        return None
    return Ahead(plan, chosen, nxt)


def finish_ahead(engine) -> list | None:
    """The step the last one launched: its positions count as computed, the next is launched the
    same way while nothing else waits, then the host reads its samples. None when none of its
    requests still runs (the step then schedules afresh)."""
    ahead, engine._ahead = engine._ahead, None
    running = {id(s) for s in engine.scheduler.running}
    keep = [i for i, s in enumerate(ahead.seqs) if id(s) in running and s.finish_reason is None]
    if not keep:
        return None
    t0 = time.perf_counter()
    seqs = [ahead.seqs[i] for i in keep]
    tokens = ahead.tokens.tokens
    if len(keep) < len(ahead.seqs):
        tokens = tokens[torch.tensor(keep, device=engine.device)]
    for s in seqs:
        s.num_computed += 1
        engine.pool.trim(s.seq_id)
    engine.timings["steps"] += 1
    outputs: list = []
    kv_loading.poll(engine)  # a request whose documents have loaded waits: the next step admits it
    if may_look_ahead(engine, len(seqs)):
        engine._ahead = launch_ahead(engine, ahead.plan, seqs, tokens)
    ids = ahead.tokens.tolist()
    engine._take_tokens(seqs, [ids[i] for i in keep], outputs)
    engine.timings["sample"] += time.perf_counter() - t0
    return outputs


def may_look_ahead(engine, decoding: int) -> bool:
    """Async decode is on, the decode is of every running request, no waiting request could start
    at the next step (none waits, or every slot is taken), and no request needs the host to see
    each sample before the next (a grammar, logprobs)."""
    sch = engine.scheduler
    return (engine.async_decode and decoding == len(sch.running)
            and (not sch.waiting or len(sch.running) >= sch.max_num_seqs)
            and not any(needs_each_sample(s) for s in sch.running))

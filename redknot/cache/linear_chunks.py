"""Document chunks on a hybrid model's linear-attention layers: what a cached chunk keeps so that a
request can place it anywhere without running its rows again.

Per linear layer and value head, a chunk's effect on the recurrent state is affine
(``kernels/gated_delta.py``): placed after a state S_in, the chunk leaves ``A S_in + S_own``, where A
(the chunk's transition, [Dk, Dk]) and S_own (the state it reaches from zero) depend only on the
chunk's own per-token inputs (k, v after the convolution, the gates), computed once at its canonical
position as its K/V pages are. So a placed chunk's state is exact (what running the recurrence over
its cached inputs from the true incoming state gives) for 2 Dk^2 Dv FLOPs per head, whatever its
length. A head whose chunk decay exp(sum g) is at most ``threshold`` ("short memory": the incoming
state is forgotten within the chunk) starts from S_own alone: no work, an error of at most
exp(sum g) |S_in| (``ReuseOptions.linear_decay_threshold``). The convolution's state after a chunk
is its last W-1 inputs, kept as they are.

A ``ChunkCapture`` rides along a chunk-prefill forward (the model calls it per linear layer with
the batch's packed inputs) and builds one ``LinearChunk`` per chunk; ``LinearChunkStore`` keeps them
by chunk key beside the chunk cache's pages; ``compose`` places a request's pieces in order.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..kernels.gated_delta import chunk_transition, compose_state


@dataclass
class LinearChunk:
    """One chunk over every linear layer (Ll of them)."""
    transition: torch.Tensor  # [Ll, HV, Dk, Dk], float32 (float64 models: float64)
    own: torch.Tensor  # [Ll, HV, Dk, Dv]: the state the chunk reaches from zero
    log_decay: torch.Tensor  # [Ll, HV]: sum of the chunk's log decays per head
    conv_tail: torch.Tensor  # [Ll, C, n]: its last n = min(W-1, tokens) inputs to the convolution

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.transition, self.own, self.log_decay, self.conv_tail))


class ChunkCapture:
    """Called by each linear layer of a chunk-prefill forward (``linear_capture`` in the batch's
    extras) with the batch's packed rows; keeps each chunk's transition, own state, decay and conv
    tail. ``spans``: (first packed row, rows) of each chunk's own tokens (the rows of its prompt
    prefix, computed in the same sequence, are not the chunk's)."""

    def __init__(self, spans: list[tuple[int, int]], num_layers: int, conv_kernel: int):
        self.spans, self.num_layers, self.hist = spans, num_layers, conv_kernel - 1
        self._layers: dict[int, list[tuple]] = {}

    def __call__(self, layer: int, mixed: torch.Tensor, k, v, g, beta) -> None:
        """``mixed`` [T, C]: the convolution's inputs; k [T, H, Dk], v [T, HV, Dv] its outputs; g,
        beta [T, HV]."""
        out = []
        for a, n in self.spans:
            rows = slice(a, a + n)
            A, own, log_decay = chunk_transition(k[rows], v[rows], g[rows], beta[rows])
            out.append((A, own, log_decay, mixed[a + max(0, n - self.hist):a + n].t()))
        self._layers[layer] = out

    def chunks(self) -> list[LinearChunk]:
        if sorted(self._layers) != list(range(self.num_layers)):
            raise RuntimeError(f"a chunk prefill captured linear layers {sorted(self._layers)}, not all "
                               f"{self.num_layers} (the forward did not run the capture)")
        per_layer = [self._layers[i] for i in range(self.num_layers)]
        return [LinearChunk(*(torch.stack([layer[c][j] for layer in per_layer]) for j in range(4)))
                for c in range(len(self.spans))]


class LinearChunkStore:
    """``LinearChunk`` entries by chunk key, least recently used dropped first beyond ``max_bytes``.
    An entry whose chunk pages remain cached but which was dropped here makes that chunk count as
    missing: its prefill runs again (``engine/documents.py``)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, LinearChunk] = OrderedDict()
        self.nbytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> LinearChunk:
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: str, entry: LinearChunk) -> None:
        if key in self._entries:
            self.nbytes -= self._entries.pop(key).nbytes
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes and len(self._entries) > 1:
            self.nbytes -= self._entries.popitem(last=False)[1].nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


@dataclass
class Composed:
    conv: torch.Tensor  # [Ll, C, W-1]: the convolution's state after the last piece
    recurrent: torch.Tensor  # [Ll, HV, Dk, Dv]
    composed: list[int]  # per linear layer: (piece, head) transitions applied
    dropped: list[int]  # per linear layer: (piece, head) carried states dropped (short memory)
    exact: list[int]  # per linear layer: value heads exact over every piece


def compose(pieces: list[LinearChunk], threshold: float, conv_kernel: int) -> Composed:
    """The linear layers' state after ``pieces`` (the prompt prefix and the chunks, in prompt order)
    placed one after another from a zero state. The first piece starts from zero: its own state, no
    work."""
    first = pieces[0]
    state = first.own
    L, hv = first.log_decay.shape
    composed = torch.zeros(L, dtype=torch.long, device=state.device)
    exact = torch.ones(L, hv, dtype=torch.bool, device=state.device)
    for p in pieces[1:]:
        state, applied = compose_state(state, p.transition, p.own, p.log_decay, threshold)
        composed += applied.sum(1)
        exact &= applied
    hist = conv_kernel - 1
    tail = torch.cat([p.conv_tail for p in pieces], dim=-1)[..., -hist:] if hist else first.conv_tail[..., :0]
    if tail.shape[-1] < hist:  # fewer prompt tokens than the convolution's history: zeros before them
        tail = torch.nn.functional.pad(tail, (hist - tail.shape[-1], 0))
    composed = composed.tolist()
    steps = (len(pieces) - 1) * hv
    return Composed(tail, state, composed, [steps - c for c in composed], exact.sum(1).tolist())

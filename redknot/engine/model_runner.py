"""One forward step over a packed batch, eager or replayed from a CUDA graph.

The host describes the batch (token ids, positions, lengths, table slots) in one pinned buffer
and copies it to the device in one transfer; block tables are gathered on the device from the
pool's persistent table by slot, so nothing is rebuilt per step. A decode-only batch (one new
token per sequence) replays a CUDA graph captured for the smallest batch bucket that holds it:
one launch for the whole model instead of hundreds.
"""

from __future__ import annotations

import numpy as np
import torch

from ..pd.device import device_lock

from ..cache import PagePool
from ..forward_batch import ForwardBatch, ForwardMode
from ..models.adapter import ModelAdapter
from .attention import attention_backend

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ModelRunner:
    def __init__(self, adapter: ModelAdapter, pool: PagePool, plans: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 max_num_seqs: int, cuda_graphs: bool = True, kernel: str = "auto"):
        """``adapter``: the model's (EXECUTE); ``plans``: head plan name -> (window, sink), int32
        [L, Hkv] on the pool's device."""
        self.adapter, self.pool, self.plans = adapter, pool, plans
        self.device = pool.device
        cfg = adapter.config
        self.attn = attention_backend(pool, cfg.attention_scale, kernel)
        adapter.set_backend(self.attn)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.graph_sizes = [b for b in GRAPH_BATCH_SIZES if b <= max(max_num_seqs, 1)]
        self._pin = self.device.type == "cuda"
        # Decode graphs' static inputs: rows ids, positions, seq_lens, slots; padding rows use slot 0
        # (an all -1 table: nothing stored, nothing read) at position 0.
        n = self.graph_sizes[-1] if self.cuda_graphs else 0
        self._static = torch.zeros(4, n, dtype=torch.int64, device=self.device)
        self._static_cu = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        self._graphs: dict[tuple[str, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = None
        self.selective_plans: set[str] = set()  # plans whose batches read the pool's selected sets
        # Plans whose decode graphs also write every layer's queries into ``_q_record`` (budget
        # checks read a step's queries), allocated when the first such graph is captured.
        self.recording_plans: set[str] = set()
        self._q_record: torch.Tensor | None = None
        self.last_graph: torch.cuda.CUDAGraph | None = None
        self.graph_events: list | None = None  # set to a list to collect (start, end) events of replays
        # Two pinned staging buffers used in turn; a buffer is rewritten only once its last copy
        # to the device is done (its event), so the host never races an in-flight transfer.
        self._staging: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._turn = 0

    # ------------------------------------------------------------------ host -> device

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        """One host-to-device copy of an int64 array (through pinned staging on CUDA)."""
        t = torch.from_numpy(arr)
        if not self._pin:
            return t.to(self.device)
        n = t.numel()
        if len(self._staging) < 2 or self._staging[self._turn][0].numel() < n:
            size = max(n, 1 << 16)
            buf = (torch.empty(size, dtype=torch.int64, pin_memory=True), None)
            if len(self._staging) < 2:
                self._staging.append(buf)
                self._turn = len(self._staging) - 1
            else:
                self._staging[self._turn] = buf
        buf, event = self._staging[self._turn]
        if event is not None:
            event.synchronize()
        host = buf[:n].view(t.shape)
        host.copy_(t)
        out = host.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._staging[self._turn] = (buf, event)
        self._turn ^= 1
        return out

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(self, plan: str, seq_ids: list[int], token_ids: list[list[int]] | torch.Tensor,
                starts: list[int], capture_rows: torch.Tensor | None = None,
                captured: list | None = None, extras: dict | None = None) -> torch.Tensor:
        """Compute sequences' next tokens: ``token_ids[b]`` at positions ``starts[b]...``; their
        pages must already be ensured. ``token_ids`` may also be one token per sequence as a
        device tensor [B] (a decode step fed by the previous step's samples, not yet seen by the
        host). ``capture_rows``: packed rows whose queries each layer writes into ``captured[layer]``
        (head selection). ``extras``: model-specific batch metadata (a hybrid's state snapshots;
        never on a decode-only step). Returns float32 logits [B, V] of each sequence's last token."""
        on_device = isinstance(token_ids, torch.Tensor)
        q_lens = [1] * len(seq_ids) if on_device else [len(t) for t in token_ids]
        seq_lens = [s + n for s, n in zip(starts, q_lens)]
        slots = [self.pool.slot(i) for i in seq_ids]
        self.pool.sync_device_tables()
        if (self.cuda_graphs and max(q_lens) == 1 and len(seq_ids) <= self.graph_sizes[-1] and not extras
                and (capture_rows is None or plan in self.recording_plans)):  # other graphs do not record queries
            logits = self._replay(plan, token_ids if on_device else [t[0] for t in token_ids], starts, seq_lens, slots)
            if capture_rows is not None:
                captured[:] = self._q_record[:, :len(seq_ids)].index_select(1, capture_rows).unbind(0)
            return logits
        pages = -(-max(seq_lens) // self.pool.page_size)
        total = sum(q_lens)
        B = len(seq_ids)
        buf = np.empty(2 * total + 2 * B + B + 1, dtype=np.int64)
        buf[:total] = 0 if on_device else np.concatenate([np.asarray(t, dtype=np.int64) for t in token_ids])
        buf[total:2 * total] = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, q_lens)])
        buf[2 * total:2 * total + B] = seq_lens
        buf[2 * total + B:2 * total + 2 * B] = slots
        buf[2 * total + 2 * B:] = np.concatenate([[0], np.cumsum(q_lens)])
        dev = self._to_device(buf)
        ids, positions = (token_ids if on_device else dev[:total]), dev[total:2 * total]
        seq_lens_t = dev[2 * total:2 * total + B].to(torch.int32)
        slots_t = dev[2 * total + B:2 * total + 2 * B]
        cu = dev[2 * total + 2 * B:].to(torch.int32)
        batch = self._batch(plan, q_lens, seq_lens, seq_ids, cu, seq_lens_t, positions, slots_t, pages)
        if capture_rows is not None:
            batch.capture_rows, batch.captured = capture_rows, captured
        if extras:
            batch.extras.update(extras)
        self.attn.init_batch(batch)
        hidden = self.adapter.execute(ids, positions, batch)
        return self.adapter.logits(hidden[cu[1:].long() - 1])

    @torch.inference_mode()
    def recover(self, seq_ids: list[int], token_ids: list[list[int]], rows) -> torch.Tensor:
        """Prefill whole prompts under a recovery's row policy (``recovery_batch.RecoveryRows``):
        each layer computes the rows the policy picks, at their positions, and the rest of every
        prompt keeps the K/V already in its pages (relocated chunks). Every position's pages must
        be ensured. Returns float32 logits [B, V] of each prompt's last position."""
        self.pool.sync_device_tables()
        lens = [len(t) for t in token_ids]
        positions = rows.positions()
        ids = torch.cat([torch.tensor(t, dtype=torch.int64, device=self.device)[r.cur]
                         for t, r in zip(token_ids, rows.requests)])
        slots = torch.tensor([self.pool.slot(i) for i in seq_ids], device=self.device)
        pages = -(-max(lens) // self.pool.page_size)
        q_lens = rows.q_lens()
        batch = ForwardBatch(ForwardMode.RECOVER, seq_ids=list(seq_ids), q_lens=q_lens, seq_lens=lens,
                             max_q_len=max(q_lens),
                             cu_seqlens_q=torch.tensor([0] + q_lens, device=self.device).cumsum(0).to(torch.int32),
                             seq_lens_t=torch.tensor(lens, dtype=torch.int32, device=self.device), positions=positions,
                             block_tables=self.pool.device_tables[:, :, :, :pages].index_select(1, slots),
                             window=rows.window, sink=rows.sink)
        rows.batch = batch  # rows that stop at a layer shrink the batch's packed rows
        hidden = self.adapter.execute(ids, positions, batch, rows)
        return self.adapter.logits(hidden[rows.last_rows()])

    def _batch(self, plan, q_lens, seq_lens, seq_ids, cu, seq_lens_t, positions, slots_t, pages) -> ForwardBatch:
        """The forward's metadata; block tables are the slots' rows of the pool's device table, cut
        to ``pages`` logical pages (enough for the longest sequence)."""
        window, sink = self.plans[plan]
        tables = self.pool.device_tables[:, :, :, :pages].index_select(1, slots_t)
        sel_pos, sel_lens = self.pool.selection_tables(slots_t) if plan in self.selective_plans else (None, None)
        mode = ForwardMode.EXTEND if max(q_lens) > 1 else ForwardMode.DECODE
        return ForwardBatch(mode, seq_ids=list(seq_ids), q_lens=list(q_lens), seq_lens=list(seq_lens),
                            max_q_len=max(q_lens), cu_seqlens_q=cu, seq_lens_t=seq_lens_t, positions=positions,
                            block_tables=tables, window=window, sink=sink, sel_pos=sel_pos, sel_lens=sel_lens,
                            state_slots=slots_t)

    # ------------------------------------------------------------------ CUDA graphs

    def _bucket(self, n: int) -> int:
        return next(b for b in self.graph_sizes if b >= n)

    def _page_bucket(self, max_len: int) -> int:
        """Table width a decode graph is captured for: the next power of two of the pages the
        longest sequence needs (graphs are reused while contexts grow within a bucket)."""
        need = -(-max_len // self.pool.page_size)
        return min(max(16, 1 << (need - 1).bit_length()), self.pool.device_tables.shape[3])

    def _replay(self, plan, ids, positions, seq_lens, slots) -> torch.Tensor:
        """``ids``: host ints, or a device tensor [B] (copied into the graph's input on the device)."""
        B = len(ids)
        size = self._bucket(B)
        host = np.zeros((4, size), dtype=np.int64)
        host[2, B:] = 1  # padding rows: length 1 at position 0 in slot 0
        on_device = isinstance(ids, torch.Tensor)
        host[1, :B], host[2, :B], host[3, :B] = positions, seq_lens, slots
        if not on_device:
            host[0, :B] = ids
        self._static[:, :size].copy_(self._to_device(host))
        if on_device:
            self._static[0, :B].copy_(ids)
        key = (plan, size, self._page_bucket(max(seq_lens)))
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        graph, logits = self._graphs[key]
        if self.graph_events is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            self.graph_events.append((start, end))
        else:
            graph.replay()
        self.last_graph = graph
        return logits[:B]

    def drop_graphs(self, plans) -> None:
        """Forget the decode graphs captured for ``plans``: a graph keeps the addresses of the
        plan's window/sink tensors and of the pool's selection table it read at capture, so a plan
        registered again (or a reallocated table) needs fresh ones."""
        self._graphs = {k: v for k, v in self._graphs.items() if k[0] not in plans}

    def capture(self, max_len: int) -> int:
        """Capture every decode graph a batch of contexts up to ``max_len`` tokens can need (each
        plan, batch bucket and table-width bucket), as vLLM does at start-up, so serving never
        pauses to capture. Returns how many were captured."""
        if not self.cuda_graphs:
            return 0
        top = self._page_bucket(max_len)
        widths = sorted({min(top, 1 << k) for k in range(4, top.bit_length() + 1)} | {top})
        n = 0
        for plan in self.plans:
            for size in self.graph_sizes:
                for pages in widths:
                    if (plan, size, pages) not in self._graphs:
                        self._graphs[(plan, size, pages)] = self._capture(plan, size, pages)
                        n += 1
        return n

    def _graph_body(self, plan: str, size: int, pages: int) -> torch.Tensor:
        s = self._static[:, :size]
        batch = self._batch(plan, [1] * size, [1] * size, [0] * size, self._static_cu[:size + 1],
                            s[2].to(torch.int32), s[1], s[3], pages)
        batch.seq_lens = None  # host lengths are not known at capture: the graph must not read them
        if plan in self.recording_plans:
            if self._q_record is None:
                cfg = self.adapter.config
                self._q_record = torch.zeros(cfg.num_hidden_layers, self.graph_sizes[-1], cfg.num_attention_heads,
                                             cfg.head_dim, dtype=self.pool.dtype,
                                             device=self.device)
            batch.q_record = self._q_record[:, :size]
        self.attn.init_batch(batch)
        return self.adapter.logits(self.adapter.execute(s[0], s[1], batch))

    def _capture(self, plan: str, size: int, pages: int):
        saved = self._static[:, :size].clone()
        self._static[:, :size] = 0
        self._static[2, :size] = 1  # every row a padding row while warming up and capturing
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._graph_body(plan, size, pages)  # compiles kernels and fills caches outside the capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with device_lock, torch.cuda.graph(graph, pool=self._graph_pool):  # no KV transfer thread's copies meanwhile
            logits = self._graph_body(plan, size, pages)
        self._graph_pool = graph.pool()
        self._static[:, :size] = saved
        return graph, logits

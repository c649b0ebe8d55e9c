"""Prefix caching for hybrid models: cached K/V pages plus the linear layers' state at a page boundary.

A hybrid model's linear-attention layers carry a state over the whole prompt, so a cached prefix
of full pages can serve a request only together with that state at the prefix's end. When a prompt
chunk's forward crosses a page boundary, the model also writes its state at the last boundary it
crosses (within the prompt) into a snapshot row of the ``LinearStatePool``, keyed by that prefix's
block key; ``match`` returns the longest cached prefix that ends at a snapshot, and ``resume``
copies the snapshot into the request's slot, from where its prefill continues.

Snapshots are few (each is a whole state: 74 MiB a sequence on Qwen3-Next-80B) and taken least
recently used first when none is free; a snapshot whose blocks were evicted simply never matches.
"""

from __future__ import annotations

from collections import OrderedDict

from .prefix_cache import PrefixCache


class StatePrefixCache(PrefixCache):
    def __init__(self, pool, fingerprint: str, events=None):
        super().__init__(pool, fingerprint, events)
        self.state = pool.linear_state
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # block key -> snapshot row, LRU first
        self._free = list(self.state.snapshot_rows)

    def snapshot_requests(self, plan: str, items, extra: int = 0) -> tuple[dict | None, list]:
        """For each (request, new tokens) of a forward: the row offset of the last page boundary its
        prompt chunk crosses whose prefix has no snapshot yet (-1: none) and the snapshot row the
        model writes there; ``extra`` more sequences of the batch take none. Returns (the batch's
        ``linear_snapshot`` extras, or None when none is wanted; the pending (key, row) pairs)."""
        ps = self.pool.page_size
        offsets, rows, pending = [], [], []
        for s, n in items:
            end = (min(s.num_computed + n, s.num_prompt) // ps) * ps
            row = None
            if n > 1 and s.exact_kv and end > s.num_computed:
                key = self._keys(plan, s.token_ids[:end], s.cache_salt)[-1]
                if key not in self._snapshots and not any(k == key for k, _ in pending):
                    row = self._take()
            if row is None:
                offsets.append(-1)
                rows.append(0)  # the padding slot: written, never read
            else:
                offsets.append(end - s.num_computed)
                rows.append(row)
                pending.append((key, row))
        if not pending:
            return None, []
        return {"linear_snapshot": (offsets + [-1] * extra, rows + [0] * extra)}, pending

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._snapshots:
            return self._snapshots.popitem(last=False)[1]
        return None

    def commit(self, pending: list, ok: bool = True) -> None:
        """The forward that wrote ``pending`` snapshots ran (``ok``), or failed: their rows go back."""
        for key, row in pending:
            if ok:
                self._snapshots[key] = row
            else:
                self._free.append(row)

    def match(self, plan: str, token_ids, limit: int, salt: str | None = None):
        """The longest cached prefix of at most ``limit`` tokens that ends where a snapshot was taken
        (``PrefixCache.match`` for the pages)."""
        ps = self.pool.page_size
        keys = self._keys(plan, token_ids[:(limit // ps) * ps], salt)
        queries, hits = self.queries, self.hits
        n, table = 0, None
        for m in range(len(keys), 0, -1):
            if keys[m - 1] not in self._snapshots:
                continue
            n, table = super().match(plan, token_ids, m * ps, salt)
            if n == m * ps:
                self._snapshots.move_to_end(keys[m - 1])
                break
            n, table = 0, None
        self.queries, self.hits = queries + len(token_ids), hits + n
        return n, table

    def resume(self, plan: str, token_ids, n: int, salt: str | None, slot: int) -> None:
        """Copy the snapshot at the end of the matched ``n``-token prefix into the sequence's slot."""
        key = self._keys(plan, token_ids[:n], salt)[-1]
        self.state.copy(self._snapshots[key], slot)

    def clear(self) -> None:
        super().clear()
        self._free.extend(self._snapshots.values())
        self._snapshots.clear()

"""The pages one holder (a cache) references, counted per page as it takes and drops them.

Asking which pages a cache holds then costs one pass over a pool-sized array, whatever the number
of its entries: walking thousands of entries and sorting their ids took seconds on a full GPU pool,
under the engine's lock, on every stats call (``/metrics``)."""

from __future__ import annotations

import numpy as np


class PageRefs:
    def __init__(self, num_pages: int):
        self.count = np.zeros(num_pages, dtype=np.int32)

    @staticmethod
    def _valid(pages) -> np.ndarray:
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        return pages[pages >= 0]

    def add(self, pages) -> None:
        """One more reference on each page id (>= 0 entries; -1 marks no page)."""
        np.add.at(self.count, self._valid(pages), 1)

    def remove(self, pages) -> None:
        np.subtract.at(self.count, self._valid(pages), 1)

    def mask(self) -> np.ndarray:
        """bool per pool page: referenced at least once."""
        return self.count > 0

    def ids(self) -> np.ndarray:
        """The referenced page ids, sorted, once each (int32)."""
        return np.flatnonzero(self.count).astype(np.int32)

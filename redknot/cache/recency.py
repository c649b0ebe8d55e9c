"""One clock of last use for every cache over the page pool, so eviction can take the least recently
used entry of all of them (a hot prompt prefix outlives a cold document, and the other way round)."""

from __future__ import annotations

import itertools

_clock = itertools.count()


def tick() -> int:
    """A use stamp, larger than every earlier one (in any cache)."""
    return next(_clock)

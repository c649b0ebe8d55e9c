"""KV cache: the per-(layer, KV head) page pool (docs/segpaged.md)."""

from redknot.cache.pool import PagePool, PagesNeeded, PoolExhausted

__all__ = ["PagePool", "PagesNeeded", "PoolExhausted"]

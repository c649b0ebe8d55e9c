"""KV caches: the per-(layer, KV head) page pool (docs/segpaged.md), chunk keys and dense chunk KV."""

from .chunk_kv import ChunkKV, chunk_key
from .pool import PagePool, PagesNeeded, PoolExhausted

__all__ = ["ChunkKV", "PagePool", "PagesNeeded", "PoolExhausted", "chunk_key"]

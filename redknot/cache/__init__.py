"""KV caches: the per-(layer, KV head) page pool (docs/segpaged.md) and the chunk KV store."""

from .chunk_store import ChunkKV, ChunkStore, chunk_key
from .pool import PagePool, PagesNeeded, PoolExhausted

__all__ = ["ChunkKV", "ChunkStore", "PagePool", "PagesNeeded", "PoolExhausted", "chunk_key"]

"""Tiers for document KV under the GPU page pool: CPU, disk and Redis, one entry format and key."""

from .entry import CorruptEntry, KVEntry, Layout, plan_digest, tier_key
from .hierarchy import KVOffloadConfig, TierStack

__all__ = ["CorruptEntry", "KVEntry", "KVOffloadConfig", "Layout", "TierStack", "plan_digest", "tier_key"]

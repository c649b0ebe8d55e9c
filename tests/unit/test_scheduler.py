"""The scheduler alone: admission, commitments, preemption and the limits fronts read, with no model."""

import numpy as np
import pytest

from redknot.cache import PagePool
from redknot.config import GLOBAL_WINDOW
from redknot.engine.engine_config import EngineConfig
from redknot.engine.sampling import SamplingParams
from redknot.engine.scheduler import DocumentNeeds, RequestTooLarge, Scheduler
from redknot.engine.sequence import ReuseState, Sequence, SequenceStatus

L, H, PS = 2, 2, 16


class FakeCache:
    """A cache holding ``pages`` pages, last used at ``used``, that it gives back (to the pool) when evicted."""

    def __init__(self, pool, pages, used=0):
        self.pool, self.held = pool, pool.allocate(pages) if pages else np.zeros(0, np.int32)
        self.used = used

    def oldest_use(self, keep=()):
        return self.used if self.held.size else None

    def num_pages(self):
        return int(self.held.size)

    def evict_one(self, keep=()):
        n = min(1, self.held.size)
        self.pool.release(self.held[:n])
        self.held = self.held[n:]
        return int(n)


def make(num_pages=200, cached=0, **cfg):
    window = np.array([[GLOBAL_WINDOW, 32]] * L)
    pool = PagePool(num_pages, PS, 8, window=window, sink=np.full((L, H), 4))
    pool.add_plan("dense", np.full((L, H), GLOBAL_WINDOW), np.zeros((L, H)))
    pool.add_plan("headsparse", window, np.full((L, H), 4))
    cfg = EngineConfig(page_size=PS, max_num_batched_tokens=64, **cfg)
    cache = FakeCache(pool, cached)
    return Scheduler(pool, cfg, max_model_len=1024, caches=(cache,)), pool, cache


def request(n, max_tokens=8, method="dense", plan="dense"):
    seq = Sequence(list(range(n)), SamplingParams(max_tokens=max_tokens), method=method)
    seq.plan = plan
    return seq


def admit_all(sch, budget=64):
    started = []
    while (adm := sch.next_admission(budget, 0)) is not None:
        sch.start(adm)
        started.append(adm.seq)
    return started


def test_admission_is_fifo_and_commits_each_requests_full_length():
    sch, pool, _ = make(num_pages=60)
    a, b, c = request(100), request(100), request(10)
    for s in (a, b, c):
        sch.add(s)
    started = admit_all(sch)
    # a and b each commit their full length: c, small as it is, waits behind b (FIFO, nobody overtakes)
    assert started == [a] and sch.waiting[0] is b and c in sch.waiting
    assert sch.committed == sch.steady_pages(a) and a.status is SequenceStatus.RUNNING
    sch.free(a)
    assert sch.committed == 0 and pool.num_free_pages == pool.num_pages
    assert admit_all(sch) == [b, c]


def test_slots_and_token_budget_bound_admission():
    sch, _, _ = make(max_num_seqs=2)
    for _ in range(3):
        sch.add(request(10))
    assert len(admit_all(sch)) == 2 and len(sch.waiting) == 1
    sch2, _, _ = make()
    sch2.add(request(10))
    assert sch2.next_admission(0, 0) is None  # no budget left this step


def test_admission_evicts_cached_pages_only_when_it_must():
    sch, pool, cache = make(num_pages=60, cached=50)
    seq = request(60)
    sch.add(seq)
    need = sch.admission_pages(seq, 1 << 20)
    assert need > pool.num_free_pages  # it cannot start without the cache's pages
    adm = sch.next_admission(1 << 20, 0)
    assert adm is not None and cache.num_pages() == 50 - (need - 10)  # evicted exactly the shortfall


def test_documents_a_request_needs_count_and_their_cached_chunks_stay():
    sch, pool, cache = make(num_pages=100, cached=40)
    seq = request(40, method="full_reuse")
    seq.reuse = ReuseState(None)
    sch.add(seq)
    needs = DocumentNeeds(frozenset({"k"}), kept_pages=40, missing_pages=50)
    # free 60 + evictable 40 - kept 40 = 60 < its own pages + 50 for the missing chunks' prefills
    assert sch.admission_pages(seq) + 50 > 60
    assert sch.next_admission(1 << 20, 0, lambda s: needs) is None
    assert cache.num_pages() == 40  # nothing evicted for a request that cannot start anyway


def test_make_room_preempts_the_newest_other_request_and_requeues_it_first():
    sch, pool, _ = make(num_pages=70, reserve_full_length=False)
    a, b, c = (request(100, max_tokens=400) for _ in range(3))
    for s in (a, b, c):
        sch.add(s)
    assert admit_all(sch) == [a, b, c]  # each on its first chunk's pages (optimistic admission)
    batch = sch.make_room([(a, 100), (b, 100), (c, 100)], sch.preempt)
    # c's pages do not fit after a's and b's: b, the newest request other than c, goes back first
    assert [s for s, _ in batch] == [a, c] and list(sch.waiting) == [b] and sch.running == [a, c]
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1 and sch.num_preemptions == 1
    assert b.seq_id not in pool and b.num_computed == 0


def test_check_fits_names_the_limit_and_max_new_tokens_is_its_edge():
    sch, _, _ = make(num_pages=80)
    too_long = request(1000, max_tokens=100)
    with pytest.raises(RequestTooLarge, match="max_model_len"):
        sch.check_fits(too_long)
    seq = request(100, max_tokens=1)
    most = sch.max_new_tokens(seq)
    assert 0 < most < 1024 - 100 and seq.params.max_tokens == 1  # the request's own value stays
    seq.params.max_tokens = most
    sch.check_fits(seq)  # the default a front gives it is admitted by the same arithmetic
    seq.params.max_tokens = most + 1
    with pytest.raises(RequestTooLarge, match="KV pages"):
        sch.check_fits(seq)


def test_a_sparse_plan_fits_longer_contexts_than_dense():
    sch, _, _ = make(num_pages=80)
    dense, sparse = request(100, plan="dense"), request(100, method="headsparse", plan="headsparse")
    assert sch.max_new_tokens(sparse) > sch.max_new_tokens(dense)


def test_stuck_only_when_nothing_runs_and_the_caches_are_empty():
    sch, _, cache = make(cached=10)
    assert not sch.stuck() and cache.num_pages() == 0  # it gave the cached pages back first
    assert sch.stuck()
    sch.add(request(10))
    admit_all(sch)
    assert not sch.stuck()


def test_reclaim_takes_the_least_recently_used_cache_first():
    sch, pool, _ = make(num_pages=100)
    hot, cold = FakeCache(pool, 30, used=10), FakeCache(pool, 30, used=5)
    sch.caches = [hot, cold]  # the order they are listed in does not matter, their last use does
    assert sch.reclaim(20) == 20 and cold.num_pages() == 10 and hot.num_pages() == 30
    assert sch.reclaim(25) == 25 and cold.num_pages() == 0 and hot.num_pages() == 15
    assert sch.reclaim(100) == 15 and sch.reclaim(1) == 0  # everything given back, then nothing to give

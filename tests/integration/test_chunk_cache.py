"""Document KV in pool pages: round trips, LRU eviction, caps, and requests that only read them."""

import os

import numpy as np
import pytest
import torch

from redknot import LLM, HeadConfig, SamplingParams
from redknot.cache import ChunkKV, PagePool, chunk_key
from redknot.cache.chunk_cache import ChunkCache
from redknot.config import GLOBAL_WINDOW
from redknot.reuse.prompt import build_prompt
from oracles.reuse_engine import reuse_oracle

L, H, D, PS = 2, 3, 8, 4
DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")  # the engine tests below also run on a GPU


def make_pool(pages=64):
    window = torch.full((L, H), GLOBAL_WINDOW)
    return PagePool(pages, PS, D, window, torch.zeros(L, H, dtype=torch.long))


def chunk(n, start=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(tuple(range(n)), start, torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g))


def test_put_then_get_returns_the_same_kv():
    pool = make_pool()
    cache = ChunkCache(pool, "fp")
    c = chunk(10)
    assert cache.put("a", c)
    assert pool.num_free_pages == pool.num_pages - L * H * 3  # ceil(10 / 4) pages per head
    got = cache.get("a")
    assert got.start == 5 and got.token_ids == c.token_ids
    torch.testing.assert_close(got.k, c.k, rtol=0, atol=0)
    torch.testing.assert_close(got.v, c.v, rtol=0, atol=0)
    assert cache.get("b") is None


def test_insert_keeps_a_sequence_pages_from_an_offset():
    pool = make_pool()
    pool.add_sequence(1)
    pool.ensure(1, 11)
    table = pool.table(1)  # [L, H, 3]
    kv = torch.randn(2, L, 11, H, D)
    for layer in range(L):
        idx = torch.from_numpy(table[layer].astype(np.int64))  # [H, 3]
        for name, x in zip(("k_pages", "v_pages"), kv):
            flat = torch.zeros(H, 12, D)
            flat[:, :11] = x[layer].transpose(0, 1)
            getattr(pool, name)[idx] = flat.view(H, 3, PS, D)
    cache = ChunkCache(pool, "fp")
    assert cache.insert("c", tuple(range(6)), 5, table[:, :, 1:], 1)  # tokens 5..10 live from slot 1 of page 1
    pool.free_sequence(1)
    assert pool.num_free_pages == pool.num_pages - L * H * 2  # only the cached span's pages stay
    k, v = cache.gather(cache.lookup("c"))
    torch.testing.assert_close(k, kv[0][:, 5:], rtol=0, atol=0)
    torch.testing.assert_close(v, kv[1][:, 5:], rtol=0, atol=0)


def test_gather_many_reads_entries_one_after_another():
    """Several entries (whole pages and spans from an offset, sharing a page) read at once equal
    their reads one by one, concatenated along the tokens."""
    pool = make_pool()
    cache = ChunkCache(pool, "fp")
    for key, n, seed in (("a", 10, 0), ("b", 3, 1), ("c", 1, 2)):
        assert cache.put(key, chunk(n, seed=seed))
    pool.add_sequence(1)
    pool.ensure(1, 11)
    table = pool.table(1)
    g = torch.Generator().manual_seed(3)
    for name in ("k_pages", "v_pages"):
        idx = torch.from_numpy(table.astype(np.int64))
        getattr(pool, name)[idx] = torch.randn(L, H, 3, PS, D, generator=g)
    assert cache.insert("d", tuple(range(2)), 5, table[:, :, 1:2], 1)  # two tokens from slot 1 of a page
    assert cache.insert("e", tuple(range(3)), 7, table[:, :, 1:3], 3)  # the same page's last slot on
    entries = [cache.lookup(key) for key in ("b", "d", "a", "e", "c")]
    k, v = cache.gather_many(entries)
    one_by_one = [cache.gather(e) for e in entries]
    torch.testing.assert_close(k, torch.cat([x for x, _ in one_by_one], 1), rtol=0, atol=0)
    torch.testing.assert_close(v, torch.cat([y for _, y in one_by_one], 1), rtol=0, atol=0)
    assert k.shape == (L, 3 + 2 + 10 + 3 + 1, H, D)


def test_lru_eviction_and_the_byte_cap_return_pages():
    pool = make_pool(pages=L * H * 3 * 2)  # room for two 3-page chunks
    cache = ChunkCache(pool, "fp")
    assert cache.put("a", chunk(10)) and cache.put("b", chunk(10, seed=1))
    cache.lookup("a")  # a is now the most recent
    assert cache.put("c", chunk(10, seed=2))  # the pool is full: b, the least recent, goes
    assert "b" not in cache and "a" in cache and "c" in cache and cache.stats()["evictions"] == 1
    assert cache.evict(1) == L * H * 3 and "a" not in cache and "c" in cache  # a whole entry, LRU first
    cache.clear()
    assert pool.num_free_pages == pool.num_pages and len(cache) == 0
    capped = ChunkCache(pool, "fp", max_bytes=L * H * 3 * pool.bytes_per_page)
    assert capped.put("a", chunk(10)) and capped.put("b", chunk(9))
    assert "a" not in capped and capped.num_pages() == L * H * 3
    assert not capped.put("big", chunk(20))  # larger than the cap: refused, nothing taken
    assert pool.num_free_pages == pool.num_pages - L * H * 3


def test_bad_entries_are_refused():
    cache = ChunkCache(make_pool(), "fp")
    with pytest.raises(ValueError, match="every"):
        cache.insert("x", (1, 2), 0, np.full((L, H, 1), -1, np.int32), 0)
    with pytest.raises(ValueError, match="max_bytes"):
        ChunkCache(make_pool(), "fp", max_bytes=-1)


DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120. " * 2,
        "Attention heads differ: some look far back, most look at recent tokens. " * 2,
        "The quick brown fox jumps over the lazy dog near the old mill. " * 2]
QUESTION = "Question: who founded the city of Varna? Answer:"


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    hc = HeadConfig.synthetic(3, 2, 0.5, window=16, sink=4)
    return LLM(model=tiny_checkpoint("llama", num_hidden_layers=3), device=DEVICE, head_config=hc, page_size=16)


def test_requests_read_cached_chunk_pages_and_never_write_them(llm):
    llm.engine.clear_caches()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate(QUESTION, params, documents=DOCS, method="full_reuse")
    cache, pool = llm.chunk_cache, llm.pool
    prompt = build_prompt(llm.tokenizer, QUESTION, DOCS)
    keys = [chunk_key(llm.fingerprint, prompt.prefix, c) for c in prompt.chunks]
    entries = [cache.peek(k) for k in keys]
    assert all(e is not None for e in entries)
    pages = torch.from_numpy(np.concatenate([e.pages.ravel() for e in entries]).astype(np.int64)).to(pool.device)
    before = pool.k_pages[pages].clone(), pool.v_pages[pages].clone()
    for method in ("full_reuse", "epic", "cacheblend", "redknot"):
        out = llm.generate([QUESTION, "Question: what jumps?"], params, documents=[DOCS[::-1], DOCS[1:]],
                           method=method)
        assert all(o.metrics["cached_tokens"] > 0 for o in out)
    assert torch.equal(pool.k_pages[pages], before[0]) and torch.equal(pool.v_pages[pages], before[1])
    assert llm.engine.request_kv_bytes() == 0


def test_batched_recovery_on_the_device_equals_the_oracle(llm):
    """The recovery row policy in one batched forward (SegPaged kernels at explicit positions on
    a GPU) against the reference recovery forward of each request alone."""
    llm.engine.clear_caches()
    orders = [DOCS, DOCS[::-1]]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_first_logits=True)
    for method in ("cacheblend", "redknot", "redknot_exact"):
        out = llm.generate([QUESTION, "Question: what jumps?"], params, documents=orders, method=method)
        for o, q, docs in zip(out, [QUESTION, "Question: what jumps?"], orders):
            ref = reuse_oracle(llm).prefill(build_prompt(llm.tokenizer, q, docs), method).recovered
            cos = torch.nn.functional.cosine_similarity(o.first_token_logits.double(), ref.logits.double().cpu(), dim=0)
            assert cos >= 0.9999, (method, float(cos))
            assert o.metrics["flops"] == ref.flops.totals()


def test_a_small_pool_evicts_chunks_and_answers_the_same(tiny_checkpoint, llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [QUESTION, "Question: what jumps?", "Question: what differs?", QUESTION]
    docs = [[DOCS[0]], [DOCS[1]], [DOCS[2]], [DOCS[0]]]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, documents=docs, method="full_reuse")]
    hc = HeadConfig.synthetic(3, 2, 0.5, window=16, sink=4)
    small = LLM(model=tiny_checkpoint("llama", num_hidden_layers=3), device=DEVICE, head_config=hc, page_size=16,
                max_num_seqs=1, kv_pages=64)  # a second engine in the process: no share of the GPU's memory
    # a pool of just what the largest request needs: every new document evicts the cached ones
    need = max(pages_for(small, small.make_sequence(q, params, d, "full_reuse")) for q, d in zip(prompts, docs))
    small.engine.resize_pool(need)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, documents=docs, method="full_reuse")]
    assert got == ref
    assert small.chunk_cache.stats()["evictions"] > 0
    small.engine.clear_caches()
    assert small.pool.num_free_pages == small.pool.num_pages


def test_admission_waits_without_computing_or_evicting_when_its_documents_cannot_fit(tiny_checkpoint):
    """A request whose missing documents would not fit beside the running ones waits: nothing is
    computed for it and no cached document is evicted for it (no evict-and-recompute every step);
    once pages come back it runs."""
    hc = HeadConfig.synthetic(3, 2, 0.5, window=16, sink=4)
    llm = LLM(model=tiny_checkpoint("llama", num_hidden_layers=3), device=DEVICE, head_config=hc, page_size=16,
              kv_pages=4096)
    engine, pool = llm.engine, llm.pool
    llm.generate(QUESTION, SamplingParams(max_tokens=1), documents=DOCS[:1], method="full_reuse")
    cached_key = next(iter(engine.chunk_cache._entries))
    r1 = llm.make_sequence("a long answer", SamplingParams(max_tokens=40, ignore_eos=True), method="dense")
    engine.add_request(r1)
    engine.step()
    r2 = llm.make_sequence(QUESTION, SamplingParams(max_tokens=2, ignore_eos=True), documents=DOCS[1:], method="full_reuse")
    engine.prepare(r2)
    docs = engine.documents.needs(r2)
    kept_pages, missing = docs.kept_pages, docs.missing_pages
    need = engine.scheduler.admission_pages(r2)
    evictable = engine.scheduler.cached_pages() - kept_pages
    assert missing > 0
    held = pool.allocate(pool.num_free_pages - (need + missing - 1 - evictable))  # one page short
    assert need <= pool.num_free_pages + evictable  # the request alone would fit, not with its documents
    engine.add_request(r2)
    misses = engine.chunk_cache.misses
    for _ in range(3):
        engine.step()
    assert r2 in engine.waiting and engine.chunk_cache.misses == misses
    assert engine.chunk_cache.peek(cached_key) is not None
    pool.release(held)
    while engine.has_unfinished():
        engine.step()
    assert r2.finish_reason == "length" and r1.finish_reason == "length"
    engine.clear_caches()
    assert pool.num_free_pages == pool.num_pages


def test_cache_salt_keeps_tenants_apart(llm):
    """The same documents under another cache_salt are computed again (nothing shared between
    namespaces: no timing or cached_tokens oracle); under the same salt they are reused."""
    llm.engine.clear_caches()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def cached(method, salt):
        seq = llm.make_sequence(QUESTION, params, DOCS, method, cache_salt=salt)
        llm.engine.add_request(seq)
        while llm.engine.has_unfinished():
            llm.engine.step()
        return seq.cached_tokens, seq.output_token_ids

    for method in ("full_reuse", "dense", "redknot"):  # fresh tenants per method (one tenant's
        first, out_a = cached(method, method + "/a")  # methods share its exact pages)
        again, out_a2 = cached(method, method + "/a")
        other, out_b = cached(method, method + "/b")
        plain, _ = cached(method, None) if method == "full_reuse" else (0, None)
        assert first == 0 and again > 0 and other == 0 and plain == 0, method
        assert out_a == out_a2 == out_b


def pages_for(llm, seq) -> int:
    llm.engine.prepare_plan(seq)
    return llm.engine.scheduler.pages_for(seq)


def test_a_hot_prompt_prefix_outlives_cold_documents(tiny_checkpoint):
    """Eviction takes the least recently used entry across the prefix and chunk caches: documents
    used once before a prompt that recurs go first when new documents need the pages, and the prompt
    keeps its cached prefix (the prefix cache used to be emptied first, whatever its use)."""
    llm = LLM(model=tiny_checkpoint("llama", num_hidden_layers=2), device="cpu", page_size=16, kv_pages=360)
    prompt = "The archive of Varna keeps the letters of its founders and the ledgers of the salt trade. " * 4
    prompt += "Who wrote them?"
    docs = lambda tag: [f"{tag} document {i}: " + "the river delta maps drawn by surveyors " * 6 for i in range(3)]  # noqa: E731
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate("Q?", params, documents=docs("old"), method="full_reuse")
    for _ in range(2):
        hot = llm.generate(prompt, params, method="dense")[0].metrics["cached_tokens"]
    assert hot > 0
    evictions = llm.chunk_cache.evictions
    llm.generate("Q?", params, documents=docs("new"), method="full_reuse")  # needs the old documents' pages
    assert llm.chunk_cache.evictions > evictions
    assert llm.generate(prompt, params, method="dense")[0].metrics["cached_tokens"] == hot


def test_small_documents_share_pages_on_a_default_pool():
    """256 one-character documents need one page per (layer, KV head) each unpacked (12,288 pages on
    the bundled model, past its default 8,192-page pool); packed into page-sized runs they are served
    by the document methods, and the same documents again are read from the cache."""
    from redknot.reuse.prompt import ChunkedPrompt

    cp = ChunkedPrompt((1,), ((5,), (6, 7), tuple(range(100, 170)), (8,), (9,)), (2,))
    packed = cp.packed(64)
    assert packed.token_ids == cp.token_ids
    assert packed.chunks == ((5, 6, 7), tuple(range(100, 170)), (8, 9))
    assert cp.packed(1) is cp  # nothing shorter than a page: unchanged

    llm = LLM(device="cpu")
    docs = [chr(97 + i % 26) for i in range(256)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for method in ("cacheblend", "redknot_kv"):
        first = llm.generate(["Which letter comes first?"], params, documents=[docs], method=method)[0]
        again = llm.generate(["Which letter comes first?"], params, documents=[docs], method=method)[0]
        assert len(first.outputs[0].token_ids) == 3
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert again.metrics["cached_tokens"] > 0
    assert not llm.engine.has_unfinished() and llm.engine.idle()


def test_the_caches_page_sets_follow_their_entries(tiny_checkpoint):
    """Each cache's counted page set equals the union of its entries' pages through inserts,
    hits, LRU evictions and a clear; the engine's held pages come back to 0 when idle."""
    llm = LLM(model=tiny_checkpoint("llama", num_hidden_layers=2), device="cpu", page_size=16, kv_pages=360)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    chunks, prefixes = llm.chunk_cache, llm.engine.prefix_cache

    def walked(arrays):
        ids = [np.asarray(a).ravel() for a in arrays]
        ids = np.concatenate(ids) if ids else np.zeros(0, np.int32)
        return np.unique(ids[ids >= 0])

    def check():
        assert np.array_equal(chunks.page_ids(), walked(e.pages for e in chunks._entries.values()))
        assert np.array_equal(prefixes.page_ids(), walked(prefixes._blocks.values()))
    for round_ in range(3):  # later rounds evict earlier documents and prefixes (a small pool)
        docs = [f"round {round_} document {i}: " + "the river delta maps drawn by surveyors " * 6 for i in range(3)]
        llm.generate("Q?", params, documents=docs, method="full_reuse")
        llm.generate(f"Round {round_}: " + "the ledgers of the salt trade " * 8, params, method="dense")
        check()
    assert chunks.evictions > 0 and llm.engine.idle()
    chunks.clear()
    prefixes.clear()
    check()
    assert chunks.page_ids().size == 0 and prefixes.page_ids().size == 0

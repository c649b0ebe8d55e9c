"""Chunk reuse: every method through the recovery forward, exactness gates, caching, accounting."""

import math
import os
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from redknot import LLM, HeadConfig, SamplingParams
from redknot.cache import chunk_key
from redknot.config import HeadConfigError, SparseFFNConfig
from redknot.reuse.policies import RedKnot, chunk_ranked, chunk_start_rows, rank_descending, select_tokens
from redknot.reuse.prompt import build_prompt
from oracles.reuse_engine import reuse_oracle

DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120. " * 2,
        "Attention heads differ: some look far back, most look at recent tokens. " * 2,
        "The quick brown fox jumps over the lazy dog near the old mill. " * 2]
QUESTION = "Question: who founded the city of Varna? Answer:"
ALL = ["dense", "headsparse", "prefix", "full_reuse", "epic", "cacheblend", "redknot_paper", "redknot", "redknot_exact"]
SPARSE = SparseFFNConfig(dense_until=1, mass_thresh=0.3, deep_layer_start=2, mass_thresh_deep=0.1, recent_n=8,
                         min_keep=4)


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def make_llm(path, cfg_layers=3, kv=2, **kw):
    hc = HeadConfig.synthetic(cfg_layers, kv, 0.5, window=16, sink=4)
    return LLM(model=path, device="cpu", head_config=hc, page_size=16, sparse_ffn=SPARSE, **kw)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return make_llm(tiny_checkpoint("llama", num_hidden_layers=3))


@pytest.mark.parametrize("family,kw", [("llama", {"rope": "llama3"}), ("mistral", {}), ("qwen2", {}),
                                       ("qwen3", {"tie_word_embeddings": True})])
def test_redknot_exact_equals_dense(tiny_checkpoint, family, kw):
    llm = make_llm(tiny_checkpoint(family, num_hidden_layers=3, **kw))
    dense = llm.first_token_logits(QUESTION, documents=DOCS, method="dense")
    exact = llm.first_token_logits(QUESTION, documents=DOCS, method="redknot_exact")
    assert cos(exact, dense) >= 0.99999 and exact.argmax() == dense.argmax()
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = llm.generate(QUESTION, params, documents=DOCS, method="dense")[0].outputs[0].token_ids
    assert llm.generate(QUESTION, params, documents=DOCS, method="redknot_exact")[0].outputs[0].token_ids == ref


def first(llm, method, docs=DOCS, question=QUESTION):
    """One greedy token through the engine: (first-token logits, request metrics)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_first_logits=True)
    out = llm.generate(question, params, documents=docs, method=method)[0]
    return out.first_token_logits, out.metrics


def test_full_reuse_of_a_single_document_equals_dense(llm):
    llm.engine.clear_caches()
    dense = llm.first_token_logits(QUESTION, documents=DOCS[:1], method="dense")
    prompt = build_prompt(llm.tokenizer, QUESTION, DOCS[:1])
    # cold (the chunk is computed now: nothing was served from a cache) and warm (served from it)
    for cached in (0, prompt.suffix_start):
        reused, metrics = first(llm, "full_reuse", DOCS[:1])
        assert cos(reused, dense) >= 0.99999
        assert metrics["cached_tokens"] == cached


def test_placed_chunks_equal_the_recovery_oracle(llm):
    """full_reuse/epic copy relocated chunk KV into the request's pages and prefill the rest in
    the pool; the recovery forward (ReuseEngine.prefill) computes the same thing its own way."""
    prompt = build_prompt(llm.tokenizer, QUESTION, DOCS[::-1])
    for method in ("full_reuse", "epic"):
        logits, metrics = first(llm, method, DOCS[::-1])
        oracle = reuse_oracle(llm).prefill(prompt, method).recovered
        torch.testing.assert_close(logits, oracle.logits, rtol=1e-4, atol=1e-4)
        assert metrics["flops"] == oracle.flops.totals()


def _assert_batch_equals_the_oracle(llm, questions, orders, method):
    """All requests in one generate call: each one's first-token logits and FLOPs equal the
    reference recovery forward's for it alone, and no page is left held."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_first_logits=True)
    out = llm.generate(questions, params, documents=orders, method=method)
    for o, q, docs in zip(out, questions, orders):
        oracle = reuse_oracle(llm).prefill(build_prompt(llm.tokenizer, q, docs), method).recovered
        torch.testing.assert_close(o.first_token_logits, oracle.logits, rtol=1e-4, atol=1e-4)
        assert o.metrics["flops"] == oracle.flops.totals()
    assert llm.engine.request_kv_bytes() == 0


@pytest.mark.parametrize("method", ["cacheblend", "redknot_paper", "redknot", "redknot_exact"])
def test_batched_recovery_equals_the_recovery_oracle(llm, method):
    """Recovery methods run as a row policy inside one batched forward over the pool: three
    requests (documents in different orders, one of them cold) in one step give the logits and
    FLOPs of the reference recovery forward (ReuseEngine.prefill), one request at a time."""
    llm.engine.clear_caches()
    orders = [DOCS, DOCS[::-1], [DOCS[1], DOCS[0]]]
    questions = [QUESTION, "Question: what jumps over the dog?", QUESTION]
    _assert_batch_equals_the_oracle(llm, questions, orders, method)


@pytest.mark.parametrize("keep_fraction,starts", [(None, 0), (0.3, 0), (0.3, 3), (None, 3)])
@pytest.mark.parametrize("method", ["redknot_paper", "redknot"])
def test_rows_picked_for_a_batch_equal_each_request_alone(tiny_checkpoint, method, keep_fraction, starts):
    """RedKnot policies ranking by attention mass pick their FFN rows for the whole batch at once
    (padded tensors, two host syncs per layer whatever the batch): four requests of different
    lengths in one step give the logits and FLOPs of the reference recovery forward, one request
    at a time (with each chunk's first ``starts`` tokens forced in too)."""
    sparse = SparseFFNConfig(dense_until=1, mass_thresh=0.3, deep_layer_start=2, mass_thresh_deep=0.1,
                             recent_n=6, min_keep=2, keep_fraction=keep_fraction, chunk_start_tokens=starts)
    llm = LLM(model=tiny_checkpoint("llama", num_hidden_layers=4), device="cpu", page_size=16, sparse_ffn=sparse,
              head_config=HeadConfig.synthetic(4, 2, 0.5, window=16, sink=4))
    orders = [DOCS, DOCS[::-1], [DOCS[1], DOCS[0]], [DOCS[2], DOCS[0] * 2, DOCS[1]]]
    questions = [QUESTION, "Question: what jumps over the dog?", "Who?", QUESTION]
    _assert_batch_equals_the_oracle(llm, questions, orders, method)


@pytest.mark.parametrize("starts", [0, 3])
def test_deviation_ranked_rows_equal_the_oracle_and_are_the_most_deviating(tiny_checkpoint, monkeypatch, starts):
    """importance="deviation": redknot keeps, at its first sparse layer, each chunk's first
    ``starts`` tokens and then the chunk rows whose recomputed values there are furthest from their
    cached ones; a batch of requests gives the reference recovery forward's logits and FLOPs."""
    sparse = SparseFFNConfig(dense_until=1, deep_layer_start=2, recent_n=6, min_keep=2, keep_fraction=0.3,
                             chunk_start_tokens=starts, importance="deviation")
    llm = LLM(model=tiny_checkpoint("llama", num_hidden_layers=4), device="cpu", page_size=16, sparse_ffn=sparse,
              head_config=HeadConfig.all_global(4, 2))
    _assert_batch_equals_the_oracle(llm, [QUESTION, "Who?"], [DOCS, DOCS[::-1]], "redknot")
    seen = {}
    ffn_rows = RedKnot.ffn_rows

    def spy(self, layer, cur, info):
        rows = ffn_rows(self, layer, cur, info)
        if layer == 1:
            seen.update(cur=cur.clone(), dev=info["v_deviation"].clone(), rows=rows, starts=self.chunk_start[cur])
        return rows

    monkeypatch.setattr(RedKnot, "ffn_rows", spy)
    prompt = build_prompt(llm.tokenizer, QUESTION, DOCS)
    reuse_oracle(llm).prefill(prompt, "redknot")
    cur, dev, rows, first = seen["cur"], seen["dev"], seen["rows"], seen["starts"]
    cand = (cur >= prompt.chunk_starts[0]) & (cur < len(prompt) - 6)  # chunk rows outside the last recent_n
    cand &= cur < prompt.suffix_start
    n_keep = math.ceil(0.3 * int(cand.sum()))
    forced = cand & first
    rest = cand & ~first
    top = rest.nonzero().flatten()[dev[rest].argsort(descending=True)[:n_keep - int(forced.sum())]]
    want = (~cand).nonzero().flatten().tolist() + forced.nonzero().flatten().tolist() + top.tolist()
    assert sorted(rows.tolist()) == sorted(want) and dev[rest].max() > 0
    with pytest.raises(HeadConfigError, match="deviation.*keep_fraction"):
        SparseFFNConfig(importance="deviation")


@pytest.mark.parametrize("cap", [None, 2])
def test_recovery_admission_charges_the_rows_a_recovery_computes(tiny_checkpoint, llm, cap):
    """The step's token budget charges a recovery the share of a dense prefill's row work the
    method's last recoveries computed (every row until one is measured), so more recoveries share
    one forward than their layer-0 rows alone would allow; max_recovery_rows caps the rows a
    recovery forward starts with."""
    import math

    n = len(build_prompt(llm.tokenizer, QUESTION, DOCS).token_ids)
    budget = n * 3 // 2  # charged every row, two recoveries would share a forward
    fresh = make_llm(tiny_checkpoint("llama", num_hidden_layers=3), max_num_batched_tokens=budget,
                     max_recovery_rows=None if cap is None else cap * n)
    sizes = []
    recover = fresh.engine.runner.recover
    def starting(ids, prompts, rows):  # a batch's first call (a recovery split over steps resumes in later ones)
        if rows.paused is None and rows.batch is None:
            sizes.append(len(ids))
        return recover(ids, prompts, rows)
    fresh.engine.runner.recover = starting
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_first_logits=True)
    ref = fresh.generate(QUESTION, params, documents=DOCS, method="cacheblend")[0].first_token_logits
    share = fresh.engine.recovery_share["cacheblend"]
    assert 0 < share < 0.75
    sizes.clear()
    out = fresh.generate([QUESTION] * 6, params, documents=[DOCS] * 6, method="cacheblend")
    # one forward takes the recoveries whose charges fit the budget (one admitted past it starts
    # in a batch of its own)
    expected = min(budget // math.ceil(share * n), cap or 6)
    assert sizes[0] == expected and max(sizes) == expected and sum(sizes) == 6
    assert expected >= 2 > budget // n
    for o in out:  # batching does not change what each recovery computes
        torch.testing.assert_close(o.first_token_logits, ref, rtol=1e-4, atol=1e-4)
    assert fresh.engine.request_kv_bytes() == 0


def test_a_recovery_that_fits_the_step_is_not_held_by_one_admitted_beside_it(tiny_checkpoint):
    """Two recoveries admitted in one step whose charges exceed its budget together run as two
    batches: the first samples its token in that step, the second in the next (one batch would
    spread both over the two steps)."""
    fresh = make_llm(tiny_checkpoint("llama", num_hidden_layers=3))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    fresh.generate(QUESTION, params, documents=DOCS, method="cacheblend")  # measures the method's share
    eng = fresh.engine
    charge = eng.executor.recovery_charge(fresh.make_sequence(QUESTION, params, documents=DOCS, method="cacheblend"))
    eng.cfg.max_num_batched_tokens = charge * 3 // 2  # one fits, two do not
    seqs = [fresh.make_sequence(QUESTION, params, documents=DOCS, method="cacheblend") for _ in range(2)]
    for s in seqs:
        eng.add_request(s)
    first = {o.seq.seq_id for o in eng.step() if o.new_token_ids}
    assert first == {seqs[0].seq_id}
    second = {o.seq.seq_id for o in eng.step() if o.new_token_ids}
    assert second == {seqs[1].seq_id}
    assert not eng.has_unfinished()


def test_a_short_request_arriving_beside_a_heavy_one_starts_first(tiny_checkpoint):
    """Requests arriving in one step are admitted with the least work first: a two-document
    request added after a many-document one samples in the first step, the heavy one after it.
    A request already waiting from an earlier step keeps its place ahead of new arrivals."""
    fresh = make_llm(tiny_checkpoint("llama", num_hidden_layers=3))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = [f"Note {i}: the {w} is by the {w}." for i, w in enumerate(["mill", "barn", "gate", "pond"] * 6)]
    fresh.generate(QUESTION, params, documents=many, method="cacheblend")  # caches them, measures the share
    fresh.generate(QUESTION, params, documents=DOCS, method="cacheblend")
    eng = fresh.engine
    heavy = fresh.make_sequence(QUESTION, params, documents=many, method="cacheblend")
    short = fresh.make_sequence(QUESTION, params, documents=DOCS, method="cacheblend")
    assert eng.executor.recovery_charge(short) < eng.executor.recovery_charge(heavy)
    eng.cfg.max_num_batched_tokens = eng.executor.recovery_charge(heavy) + 1
    eng.cfg.max_recovery_rows = len(heavy.token_ids) + 1  # one of the two starts a step
    eng.add_request(heavy)
    eng.add_request(short)
    assert {o.seq.seq_id for o in eng.step() if o.new_token_ids} == {short.seq_id}
    while eng.has_unfinished():
        eng.step()
    assert heavy.output_token_ids

    # waiting from before: the heavy request stays ahead of a short one arriving after it
    heavy2 = fresh.make_sequence(QUESTION, params, documents=many, method="cacheblend")
    eng.add_request(heavy2)
    eng.scheduler.order_arrivals(lambda s: 0)  # an admission took place (nothing started)
    short2 = fresh.make_sequence(QUESTION, params, documents=DOCS, method="cacheblend")
    eng.add_request(short2)
    eng.scheduler.order_arrivals(lambda s: eng.executor.recovery_charge(s))
    assert list(eng.scheduler.waiting) == [heavy2, short2]
    while eng.has_unfinished():
        eng.step()


def test_many_documents_placed_in_groups_equal_one_by_one(llm, monkeypatch):
    """Pieces placed by one read, rotation and store per group give the logits of placing each
    alone (groups of one token: every piece its own group)."""
    from redknot.engine import documents

    swapped = [DOCS[2], DOCS[0], DOCS[1]]
    llm.first_token_logits(QUESTION, documents=DOCS, method="full_reuse")  # cached at their first places
    grouped = llm.first_token_logits(QUESTION, documents=swapped, method="full_reuse")
    monkeypatch.setattr(documents, "COPY_GROUP_TOKENS", 1)
    alone = llm.first_token_logits(QUESTION, documents=swapped, method="full_reuse")
    torch.testing.assert_close(grouped, alone, rtol=0, atol=0)


def test_documents_reused_in_another_order_are_relocated(llm):
    llm.first_token_logits(QUESTION, documents=DOCS, method="full_reuse")
    hits = llm.chunk_cache.stats()["hits"]
    swapped = [DOCS[2], DOCS[0], DOCS[1]]
    logits = llm.first_token_logits(QUESTION, documents=swapped, method="full_reuse")
    assert llm.chunk_cache.stats()["hits"] >= hits + 3  # every chunk served from the store
    assert torch.isfinite(logits).all()
    # the moved chunks carry keys rotated to their new offsets: the exact gate still holds
    exact = llm.first_token_logits(QUESTION, documents=swapped, method="redknot_exact")
    assert cos(exact, llm.first_token_logits(QUESTION, documents=swapped, method="dense")) >= 0.99999


def test_prefix_method_reuses_exact_prefixes(llm):
    llm.engine.clear_caches()
    first_logits, metrics = first(llm, "prefix")
    assert metrics["cached_tokens"] == 0
    question = "Question: where is the mill?"
    second, metrics = first(llm, "prefix", question=question)
    prompt = build_prompt(llm.tokenizer, question, DOCS)
    ps = llm.pool.page_size
    # every full page of the documents (and of the question's shared first words)
    assert prompt.suffix_start // ps * ps <= metrics["cached_tokens"] < len(prompt.token_ids)
    dense, _ = first(llm, "dense", question=question)
    assert cos(second, dense) >= 0.99999 and torch.isfinite(first_logits).all()


@pytest.mark.parametrize("method", ALL)
def test_every_method_prefills_decodes_and_frees(llm, method):
    t0 = time.perf_counter()
    out = llm.generate([QUESTION, "Question: what jumps?"], SamplingParams(max_tokens=6, temperature=0,
                                                                           ignore_eos=True),
                       documents=[DOCS, DOCS[::-1]], method=method)
    wall = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    for o in out:  # the first token comes after the prefill and before the five decode steps end
        assert 0 < o.metrics["time_to_first_token"] < wall
    assert llm.engine.request_kv_bytes() == 0 and not llm.engine.has_unfinished()
    llm.engine.clear_caches()
    assert llm.pool.num_free_pages == llm.pool.num_pages


@pytest.mark.parametrize("method", ALL)
def test_generate_returns_the_first_token_logits_on_request(llm, method):
    """What quality scoring reads instead of a second prefill: the logits the first token was
    sampled from, equal to first_token_logits' (which then reuses the chunks generate cached)."""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, return_first_logits=True)
    out = llm.generate(QUESTION, params, documents=DOCS[::-1], method=method)[0]
    ref = llm.first_token_logits(QUESTION, documents=DOCS[::-1], method=method)
    assert out.first_token_logits.dtype == torch.float32 and out.first_token_logits.shape == ref.shape
    torch.testing.assert_close(out.first_token_logits, ref, rtol=1e-5, atol=1e-5)
    assert out.outputs[0].token_ids[0] == int(ref.argmax())
    plain = llm.generate(QUESTION, SamplingParams(max_tokens=1), documents=DOCS, method=method)[0]
    assert plain.first_token_logits is None  # not asked for: not kept


def test_sparse_ffn_and_kv_reuse_execute_less(llm):
    prompt = build_prompt(llm.tokenizer, QUESTION, DOCS)
    flops = {m: reuse_oracle(llm).prefill(prompt, m).recovered.flops
             for m in ("redknot_exact", "redknot_paper", "redknot", "full_reuse", "epic", "cacheblend")}
    exact, rk, rkv = flops["redknot_exact"], flops["redknot_paper"], flops["redknot"]
    first = len(prompt.chunks[0])  # its cache is exact: redknot leaves it out, redknot_exact does not
    assert rk.ffn_tokens[0] == exact.ffn_tokens[0] - first  # dense_until=1: layer 0 runs the dense FFN
    assert sum(rk.ffn) < sum(exact.ffn)  # deeper layers: sparse FFN
    assert rk.tokens == [t - first for t in exact.tokens]  # every other chunk token goes through every layer
    assert rkv.tokens[-1] < rkv.tokens[0] and sum(rkv.proj) < sum(rk.proj)  # dropped tokens use cached KV
    assert sum(rk.attention) < sum(exact.attention)  # local heads see their window only
    assert flops["full_reuse"].tokens == [len(prompt.suffix)] * 3
    assert flops["epic"].tokens[0] == len(prompt.suffix) + sum(min(16, len(c)) for c in prompt.chunks)
    n_chunk = sum(len(c) for c in prompt.chunks)
    assert flops["cacheblend"].tokens[:2] == [n_chunk + len(prompt.suffix)] * 2  # every row through the check layer
    assert flops["cacheblend"].tokens[2] == len(prompt.suffix) + round(0.15 * n_chunk)


def test_cacheblend_ranks_rows_by_value_deviation_at_its_check_layer(llm, monkeypatch):
    """Layer 0's values depend on the token alone: cached and recomputed ones agree to rounding there,
    so a ranking at layer 0 orders noise. CacheBlend reads the deviation at its check layer (1), where
    the later chunks' values carry the cross-chunk context their cache lacked, and keeps the ratio of
    chunk rows that deviate most there."""
    from redknot.reuse.policies import CacheBlend

    seen = {}
    keep_rows = CacheBlend.keep_rows

    def spy(self, layer, cur, info):
        keep = keep_rows(self, layer, cur, info)
        seen[layer] = (cur.clone(), info["v_deviation"].clone(), None if keep is None else cur[keep].clone())
        return keep

    monkeypatch.setattr(CacheBlend, "needs_deviation", lambda self, layer: True)  # read it at every layer
    monkeypatch.setattr(CacheBlend, "keep_rows", spy)
    prompt = build_prompt(llm.tokenizer, QUESTION, DOCS)
    reuse_oracle(llm).prefill(prompt, "cacheblend")
    (cur, dev0, keep0), (cur1, dev1, keep1) = seen[0], seen[1]
    assert keep0 is None and keep1 is not None and torch.equal(cur, cur1)
    chunk = (cur >= prompt.chunk_starts[0]) & (cur < prompt.suffix_start)
    later = chunk & (cur >= prompt.chunk_starts[1])  # the first chunk's cache is exact (its own positions)
    assert dev1[later].max() > 0 and dev0[later].max() < 1e-4 * dev1[later].max()
    n_keep = round(0.15 * int(chunk.sum()))
    top = cur[chunk][dev1[chunk].argsort(descending=True)[:n_keep]]
    assert set(keep1[chunk[torch.isin(cur, keep1)]].tolist()) == set(top.tolist())


def test_dense_flops_match_the_formula(llm):
    f = reuse_oracle(llm).prefill(build_prompt(llm.tokenizer, QUESTION, DOCS), "redknot_exact").recovered.flops
    c = llm.config
    n = len(build_prompt(llm.tokenizer, QUESTION, DOCS).token_ids)
    p = len(build_prompt(llm.tokenizer, QUESTION, DOCS).prefix)
    t = n - p
    pairs = sum(range(p + 1, n + 1)) * c.num_attention_heads
    assert f.attention[0] == 4 * c.head_dim * pairs
    assert f.ffn[0] == 2 * t * 3 * c.hidden_size * c.intermediate_size


def test_chunks_never_cross_models(tiny_checkpoint):
    a = make_llm(tiny_checkpoint("llama", num_hidden_layers=3))
    b = make_llm(tiny_checkpoint("llama", num_hidden_layers=3, seed=5))
    assert a.fingerprint != b.fingerprint
    a.first_token_logits(QUESTION, documents=DOCS[:1], method="full_reuse")
    prompt = build_prompt(a.tokenizer, QUESTION, DOCS[:1])
    # the same chunk under B's fingerprint is another key: B can never read A's entry
    assert chunk_key(a.fingerprint, prompt.prefix, prompt.chunks[0]) in a.chunk_cache
    assert chunk_key(b.fingerprint, prompt.prefix, prompt.chunks[0]) not in a.chunk_cache
    reused = b.first_token_logits(QUESTION, documents=DOCS[:1], method="full_reuse")
    dense = b.first_token_logits(QUESTION, documents=DOCS[:1], method="dense")
    assert cos(reused, dense) >= 0.99999


def test_prompt_layout_with_chat_template(llm):
    p = build_prompt(llm.tokenizer, QUESTION, DOCS)
    rendered = llm.tokenizer.decode(p.token_ids)
    assert rendered.index("Ilsa Torv") < rendered.index("Question:")  # documents before the question
    assert rendered.startswith("<s><|user|>") and rendered.rstrip().endswith("<|assistant|>")
    assert p.chunk_starts[0] == len(p.prefix) and len(p) == len(p.token_ids)
    ids = build_prompt(llm.tokenizer, [5, 6], [[7, 8, 9]])
    assert ids.token_ids == [7, 8, 9, 5, 6]


def test_select_tokens_covers_the_mass():
    score = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05, 9.0])
    cand = torch.tensor([True, True, True, True, True, False])
    rows = select_tokens(score, cand, drop_share=0.2, recent_n=0, min_keep=0)
    assert rows.tolist() == [0, 1, 5]  # 0.5 + 0.3 = 80% of the candidates' mass, plus the non-candidate
    assert select_tokens(score, cand, 0.2, recent_n=2, min_keep=0).tolist() == [0, 1, 4, 5]
    assert len(select_tokens(score, cand, 0.9, recent_n=0, min_keep=5)) == 5



@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_rank_descending_breaks_ties_towards_the_later_row(values):
    """Highest score first; among equal scores the later row first, the same order on any device."""
    score = torch.tensor(values, dtype=torch.float32)
    expected = sorted(range(len(values)), key=lambda i: (-values[i], -i))
    assert rank_descending(score).tolist() == expected


def test_select_tokens_fills_min_keep_with_the_latest_candidates():
    """Where scores tie (a row that sees no other chunk scores exactly 0), min_keep takes the latest
    candidates, and never spends a pick on a row that is kept anyway."""
    score = torch.zeros(6)
    cand = torch.tensor([True, True, True, True, False, False])
    assert select_tokens(score, cand, 0.2, recent_n=0, min_keep=4).tolist() == [2, 3, 4, 5]
    score = torch.tensor([0.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    assert select_tokens(score, cand, 0.2, recent_n=0, min_keep=4).tolist() == [1, 3, 4, 5]

def test_bad_requests(llm):
    with pytest.raises(TypeError, match="documents"):
        llm.first_token_logits(QUESTION, documents="not a list", method="full_reuse")
    with pytest.raises(ValueError, match=r"documents\[1\] is empty"):
        llm.first_token_logits(QUESTION, documents=["a", []], method="full_reuse")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        llm.first_token_logits(QUESTION, documents=["word " * 800], method="full_reuse")
    with pytest.raises(ValueError, match="2 document lists for 1 prompts"):
        llm.generate([QUESTION], documents=[DOCS, DOCS])


def test_sparse_ffn_config(tmp_path, anchor_head_config):
    path = anchor_head_config.parents[1] / "sparse_ffn_params" / "mistral-7B.json"
    cfg = SparseFFNConfig.from_json(path)
    assert (cfg.dense_until, cfg.deep_layer_start, cfg.recent_n) == (4, 20, 128)
    assert cfg.threshold(3) is None and cfg.threshold(4) == 0.2 and cfg.threshold(25) == 0.05
    bad = tmp_path / "s.json"
    bad.write_text('{"dense_until": 4, "mass_tresh": 0.2}')
    with pytest.raises(HeadConfigError, match="mass_tresh"):
        SparseFFNConfig.from_json(bad)


def test_recovery_through_the_triton_kernel(tiny_checkpoint, llm):
    """The GPU path, interpreted: the engine on the Triton kernels (rows stored and attended at
    explicit positions) and the recovery oracle's SegPaged path give the torch reference's logits."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through Triton need the interpreter (TRITON_INTERPRET=1)")
    ref = {m: llm.first_token_logits(QUESTION, documents=DOCS, method=m) for m in ("dense", "epic", "redknot")}
    fast = make_llm(tiny_checkpoint("llama", num_hidden_layers=3), kernel="triton")
    prompt = build_prompt(fast.tokenizer, QUESTION, DOCS)
    for m, r in ref.items():
        assert cos(fast.first_token_logits(QUESTION, documents=DOCS, method=m), r) >= 0.99999, m
        assert cos(reuse_oracle(fast).prefill(prompt, m).recovered.logits, r) >= 0.99999, m
    exact = fast.first_token_logits(QUESTION, documents=DOCS, method="redknot_exact")
    assert cos(exact, ref["dense"]) >= 0.99999  # exact through the kernel == dense


def test_conversation_prompt_puts_history_before_the_documents(llm):
    tok = llm.tokenizer
    question = [{"role": "user", "content": QUESTION}]
    with_system = [{"role": "system", "content": "Be brief."}] + question
    plain, conv = build_prompt(tok, QUESTION, DOCS), build_prompt(tok, question, DOCS)
    assert plain == conv  # a one-message conversation is the plain question
    sys_prompt = build_prompt(tok, with_system, DOCS)
    assert sys_prompt.chunks == plain.chunks and sys_prompt.suffix == plain.suffix
    assert len(sys_prompt.prefix) > len(plain.prefix)
    rendered = tok.apply_chat_template(with_system[:1] + [{"role": "user", "content": "X"}], tokenize=False,
                                       add_generation_prompt=True)
    assert tok.decode(list(sys_prompt.prefix)) == rendered.split("X")[0]
    # the API takes the conversation as one prompt, for every method
    out = llm.generate(with_system, SamplingParams(max_tokens=3, temperature=0), documents=DOCS, method="full_reuse")
    assert len(out) == 1 and out[0].prompt_token_ids == sys_prompt.token_ids
    with pytest.raises(ValueError, match="last message"):
        build_prompt(tok, with_system + [{"role": "assistant", "content": "Hi"}], DOCS)
    with pytest.raises(ValueError, match="chat template"):
        build_prompt(tok, with_system, DOCS, use_chat_template=False)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("n,skip,full", [(70, 0, [1, 1]), (70, 0, [1, 0]), (130, 9, [0, 1]), (130, 9, [1, 1]),
                                         (96, 40, [1, 0])])
def test_causal_sdpa_path_equals_the_masked_reference(kernel, n, skip, full):
    """Full-context heads go through one causal SDPA when (nearly) every position is a query,
    also when a few leading positions are not queries (cached prefix) and beside windowed heads."""
    if kernel == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("CPU tensors through Triton need the interpreter (TRITON_INTERPRET=1)")
    from redknot.reuse import recovery

    g, d = 2, 16
    hkv = len(full)
    torch.manual_seed(n + skip)
    pos = torch.arange(skip, n)
    q = torch.randn(pos.numel(), hkv * g, d)
    keys = recovery.kv_buffer(n, hkv, d, torch.float32, "cpu").normal_()
    values = recovery.kv_buffer(n, hkv, d, torch.float32, "cpu").normal_()
    is_full = torch.tensor(full, dtype=torch.bool)
    window = torch.where(is_full, 1 << 30, 24)
    sink = torch.where(is_full, 0, 4)
    j = torch.arange(n)[None, None, :]
    ref = recovery._attend_masked(q, pos, keys, values, j, window[:, None, None], sink[:, None, None], d**-0.5, g)
    out, _ = recovery._attend(q, pos, keys, values, window, sink, d**-0.5, 0, full=is_full, paged=kernel == "triton")
    assert (out - ref).abs().max() < 1e-5


def test_suffix_keeps_its_head_plan_where_chunks_recover_locally(llm):
    """A query split (chunk rows local, suffix rows under their own visibility) equals two passes:
    every position under the local visibility, then the suffix alone under its own over that K/V
    (``Policy.query_split``, which the batched recovery also honours)."""
    from redknot.reuse.policies import FixedSet
    from redknot.reuse.recovery import recover

    cp = build_prompt(llm.tokenizer, QUESTION, DOCS)
    tokens = torch.tensor(cp.token_ids)
    n, hkv, layers = len(cp), llm.config.num_key_value_heads, llm.config.num_hidden_layers
    local = (torch.full((layers, hkv), 8), torch.full((layers, hkv), 2))
    full = (torch.full((layers, hkv), 1 << 30), torch.zeros(layers, hkv, dtype=torch.long))

    class Split(FixedSet):
        def query_split(self, layer):
            return cp.suffix_start, full[0][layer], full[1][layer]

    model = llm.model
    split = recover(model, tokens, Split(torch.arange(n), *local))
    first = recover(model, tokens, FixedSet(torch.arange(n), *local))
    cached = torch.arange(n) < cp.suffix_start
    two_pass = recover(model, tokens, FixedSet(torch.arange(cp.suffix_start, n), *full),
                       [k.clone() for k in first.k], [v.clone() for v in first.v], cached)
    assert torch.allclose(split.logits, two_pass.logits, atol=1e-5)
    assert cos(split.logits, first.logits) < 0.99999  # the suffix's visibility did change the answer
    # the executed attention counts each row under its own visibility
    assert split.flops.totals()["attention"] > first.flops.totals()["attention"]


def test_reuse_options_refuse_a_zero_shallow_window():
    from redknot.reuse.options import ReuseOptions

    with pytest.raises(ValueError, match="shallow_window"):
        ReuseOptions(shallow_window=0)  # 0 would silently mean the default window


def test_sparse_ffn_tiers_beside_the_checkpoint(tiny_checkpoint, tmp_path):
    """A checkpoint may carry its sparse-FFN tiers (sparse_ffn.json, like heads.json); an explicit
    argument wins, and a broken file is a clear error."""
    import shutil

    from redknot import LLM

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama", num_hidden_layers=3), ckpt)
    assert LLM(model=ckpt, device="cpu").sparse_ffn == SparseFFNConfig()  # none beside it: the defaults
    (ckpt / "sparse_ffn.json").write_text('{"dense_until": 1, "deep_layer_start": 2, "recent_n": 8, "min_keep": 4}')
    tiers = LLM(model=ckpt, device="cpu").sparse_ffn
    assert (tiers.dense_until, tiers.deep_layer_start, tiers.recent_n, tiers.min_keep) == (1, 2, 8, 4)
    assert LLM(model=ckpt, device="cpu", sparse_ffn=SPARSE).sparse_ffn == SPARSE
    (ckpt / "sparse_ffn.json").write_text('{"dense_until": -1}')
    with pytest.raises(HeadConfigError, match="dense_until"):
        LLM(model=ckpt, device="cpu")


def test_cross_chunk_mass_matches_a_direct_softmax():
    """Each row's mass on keys of other chunks (prefix = own context), in full-context heads only."""
    from redknot.reuse.recovery import cross_chunk_mass

    torch.manual_seed(0)
    n, hkv, g, d = 12, 2, 2, 8
    keys, q = torch.randn(n, hkv, d), torch.randn(n, hkv * g, d)
    chunk_id = torch.tensor([-1, -1, 0, 0, 0, 1, 1, 1, 2, 2, -1, -1])  # prefix, 3 chunks, suffix
    window, sink = torch.tensor([n, 3]), torch.tensor([0, 1])  # head 0 sees everything, head 1 does not
    pos = torch.arange(n)
    got = cross_chunk_mass(q, pos, keys, window, sink, 0.5, chunk_id)
    for r in range(n):
        if chunk_id[r] < 0:
            assert got[r] == 0
            continue
        p = (q[r, :g] @ keys[:r + 1, 0].T * 0.5).softmax(-1)  # the query heads of KV head 0
        other = (chunk_id[:r + 1] >= 0) & (chunk_id[:r + 1] != chunk_id[r])
        torch.testing.assert_close(got[r], (p * other).sum(-1).mean())
    assert (got[2:5] == 0).all() and (got[5:10] > 0).all()  # the first chunk has no other chunk before it


@pytest.mark.parametrize("n,d,n_chunks,rows", [(40, 8, 3, "all"), (40, 4, 9, "all"), (60, 8, 5, "few"),
                                                 (33, 4, 12, "few")])
def test_cross_chunk_mass_as_attention_matches_the_softmax(n, d, n_chunks, rows):
    """The one-hot-values path (no score matrix) against the materialised softmax, on random
    layouts: all rows or a few (explicit mask), chunk ids over one or several D-column groups."""
    from redknot.reuse.recovery import _cross_mass_blocked, cross_chunk_mass

    gen = torch.Generator().manual_seed(n + d + n_chunks)
    hkv, g = 2, 3
    keys, q = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv * g, d, generator=gen)
    cuts = sorted(torch.randperm(n - 4, generator=gen)[:n_chunks - 1].add(2).tolist())
    chunk_id = torch.full((n,), -1)
    for c, (a, b) in enumerate(zip([2] + cuts, cuts + [n - 2])):
        chunk_id[a:b] = c
    pos = torch.arange(n) if rows == "all" else torch.sort(torch.randperm(n, generator=gen)[:n // 3]).values
    window, sink = torch.tensor([n, 5]), torch.tensor([0, 2])
    got = cross_chunk_mass(q[pos], pos, keys, window, sink, 0.3, chunk_id)
    # the reference over the full-context head alone: its keys and query heads, every head global
    want = _cross_mass_blocked(q[pos][:, :g], pos, keys[:, :1], torch.tensor([n]), torch.tensor([0]), 0.3, chunk_id)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert (got[chunk_id[pos] < 0] == 0).all()


def test_cross_chunk_mass_without_a_full_context_head_uses_each_heads_window():
    from redknot.reuse.recovery import cross_chunk_mass

    torch.manual_seed(1)
    n, d = 16, 4
    keys, q = torch.randn(n, 1, d), torch.randn(n, 2, d)
    chunk_id = torch.tensor([-1] * 2 + [0] * 7 + [1] * 7)
    got = cross_chunk_mass(q, torch.arange(n), keys, torch.tensor([4]), torch.tensor([1]), 0.5, chunk_id)
    r = 15  # sees sink key 0 and keys 12..15, all in its own chunk or the prefix
    assert got[r] == 0
    r = 10  # sees key 0 and keys 7..10: keys 7, 8 are in chunk 0
    p = (q[r] @ keys[[0, 7, 8, 9, 10], 0].T * 0.5).softmax(-1)
    torch.testing.assert_close(got[r], p[:, 1:3].sum(-1).mean())


def test_chunk_importance_keeps_whole_chunks_first():
    """importance "chunk": a chunk's rows rank by the chunk's mean cross-chunk mass, so the share kept
    takes whole chunks; "cross" would take one row of each chunk's best rows instead."""
    cross = torch.tensor([0.9, 0.0, 0.1, 0.1, 0.5, 0.0])
    chunk_id = torch.tensor([0, 0, 1, 1, 2, -1])  # means: chunk 0 0.45, chunk 1 0.1, chunk 2 0.5; a suffix row
    score = chunk_ranked(cross, chunk_id)
    assert rank_descending(score[:5])[:3].sort().values.tolist() == [0, 1, 4]  # chunks 2 and 0, whole
    assert rank_descending(cross[:5])[:3].sort().values.tolist() == [0, 3, 4]  # by row: chunk 0 split
    assert score[5] == 0  # outside chunks: its own score

    is_chunk = chunk_id >= 0
    vis = torch.zeros(2, 1, dtype=torch.long)
    got = {}
    for imp in ("cross", "chunk"):
        policy = RedKnot(torch.arange(6), vis, vis, vis, vis, is_chunk,
                         SparseFFNConfig(dense_until=0, recent_n=0, min_keep=1, importance=imp, keep_fraction=0.6),
                         0, keep_cached=True, chunk_id=chunk_id)
        got[imp] = policy.ffn_rows(0, torch.arange(6), {"cross": cross}).tolist()
    assert got == {"cross": [0, 3, 4, 5], "chunk": [0, 1, 4, 5]}  # ceil(0.6 * 5) = 3 chunk rows + the suffix row
    assert SparseFFNConfig(importance="chunk").importance == "chunk"


def test_chunk_start_tokens_are_kept_first():
    """chunk_start_tokens: each chunk's first N rows go through the FFN; under keep_fraction they
    take the first places of its count, the rest by score; under the mass tiers they are added."""
    chunk_id = torch.tensor([-1, 0, 0, 0, 1, 1, 1, 1, 2, 2, -1, -1])
    assert chunk_start_rows(chunk_id, 2).nonzero().flatten().tolist() == [1, 2, 4, 5, 8, 9]
    assert chunk_start_rows(chunk_id, 0).sum() == 0
    is_chunk = chunk_id >= 0
    mass = torch.tensor([0.0, 0.0, 0.0, 0.9, 0.0, 0.0, 0.5, 0.8, 0.0, 0.0, 0.1, 0.1])
    vis = torch.zeros(2, 1, dtype=torch.long)
    pos = torch.arange(12)

    def rows(**kw):
        sp = SparseFFNConfig(dense_until=0, recent_n=0, min_keep=1, **kw)
        policy = RedKnot(pos, vis, vis, vis, vis, is_chunk, sp, 0, keep_cached=True, chunk_id=chunk_id)
        return policy.ffn_rows(0, pos, {"mass": mass}).tolist()

    # ceil(0.5 * 9) = 5 chunk rows: by mass 3, 7, 6, then two of the zeros (ties: the later row first)
    assert rows(keep_fraction=0.5) == [0, 3, 6, 7, 8, 9, 10, 11]
    # each chunk's first row first (1, 4, 8), then the two heaviest (3, 7)
    assert rows(keep_fraction=0.5, chunk_start_tokens=1) == [0, 1, 3, 4, 7, 8, 10, 11]
    tiers = rows(mass_thresh=0.5)  # rows covering half the chunk mass: 3 (0.9 of 2.2) and 7
    assert tiers == [0, 3, 7, 10, 11]
    assert rows(mass_thresh=0.5, chunk_start_tokens=1) == [0, 1, 3, 4, 7, 8, 10, 11]
    with pytest.raises(HeadConfigError, match="chunk_start_tokens"):
        SparseFFNConfig(chunk_start_tokens=-1)


def test_keep_fraction_picks_a_fixed_share_once(tiny_checkpoint):
    """keep_fraction: the first sparse layer keeps that share of the recomputed chunk tokens (cross
    ranking), redknot keeps that set; keep_fraction 1 is every token through every FFN."""
    prompt = None
    got = {}
    for frac in (0.5, 1.0):
        sparse = SparseFFNConfig(dense_until=1, deep_layer_start=3, recent_n=4, min_keep=1, importance="cross",
                                 keep_fraction=frac)
        llm = LLM(model=tiny_checkpoint("llama", num_hidden_layers=3), device="cpu", page_size=16, sparse_ffn=sparse,
                  head_config=HeadConfig.synthetic(3, 2, 0.5, window=16, sink=4))
        prompt = build_prompt(llm.tokenizer, QUESTION, DOCS)
        got[frac] = {m: (llm.first_token_logits(QUESTION, documents=DOCS, method=m),
                         reuse_oracle(llm).prefill(prompt, m).recovered.flops) for m in ("redknot", "redknot_paper")}
    body = len(prompt.token_ids) - prompt.chunk_starts[1]  # rows recomputed: chunks 1.. and the suffix
    assert len(prompt.suffix) >= 4  # the last recent_n rows are suffix rows: every chunk row is a candidate
    cand = sum(len(c) for c in prompt.chunks[1:])
    half = got[0.5]["redknot"][1]
    assert half.tokens[0] == body and half.ffn_tokens[1] == body - cand + -(-cand // 2)
    assert half.tokens[2] == half.ffn_tokens[1] and half.ffn_tokens[2] == half.tokens[2]  # chosen once
    assert got[0.5]["redknot_paper"][1].ffn_tokens[1:] == [half.ffn_tokens[1]] * 2  # re-ranked, same count
    full = got[1.0]["redknot"][1]
    assert full.ffn_tokens == full.tokens == [body] * 3
    torch.testing.assert_close(got[1.0]["redknot"][0], got[1.0]["redknot_paper"][0])  # nothing left out: same forward
    with pytest.raises(HeadConfigError, match="keep_fraction"):
        SparseFFNConfig(keep_fraction=0)
    with pytest.raises(HeadConfigError, match="importance"):
        SparseFFNConfig(importance="crossed")

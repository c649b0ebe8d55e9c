"""Asynchronous tier loads: a request whose documents are below the pool waits (WAITING_FOR_KV)
while they load on the loader's thread, and the running requests keep decoding; the loaded request
answers what a cold run does. Per-head fetches read only the heads the request's plan can see and
answer what an all-heads fetch does. A failing or slow tier costs a recompute, never a request."""

import os
import time

import pytest
import torch

from redknot import LLM, SamplingParams
from redknot.engine.sequence import SequenceStatus
from redknot.testbed.records import generate_records

DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")  # on a GPU: pinned buffers, side streams, events
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def request_docs():
    r = generate_records(11, 1, context_tokens=160, questions_per_context=1, types=("single_hop",))[0]
    return r["question"], r["documents"]


def _run(engine, seq):
    engine.add_request(seq)
    while engine.has_unfinished():
        engine.step()
    return seq.output_token_ids


def _slow(tier, seconds: float):
    """Every read of ``tier`` takes ``seconds`` longer (on the loader's thread)."""
    get = tier.get

    def slow_get(*a, **kw):
        time.sleep(seconds)
        return get(*a, **kw)
    tier.get = slow_get


def test_a_running_request_decodes_while_documents_load(request_docs):
    question, docs = request_docs
    llm = LLM(device=DEVICE, kv_offload={"cpu_bytes": 256 << 20})
    engine = llm.engine
    cold = _run(engine, llm.make_sequence(question, GREEDY, docs, "full_reuse"))  # computes every document
    engine.chunk_cache.evict(llm.pool.num_pages)  # every document now only in the CPU tier
    assert len(engine.chunk_cache) == 0
    _slow(engine.kv_tiers.cpu, 0.25)
    runner = llm.make_sequence("a long answer", SamplingParams(max_tokens=400, ignore_eos=True), method="dense")
    engine.add_request(runner)
    engine.step()
    loaded = llm.make_sequence(question, GREEDY, docs, "full_reuse")
    engine.add_request(loaded)
    steps_while_loading, tokens_before = 0, len(runner.output_token_ids)
    engine.step()
    assert loaded.status == SequenceStatus.WAITING_FOR_KV and loaded in engine.scheduler.loading
    while loaded.status == SequenceStatus.WAITING_FOR_KV:
        engine.step()
        steps_while_loading += 1
    assert len(runner.output_token_ids) - tokens_before >= 3  # decoding went on during the load
    while not loaded.finished:
        engine.step()
    assert loaded.output_token_ids == cold
    assert loaded.cached_tokens > 0
    stats = engine.chunk_cache.stats()["tiers"]
    assert stats["loader"]["loaded"] == len(docs) + 1 and stats["hits"]["cpu"] == len(docs) + 1
    engine.abort(runner)
    engine.clear_caches()
    assert llm.pool.num_free_pages == llm.pool.num_pages


def test_an_aborted_load_gives_its_pages_back_and_a_failed_one_computes(request_docs):
    question, docs = request_docs
    llm = LLM(device=DEVICE, kv_offload={"cpu_bytes": 256 << 20, "load_timeout_s": 0.2})
    engine = llm.engine
    first = _run(engine, llm.make_sequence(question, GREEDY, docs, "full_reuse"))
    engine.chunk_cache.evict(llm.pool.num_pages)
    _slow(engine.kv_tiers.cpu, 0.5)  # slower than the load timeout
    seq = llm.make_sequence(question, GREEDY, docs, "full_reuse")
    assert _run(engine, seq) == first  # given up: computed, the same tokens
    assert engine.chunk_cache.stats()["tiers"]["loader"]["timed_out"] == 1 and seq.cached_tokens == 0
    engine.chunk_cache.evict(llm.pool.num_pages)
    # the given-up reads still hold the loader's thread: let them end, or the next job times out behind them
    time.sleep(0.5 * (len(docs) + 1))
    engine.kv_tiers.cpu.get = lambda *a, **kw: 1 / 0  # a tier bug
    assert _run(engine, llm.make_sequence(question, GREEDY, docs, "full_reuse")) == first
    assert engine.chunk_cache.stats()["tiers"]["loader"]["failed"] > 0
    engine.chunk_cache.evict(llm.pool.num_pages)
    del engine.kv_tiers.cpu.get
    _slow(engine.kv_tiers.cpu, 0.05)
    seq = llm.make_sequence(question, GREEDY, docs, "full_reuse")
    engine.add_request(seq)
    engine.step()
    assert seq.status == SequenceStatus.WAITING_FOR_KV
    time.sleep(0.1 * (len(docs) + 1))
    engine.abort(seq)
    engine.clear_caches()
    assert not engine.has_unfinished() and llm.pool.num_free_pages == llm.pool.num_pages


def test_per_head_fetch_reads_only_visible_heads_and_answers_the_same(tiny_checkpoint, request_docs):
    """Gemma 3: five sliding-window layers (window 8) of six. Documents far from the question are
    seen by the global layer only: a per-head fetch reads a sixth of their bytes."""
    question, docs = request_docs
    path = tiny_checkpoint("gemma3_text")
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, return_first_logits=True)
    out = {}
    for per_head in (False, True):
        llm = LLM(model=path, device=DEVICE, page_size=16, kv_offload={"cpu_bytes": 256 << 20, "per_head_fetch": per_head})
        cold = llm.generate(question, params, documents=docs, method="full_reuse")[0]
        llm.chunk_cache.evict(llm.pool.num_pages)
        again = llm.generate(question, params, documents=docs, method="full_reuse")[0]
        stats = llm.chunk_cache.stats()["tiers"]["loader"]
        assert again.metrics["cached_tokens"] > 0 and stats["loaded"] > 0
        assert again.outputs[0].token_ids == cold.outputs[0].token_ids
        out[per_head] = (again.outputs[0].token_ids, again.first_token_logits, stats)
        llm.engine.clear_caches()
        assert llm.pool.num_free_pages == llm.pool.num_pages  # private partial entries given back
    assert out[True][0] == out[False][0]
    assert torch.equal(out[True][1], out[False][1])  # unseen heads zeroed: not a bit of difference
    whole, part = out[False][2], out[True][2]
    assert whole["bytes_fetched"] == whole["bytes_whole"] and whole["partial"] == 0
    assert part["partial"] > 0 and part["bytes_fetched"] < 0.75 * part["bytes_whole"]
    assert part["bytes_whole"] == whole["bytes_whole"]


def test_metrics_report_bytes_fetched_against_whole_entries(request_docs):
    from redknot.serve.metrics import ServerMetrics

    from test_kv_tiers_engine import MODEL_NAME, _Front

    question, docs = request_docs
    llm = LLM(device=DEVICE, kv_offload={"cpu_bytes": 256 << 20})
    llm.generate(question, GREEDY, documents=docs, method="full_reuse")
    llm.chunk_cache.evict(llm.pool.num_pages)
    llm.generate(question, GREEDY, documents=docs, method="full_reuse")
    text = ServerMetrics(_Front(llm), MODEL_NAME).render().decode()
    loader = llm.chunk_cache.stats()["tiers"]["loader"]
    assert loader["bytes_whole"] > 0
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("redknot:kv_tier_") and "{" in line}
    assert values["redknot:kv_tier_load_bytes_fetched_total"] == loader["bytes_fetched"]
    assert values["redknot:kv_tier_load_bytes_whole_total"] == loader["bytes_whole"]
    assert values["redknot:kv_tier_downs_dropped_total"] == 0

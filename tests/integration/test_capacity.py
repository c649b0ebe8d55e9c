"""Head-aware capacity: admission never over-commits the pool, whatever the mix of requests, and
the capacity benchmark runs end to end (on the CPU, on a tiny architecture)."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from redknot import LLM, HeadConfig, SamplingParams
from redknot.bench import capacity
from redknot.engine.scheduler import RequestTooLarge

WORDS = "the salt trade of varna kept ledgers maps letters rivers founders archive surveyors delta".split()


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    hc = HeadConfig.synthetic(2, 2, 0.5, window=16, sink=4)
    return LLM(model=tiny_checkpoint("llama", num_hidden_layers=2), device="cpu", head_config=hc, page_size=8,
               max_num_seqs=6, max_num_batched_tokens=48)


request = st.tuples(st.sampled_from(["dense", "headsparse", "full_reuse", "epic", "redknot"]),
                    st.integers(3, 40),  # question words
                    st.lists(st.integers(0, 3), max_size=3),  # documents, from a shared set of four
                    st.integers(1, 12))  # max_tokens


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(request, min_size=1, max_size=8), st.integers(60, 200), st.booleans())
def test_admission_never_overcommits_and_every_page_comes_back(llm, mix, pages, reserve):
    engine = llm.engine
    engine.cfg.reserve_full_length = reserve  # reserved full lengths, or optimistic admission + preemption
    engine.resize_pool(pages * 4)  # 4 (layer, KV head) pairs: `pages` per head
    docs = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(12 + 5 * i)) for i in range(4)]
    seqs = []
    for k, (method, n_words, doc_ids, max_tokens) in enumerate(mix):
        prompt = " ".join(WORDS[(k + j) % len(WORDS)] for j in range(n_words))
        seq = llm.make_sequence(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                [docs[i] for i in doc_ids] or None, method)
        try:
            engine.add_request(seq)
        except RequestTooLarge as e:  # refused up front, with the numbers; nothing was queued
            assert "pages" in str(e) or "max_model_len" in str(e)
            continue
        seqs.append(seq)
    total = engine.pool.num_pages
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
        held = sum(engine.pool.pages_held(s.seq_id) for s in engine.running)
        assert 0 <= engine.pool.num_free_pages <= total
        assert len(engine.running) <= engine.max_num_seqs
        assert held + engine.pool.num_free_pages >= 0
    assert not engine.has_unfinished(), "the engine stopped making progress"
    for s in seqs:  # every admitted request finishes with all its tokens, none fails for want of pages
        assert s.error is None and len(s.output_token_ids) == s.params.max_tokens, (s.method, s.error)
        assert s.num_preemptions == 0 or not reserve
    assert engine.scheduler.committed == 0
    engine.clear_caches()
    assert engine.pool.num_free_pages == total


def test_the_capacity_benchmark_runs_on_a_tiny_architecture(tmp_path, capsys):
    out = tmp_path / "cap.json"
    capacity.main(["--archs", "tiny", "--contexts", "256", "--page-size", "16", "--methods", "dense,redknot", "--head-configs",
                   "g50-w32", "--decode-tokens", "4", "--doc-tokens", "32", "--pool-docs", "6",
                   "--max-sessions", "3", "--device", "cpu", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"dense", "redknot"}
    for r in rows.values():
        assert r["errors"] == [] and r["pool_idle_after"] and r["sessions_peak"] == 3
        assert r["bound_sessions"] >= 3 and r["decode_tok_s"] > 0
    # the head plan keeps fewer pages per session than the all-global one
    assert rows["redknot"]["pages_per_session"] < rows["dense"]["pages_per_session"]
    assert "sessions" in capsys.readouterr().out and torch.isfinite(torch.tensor(rows["dense"]["ttft_p50_s"]))


def test_admission_reserves_at_most_reserve_decode_tokens(llm):
    """A request that leaves max_tokens to the context's rest (the OpenAI default) does not hold
    a whole context's pages at admission."""
    engine = llm.engine
    short = llm.make_sequence("a short prompt", SamplingParams(max_tokens=8), None, "dense")
    huge = llm.make_sequence("a short prompt", SamplingParams(max_tokens=100_000), None, "dense")
    capped = engine.scheduler.steady_pages(huge)
    assert engine.scheduler.steady_pages(short) < capped
    assert capped == engine.pool.peak_pages(len(huge.token_ids) + engine.cfg.reserve_decode_tokens, 1, "dense")

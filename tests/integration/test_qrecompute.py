"""Query-guided recomputation (``qrecompute``) and KV correction: exactness at a full budget, the
engine's batched recovery against the reference forward, the ranking, FLOPs and the correction."""

import dataclasses

import pytest
import torch

from redknot import LLM, HeadConfig, SamplingParams
from redknot.config import SparseFFNConfig
from redknot.engine.documents import dummy_token
from redknot.models.config import ModelConfig
from redknot.models.rope import RotaryEmbedding
from redknot.reuse.correction import KVCorrection, chunk_offsets, corrected
from redknot.reuse.flops import FlopReport
from redknot.reuse.options import ReuseOptions
from redknot.reuse.policies import QueryRecompute, QuestionScores, RedKnot, query_ranked_rows
from redknot.reuse.prompt import build_prompt
from redknot.reuse.registry import parse_method
from redknot.visibility import visible_pairs
from oracles.reuse_engine import reuse_oracle

DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120. " * 2,
        "Attention heads differ: some look far back, most look at recent tokens. " * 2,
        "The quick brown fox jumps over the lazy dog near the old mill. " * 2]
QUESTION = "Question: who founded the city of Varna? Answer:"


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint("llama", num_hidden_layers=4), device="cpu", page_size=16,
               head_config=HeadConfig.synthetic(4, 2, 0.5, window=16, sink=4))


def _options(llm, **kw):
    docs = llm.engine.documents
    saved = docs.options
    docs.options = dataclasses.replace(saved, **kw)
    return saved


def _first(llm, question, docs, method):
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_first_logits=True)
    return llm.generate(question, params, documents=docs, method=method)[0]


@pytest.mark.parametrize("spec", ["qrecompute@1.0", "qrecompute@1.0+kc", "qrecompute@1.0+qp+kc"])
def test_full_budget_equals_dense(llm, spec):
    dense = llm.first_token_logits(QUESTION, documents=DOCS, method="dense")
    out = llm.first_token_logits(QUESTION, documents=DOCS, method=spec)
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = llm.generate(QUESTION, params, documents=DOCS, method="dense")[0].outputs[0].token_ids
    assert llm.generate(QUESTION, params, documents=DOCS, method=spec)[0].outputs[0].token_ids == ref


@pytest.mark.parametrize("correct", [False, True])
def test_engine_batch_equals_the_reference_forward(llm, correct):
    """Three requests in one batched recovery give the reference forward's logits and FLOPs, one at a
    time, with and without KV correction (which moves the logits)."""
    saved = _options(llm, qrecompute_ratio=0.3, qrecompute_start_tokens=2, kv_correction=correct)
    try:
        llm.engine.clear_caches()
        orders = [DOCS, DOCS[::-1], [DOCS[1], DOCS[0]]]
        questions = [QUESTION, "Question: what jumps over the dog?", QUESTION]
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_first_logits=True)
        outs = llm.generate(questions, params, documents=orders, method="qrecompute")
        for o, q, docs in zip(outs, questions, orders):
            oracle = reuse_oracle(llm).prefill(build_prompt(llm.tokenizer, q, docs), "qrecompute").recovered
            torch.testing.assert_close(o.first_token_logits, oracle.logits, rtol=1e-4, atol=1e-4)
            assert o.metrics["flops"] == oracle.flops.totals()
            assert o.metrics["flops"]["scoring"] > 0
        assert llm.engine.request_kv_bytes() == 0
        if correct:  # the correction is live: the same request without it answers with other logits
            _options(llm, kv_correction=False)
            plain = reuse_oracle(llm).prefill(build_prompt(llm.tokenizer, QUESTION, DOCS), "qrecompute").recovered
            assert not torch.allclose(plain.logits, outs[0].first_token_logits, atol=1e-5)
    finally:
        llm.engine.documents.options = saved


@pytest.mark.parametrize("correct", [False, True])
def test_question_pass_in_the_engine_equals_the_reference_forward(llm, correct):
    """``+qp``: the batch's scoring pass (the questions alone over the placed K/V), then the rows it
    ranks from layer 0: the engine gives the reference forward's logits and FLOPs, and the rows
    differ from those ranked at a layer (the logits move)."""
    saved = _options(llm, qrecompute_ratio=0.3, qrecompute_start_tokens=2, question_pass=True,
                     kv_correction=correct)
    try:
        outs = _batch_equals_the_oracle(llm, "qrecompute")
        _options(llm, question_pass=False)
        at_layer = reuse_oracle(llm).prefill(build_prompt(llm.tokenizer, QUESTION, DOCS), "qrecompute").recovered
        assert not torch.allclose(at_layer.logits, outs[0].first_token_logits, atol=1e-5)
    finally:
        llm.engine.documents.options = saved


def test_question_pass_flops_and_rows(llm):
    """The question pass's FLOPs: the question's rows through every layer and its q·k over every key
    at every layer; then the chosen rows (the ratio of the recovered chunk rows, and the question)
    through every layer. The rows chosen are those the pass's summed shares rank highest."""
    saved = _options(llm, qrecompute_ratio=0.25, qrecompute_start_tokens=0, question_pass=True)
    try:
        prompt = build_prompt(llm.tokenizer, QUESTION, DOCS)
        oracle = reuse_oracle(llm)
        flops = oracle.prefill(prompt, "qrecompute").recovered.flops
        policy, _ = oracle.policy(prompt, "qrecompute")
    finally:
        llm.engine.documents.options = saved
    cfg, L = llm.config, llm.config.num_hidden_layers
    n_q = len(prompt.suffix)
    n_kept = round(0.25 * sum(len(c) for c in prompt.chunks[1:])) + n_q
    assert flops.tokens == [n_q + n_kept] * L  # the pass's question rows and the recovery's rows, per layer
    assert flops.scoring == L * 2 * n_q * len(prompt) * cfg.num_attention_heads * cfg.head_dim
    assert flops.lm_head == 2 * 2 * cfg.hidden_size * cfg.vocab_size  # each forward's last row
    scorer = policy.scoring_pass()
    assert scorer.positions.tolist() == list(range(prompt.suffix_start, len(prompt)))
    # from layer 2 on: the lower layers' attention is neither computed nor counted
    saved = _options(llm, qrecompute_ratio=0.25, qrecompute_start_tokens=0, question_pass=True,
                     question_pass_from=2)
    try:
        late = reuse_oracle(llm).prefill(prompt, "qrecompute").recovered.flops
    finally:
        llm.engine.documents.options = saved
    assert late.scoring == (L - 2) * 2 * n_q * len(prompt) * cfg.num_attention_heads * cfg.head_dim
    assert late.tokens == flops.tokens
    assert policy.scoring_pass() is scorer and scorer.score is None  # a fresh policy: no pass run yet
    with pytest.raises(ValueError, match="scoring pass"):
        policy.initial()


def test_question_scores_give_every_layer_the_same_say():
    is_chunk = torch.tensor([False, True, True, True, False])
    vis = torch.full((2, 1), 64), torch.zeros(2, 1, dtype=torch.long)
    s = QuestionScores(torch.tensor([4]), *vis, is_chunk, 1)
    assert s.observe(0) == s.observe(1) == 1
    cur = torch.tensor([4])
    assert s.keep_rows(0, cur, {"mass": torch.tensor([10.0, 1, 1, 2, 0])}) is None  # shares of the chunk mass
    s.keep_rows(1, cur, {"mass": torch.tensor([0.0, 0.3, 0.0, 0.0, 0.7])})
    torch.testing.assert_close(s.score, torch.tensor([2.5, 0.25, 0.25, 0.5, 0.0]) + torch.tensor([0.0, 1, 0, 0, 7 / 3]))
    p = QueryRecompute(torch.arange(1, 5), *vis, is_chunk, torch.where(is_chunk, 0, -1), 1 / 3, 0, 1, 0, scorer=s)
    assert p.initial().tolist() == [1, 4]  # the chunk row ranked highest, and the question
    assert p.observe(0) == 0 and p.keep_rows(0, torch.arange(1, 5), {}) is None
    s.keep_rows(0, cur, {"mass": torch.tensor([10.0, 1, 1, 2, 0])})  # the pass again (a preempted recovery)
    torch.testing.assert_close(s.score, torch.tensor([2.5, 0.25, 0.25, 0.5, 0.0]))  # scored afresh
    late = QuestionScores(torch.tensor([4]), *vis, is_chunk, 1, from_layer=1)
    assert (late.observe(0), late.observe(1)) == (0, 1)
    assert late.keep_rows(0, cur, {"mass": None}) is None and late.score is None  # layer 0 does not count
    late.keep_rows(1, cur, {"mass": torch.tensor([0.0, 0.3, 0.0, 0.0, 0.7])})
    torch.testing.assert_close(late.score, torch.tensor([0.0, 1, 0, 0, 7 / 3]))


def test_flops_count_the_scoring_pass(llm):
    """Every body row up to the scoring layer, the kept rows after it, plus the scoring's q·k."""
    saved = _options(llm, qrecompute_ratio=0.25, qrecompute_layer=1, qrecompute_start_tokens=0)
    try:
        prompt = build_prompt(llm.tokenizer, QUESTION, DOCS)
        policy, _ = reuse_oracle(llm).policy(prompt, "qrecompute")
        flops = reuse_oracle(llm).prefill(prompt, "qrecompute").recovered.flops
    finally:
        llm.engine.documents.options = saved
    cfg = llm.config
    body = torch.arange(prompt.chunk_starts[1], len(prompt))
    n_chunk = sum(len(c) for c in prompt.chunks[1:])
    n_kept = round(0.25 * n_chunk) + len(prompt.suffix)
    assert flops.tokens == [body.numel()] * 2 + [n_kept] * 2
    n_obs = min(llm.engine.documents.options.observation_tokens, len(prompt.suffix))
    assert flops.scoring == 2 * n_obs * len(prompt) * cfg.num_attention_heads * cfg.head_dim
    ref = FlopReport()
    w = torch.full((cfg.num_key_value_heads,), len(prompt) + 1)
    s = torch.zeros(cfg.num_key_value_heads, dtype=torch.long)
    for _ in range(2):  # the scoring pass: every body row, every head global
        ref.add_layer(cfg, body.numel(), visible_pairs(body, w, s, cfg.num_kv_groups), body.numel())
    assert flops.proj[:2] == ref.proj and flops.attention[:2] == ref.attention
    assert flops.totals()["total"] == sum(flops.proj) + sum(flops.attention) + sum(flops.ffn) + flops.lm_head + flops.scoring


def test_query_ranked_rows():
    score = torch.tensor([0.0, 0.9, 0.1, 0.5, 0.3, 0.2, 0.0, 0.7])
    is_chunk = torch.tensor([True, True, True, True, True, True, False, False])
    first = torch.tensor([True, False, False, False, False, False, False, False])
    # 6 chunk rows at 0.5: 3 of them, the chunk start first, then 0.9 and 0.5; the 2 non-chunk rows always
    assert query_ranked_rows(score, is_chunk, first, 0.5).tolist() == [0, 1, 3, 6, 7]
    assert query_ranked_rows(score, is_chunk, torch.zeros(8, dtype=torch.bool), 0.5).tolist() == [1, 3, 4, 6, 7]
    assert query_ranked_rows(score, is_chunk, first, 1.0).tolist() == list(range(8))
    assert query_ranked_rows(score, is_chunk, first, 0.0).tolist() == [6, 7]
    tie = torch.zeros(8)  # equal scores: the later rows (nearer the question)
    assert query_ranked_rows(tie, is_chunk, torch.zeros(8, dtype=torch.bool), 0.34).tolist() == [4, 5, 6, 7]


def test_policy_ranks_by_the_observed_mass_at_its_layer():
    n = 10
    is_chunk = torch.tensor([False] + [True] * 7 + [False] * 2)
    chunk_id = torch.where(is_chunk, 0, -1)
    vis = torch.full((2, 1), 64), torch.zeros(2, 1, dtype=torch.long)
    p = QueryRecompute(torch.arange(1, n), *vis, is_chunk, chunk_id, 2 / 7, 1, 2, 1)
    assert (p.observe(0), p.observe(1)) == (0, 2)
    mass = torch.tensor([9.0, 0, 0.1, 0.8, 0.2, 0.9, 0.3, 0.1, 5, 5])
    cur = torch.arange(1, n)
    assert p.keep_rows(0, cur, {"mass": mass}) is None
    assert cur[p.keep_rows(1, cur, {"mass": mass})].tolist() == [1, 5, 8, 9]  # chunk start, then mass 0.9


def test_parse_method():
    assert parse_method("qrecompute@0.3") == ("qrecompute", {"qrecompute_ratio": 0.3})
    kc = {"kv_correction": True, "kv_correction_values": True, "kv_correction_scale": 1.0}
    kck = {**kc, "kv_correction_values": False}
    assert parse_method("qrecompute@0.2+s8+kc") == ("qrecompute", {"qrecompute_ratio": 0.2,
                                                                   "qrecompute_start_tokens": 8, **kc})
    assert parse_method("cacheblend@0.15+kc") == ("cacheblend", {"cacheblend_ratio": 0.15, **kc})
    assert parse_method("cacheblend@0.15+kck") == ("cacheblend", {"cacheblend_ratio": 0.15, **kck})
    assert parse_method("redknot_kv@0.2+s16+kc") == ("redknot", {"keep_fraction": 0.2, "chunk_start_tokens": 16, **kc})
    assert parse_method("qrecompute@0.25+kc+dp4") == ("qrecompute", {"qrecompute_ratio": 0.25, **kc,
                                                                     "dummy_prefix_tokens": 4})
    assert parse_method("cacheblend@0.15+kc0.5") == ("cacheblend", {"cacheblend_ratio": 0.15, **kc,
                                                                     "kv_correction_scale": 0.5})
    assert parse_method("redknot@0.2+s16+kck.25") == ("redknot", {"keep_fraction": 0.2, "chunk_start_tokens": 16,
                                                                  **kck, "kv_correction_scale": 0.25})
    assert parse_method("epic@16+dp2") == ("epic", {"epic_tokens": 16, "dummy_prefix_tokens": 2})
    qp = {"question_pass": True, "question_pass_from": 0}
    assert parse_method("qrecompute@0.25+qp+kc0.5") == ("qrecompute", {"qrecompute_ratio": 0.25, **qp,
                                                                       **kc, "kv_correction_scale": 0.5})
    assert parse_method("qrecompute@0.3+qp6") == ("qrecompute", {"qrecompute_ratio": 0.3, **qp,
                                                                 "question_pass_from": 6})
    for bad in ("qrecompute@0.3+qpx", "qrecompute@0.3+qp-1"):
        with pytest.raises(ValueError, match="question pass"):
            parse_method(bad)
    assert parse_method("redknot@0.2+s16+qp") == ("redknot", {"keep_fraction": 0.2, "chunk_start_tokens": 16, **qp})
    with pytest.raises(ValueError, match="question pass"):
        parse_method("cacheblend@0.3+qp")
    for bad in ("qrecompute@1.5", "qrecompute@0.3+x", "epic@16+kc", "epic@16+kck", "redknot_paper@0.3+kc", "cacheblend@0.3+s16",
                "cacheblend@0.3+dp0", "cacheblend@0.3+dp", "cacheblend@0.3+kc0", "cacheblend@0.3+kc1.5",
                "cacheblend@0.3+kc.", "cacheblend@0.3+kcx", "epic@16+kc0.5"):
        with pytest.raises(ValueError):
            parse_method(bad)
    with pytest.raises(ValueError, match="kv_correction_scale"):
        ReuseOptions(kv_correction_scale=0.0)


def _rope():
    cfg = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 64,
                                 "vocab_size": 32, "rope_theta": 10000.0})
    return RotaryEmbedding(cfg)


def test_correction_recovers_a_constant_unrotated_shift():
    """Keys recomputed = cached + a per-chunk, per-head constant before RoPE (values: after): a few
    probes give the rest of each chunk exactly their recomputed K/V."""
    torch.manual_seed(0)
    rope = _rope()
    n, h, d = 12, 2, 16
    pos = torch.arange(n) + 5
    chunk = torch.tensor([0] * 6 + [1] * 6)
    raw_k, v = torch.randn(n, h, d), torch.randn(n, h, d)
    shift_k, shift_v = torch.randn(2, h, d), torch.randn(2, h, d)
    old_k = rope.rotate(raw_k, pos)
    new_k, new_v = rope.rotate(raw_k + shift_k[chunk], pos), v + shift_v[chunk]
    probe = torch.tensor([0, 3, 7])
    rest = torch.tensor([1, 2, 4, 5, 6, 8, 9, 10, 11])
    off = chunk_offsets(new_k[probe], old_k[probe], new_v[probe], v[probe], pos[probe], chunk[probe], 2, rope.relocate)
    k_fix, v_fix = corrected(old_k[rest], v[rest], pos[rest], chunk[rest], off, rope.relocate)
    torch.testing.assert_close(k_fix, new_k[rest], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_fix, new_v[rest], rtol=1e-5, atol=1e-5)
    k_only, v_kept = corrected(old_k[rest], v[rest], pos[rest], chunk[rest], off, rope.relocate, values=False)
    assert torch.equal(k_only, k_fix) and torch.equal(v_kept, v[rest])  # keys only: values as cached
    # a share of the offset: half way from the cache to the recomputed K/V (RoPE is linear)
    k_half, v_half = corrected(old_k[rest], v[rest], pos[rest], chunk[rest], off, rope.relocate, scale=0.5)
    torch.testing.assert_close(k_half, (old_k[rest] + new_k[rest]) / 2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_half, (v[rest] + new_v[rest]) / 2, rtol=1e-5, atol=1e-5)
    # probes = every token: each token's own offset is its chunk's mean only when the shift is constant;
    # a chunk without a probe is left as it is
    off = chunk_offsets(new_k[:6], old_k[:6], new_v[:6], v[:6], pos[:6], chunk[:6], 2, rope.relocate)
    k_fix, v_fix = corrected(old_k, v, pos, chunk, off, rope.relocate)
    torch.testing.assert_close(k_fix[:6], new_k[:6], rtol=1e-5, atol=1e-5)
    assert torch.equal(k_fix[6:], old_k[6:]) and torch.equal(v_fix[6:], v[6:])


def test_correction_off_leaves_the_cache_as_placed(llm):
    """Without KV correction the K/V of the chunk tokens left out are the relocated cache, bit for
    bit; with it they move (and every token's KV is still finite); keys only ("+kck") moves the
    keys and leaves their values as placed."""
    prompt = build_prompt(llm.tokenizer, QUESTION, DOCS)
    outs = {}
    for correct in (False, True, "keys"):
        saved = _options(llm, qrecompute_ratio=0.3, qrecompute_start_tokens=2, kv_correction=bool(correct),
                         kv_correction_values=correct is True)
        try:
            oracle = reuse_oracle(llm)
            placed = oracle.prefill(prompt, "full_reuse").recovered  # the relocated chunk KV (layers' caches)
            outs[correct] = (placed, oracle.prefill(prompt, "qrecompute").recovered)
        finally:
            llm.engine.documents.options = saved
    placed, plain = outs[False]
    _, fixed = outs[True]
    rest = torch.arange(prompt.chunk_starts[1], prompt.suffix_start)
    last = len(plain.k) - 1
    left_out = rest[(plain.k[last][rest] == placed.k[last][rest]).all(-1).all(-1)]
    assert left_out.numel() >= 0.5 * rest.numel()  # 70% of those chunk rows are left out after layer 1
    assert not torch.equal(fixed.k[last][left_out], placed.k[last][left_out])
    assert not torch.equal(fixed.v[last][left_out], placed.v[last][left_out])
    assert all(bool(torch.isfinite(k).all()) for k in fixed.k)
    _, keys_only = outs["keys"]
    assert torch.equal(keys_only.k[last][left_out], fixed.k[last][left_out])  # same offsets, same probes
    assert torch.equal(keys_only.v[last][left_out], placed.v[last][left_out])


# redknot with a fixed keep fraction from layer 1 on, short enough a recent window to leave rows out
KEEP = SparseFFNConfig(dense_until=1, deep_layer_start=2, recent_n=4, min_keep=2, keep_fraction=0.3,
                       chunk_start_tokens=2)


def _with(llm, sparse=None, **kw):
    """Engine reuse options (and sparse FFN) for one test; returns what to restore."""
    docs = llm.engine.documents
    saved = docs.options, docs.sparse
    docs.options = dataclasses.replace(docs.options, **kw)
    docs.sparse = sparse or docs.sparse
    return saved


def _restore(llm, saved):
    llm.engine.documents.options, llm.engine.documents.sparse = saved


def _batch_equals_the_oracle(llm, method):
    llm.engine.clear_caches()
    orders = [DOCS, DOCS[::-1], [DOCS[1], DOCS[0]]]
    questions = [QUESTION, "Question: what jumps over the dog?", QUESTION]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_first_logits=True)
    outs = llm.generate(questions, params, documents=orders, method=method)
    for o, q, docs in zip(outs, questions, orders):
        oracle = reuse_oracle(llm).prefill(build_prompt(llm.tokenizer, q, docs), method).recovered
        torch.testing.assert_close(o.first_token_logits, oracle.logits, rtol=1e-4, atol=1e-4)
        assert o.metrics["flops"] == oracle.flops.totals()
    assert llm.engine.request_kv_bytes() == 0
    return outs


@pytest.mark.parametrize("method", ["cacheblend", "redknot"])
def test_kv_correction_of_cacheblend_and_redknot_equals_the_reference_and_moves_the_logits(llm, method):
    """``+kc`` on CacheBlend's and redknot's own selections: the engine's batched recovery equals the
    reference forward, and the correction changes what the question sees."""
    saved = _with(llm, KEEP, cacheblend_ratio=0.3, kv_correction=True)
    try:
        outs = _batch_equals_the_oracle(llm, method)
        _with(llm, kv_correction=False)
        plain = reuse_oracle(llm).prefill(build_prompt(llm.tokenizer, QUESTION, DOCS), method).recovered
        assert not torch.allclose(plain.logits, outs[0].first_token_logits, atol=1e-5)
    finally:
        _restore(llm, saved)


@pytest.mark.parametrize("correct", [False, True])
def test_question_pass_ranks_redknots_ffn_rows_in_the_engine_as_in_the_reference(llm, correct):
    """``redknot@...+qp``: the question pass's score ranks the sparse FFN's rows (the engine's batched
    selection and the reference forward alike); the rows, and so the logits, differ from those the
    question's last queries rank at the sparse layer."""
    saved = _with(llm, KEEP, question_pass=True, kv_correction=correct)
    try:
        outs = _batch_equals_the_oracle(llm, "redknot")
        assert outs[0].metrics["flops"]["scoring"] > 0
        _with(llm, question_pass=False)
        at_layer = reuse_oracle(llm).prefill(build_prompt(llm.tokenizer, QUESTION, DOCS), "redknot").recovered
        assert not torch.allclose(at_layer.logits, outs[0].first_token_logits, atol=1e-5)
    finally:
        _restore(llm, saved)


def test_question_pass_needs_attention_importance():
    vis = torch.full((2, 1), 64), torch.zeros(2, 1, dtype=torch.long)
    is_chunk = torch.tensor([False, True, True, False])
    scorer = QuestionScores(torch.tensor([3]), *vis, is_chunk, 1)
    with pytest.raises(ValueError, match="importance"):
        RedKnot(torch.arange(4), *vis, *vis, is_chunk, dataclasses.replace(KEEP, importance="cross"), 1,
                keep_cached=True, scorer=scorer)


def test_kv_correction_at_a_full_cacheblend_budget_equals_dense(llm):
    dense = llm.first_token_logits(QUESTION, documents=DOCS, method="dense")
    torch.testing.assert_close(llm.first_token_logits(QUESTION, documents=DOCS, method="cacheblend@1.0+kc"), dense,
                               rtol=1e-4, atol=1e-4)


def test_kv_correction_needs_rows_that_keep_their_cache():
    vis = torch.full((2, 1), 64), torch.zeros(2, 1, dtype=torch.long)
    is_chunk = torch.tensor([False, True, True, False])
    with pytest.raises(ValueError, match="redknot_paper"):
        RedKnot(torch.arange(4), *vis, *vis, is_chunk, KEEP, 1, keep_cached=False,
                correction=KVCorrection(lambda x, d: x))


@pytest.mark.parametrize("method", ["full_reuse", "cacheblend", "qrecompute", "redknot"])
def test_dummy_prefix_equals_the_reference_and_drops_the_dummies(llm, method):
    """Chunks cached behind 4 BOS tokens (``+dp4``): the engine equals the reference forward (which
    computes each chunk after prefix + dummies and places the chunk alone), the prompt and the cached
    token count are those of the plain run (no dummy reaches the request), and the logits move."""
    prompt = build_prompt(llm.tokenizer, QUESTION, DOCS)
    saved = _with(llm, KEEP, qrecompute_ratio=0.3, qrecompute_start_tokens=2)
    try:
        _first(llm, QUESTION, DOCS, method)
        plain = _first(llm, QUESTION, DOCS, method)  # warm, as the run with dummies below
        _with(llm, dummy_prefix_tokens=4)
        outs = _batch_equals_the_oracle(llm, method)
        warm = _first(llm, QUESTION, DOCS, method)  # every chunk now served from the cache
    finally:
        _restore(llm, saved)
    assert list(warm.prompt_token_ids) == list(plain.prompt_token_ids) == prompt.token_ids
    assert warm.metrics["cached_tokens"] == plain.metrics["cached_tokens"]
    torch.testing.assert_close(warm.first_token_logits, outs[0].first_token_logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(plain.first_token_logits, warm.first_token_logits, atol=1e-5)


def test_dummy_prefix_off_keeps_the_chunk_keys(llm):
    """Off (the default) the chunk cache keys are the plain ones: cached chunks stay valid and every
    output is unchanged; on, the chunks get keys of their own, behind the model's BOS."""
    from redknot.engine.sequence import ReuseState

    seq = llm.make_sequence(QUESTION, SamplingParams(max_tokens=1), DOCS, "full_reuse")
    docs = llm.engine.documents
    seq.reuse = ReuseState(seq.chunked_prompt)
    plain = docs.specs(seq)
    seq.reuse, seq.budget = ReuseState(seq.chunked_prompt), {"dummy_prefix_tokens": 3}
    lead = docs.specs(seq)
    assert [k for k, _, _ in plain][:1] == [k for k, _, _ in lead][:1]  # the prefix alone: shared
    assert not {k for k, _, _ in plain[1:]} & {k for k, _, _ in lead[1:]}
    for (_, t0, s0), (_, t1, s1) in zip(plain[1:], lead[1:]):
        assert s1 == s0 + 3 and t1[s1:] == t0[s0:] and t1[s0:s1] == (dummy_token(llm.config),) * 3

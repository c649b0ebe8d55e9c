"""A recovery forward split over steps under the step's token budget: the same tokens as one
forward, and a concurrent request keeps decoding every step while a long recovery runs."""

import json
import os
from contextlib import contextmanager

import pytest
import torch

from redknot import LLM, HeadConfig, SamplingParams
from redknot.config import SparseFFNConfig

DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120. " * 3,
        "Attention heads differ: some look far back, most look at recent tokens. " * 3,
        "The quick brown fox jumps over the lazy dog near the old mill. " * 3]
DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")  # the same tests on a GPU
QUESTION = "Question: who founded the city of Varna? Answer:"
SPARSE = SparseFFNConfig(dense_until=1, mass_thresh=0.3, deep_layer_start=2, mass_thresh_deep=0.1, recent_n=8,
                         min_keep=4)


def make_llm(path, budget, layers=4):
    with open(os.path.join(path, "config.json")) as f:
        kv = json.load(f).get("num_key_value_heads", 2)
    hc = HeadConfig.synthetic(layers, kv, 0.5, window=16, sink=4)
    return LLM(model=path, device=DEVICE, head_config=hc, page_size=16, sparse_ffn=SPARSE,
               max_num_batched_tokens=budget)


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama", num_hidden_layers=4)


def _unsplit(llm):
    """The same engine with each recovery run whole in one step (no row-layer budget)."""
    ex = llm.engine.executor
    recover = ex.recover

    def whole(seqs):
        ex.row_layers = None
        return recover(seqs)
    ex.recover = whole
    return llm


def _run(llm, method):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_first_logits=True)
    steps = llm.engine.timings["steps"]
    out = llm.generate(QUESTION, params, documents=DOCS, method=method)[0]
    return out.outputs[0].token_ids, out.first_token_logits, llm.engine.timings["steps"] - steps


def _decoding_request(llm, max_tokens):
    """A short dense request, run until it decodes."""
    short = llm.make_sequence("Hello there", SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                              method="dense")
    llm.engine.add_request(short)
    while not short.output_token_ids:
        llm.engine.step()
    return short


@contextmanager
def _recorded_recoveries(engine):
    """Yields a list that gets (row-layers spent, row-layers allowed) of each recovery piece run."""
    spent, recover = [], engine.runner.recover

    def recording(ids, prompts, rows):
        out = recover(ids, prompts, rows)
        spent.append((rows.spent, rows.budget))
        return out
    engine.runner.recover = recording
    try:
        yield spent
    finally:
        engine.runner.recover = recover


@pytest.mark.parametrize("method", ["redknot", "cacheblend", "qrecompute", "qrecompute@0.3+qp+kc0.5"])
def test_split_recovery_gives_the_unsplit_tokens(path, method):
    """A 16-token budget runs the ~150-row recovery a layer per step; the same engine without the
    split runs it in one forward. Every layer runs whole and in order: same logits bit for bit,
    same greedy tokens (the document chunks' own prefill is chunked alike in both)."""
    whole, split = _unsplit(make_llm(path, 16)), make_llm(path, 16)
    ref_tokens, ref_logits, ref_steps = _run(whole, method)
    tokens, logits, steps = _run(split, method)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)
    assert steps >= ref_steps + 3  # the recovery took a step per layer (4 layers) instead of one


@pytest.mark.parametrize("family", ["gemma3_text", "deepseek_v3"])
def test_split_recovery_is_exact_on_other_backbones(tiny_checkpoint, family):
    """Gemma 3's backbone and the MLA one (Llama's loop over latent attention) pause and resume too."""
    layers = 6 if family == "gemma3_text" else 3  # Gemma 3: a global layer after five sliding ones
    path = tiny_checkpoint(family, num_hidden_layers=layers)
    ref_tokens, ref_logits, ref_steps = _run(_unsplit(make_llm(path, 16, layers=layers)), "redknot")
    tokens, logits, steps = _run(make_llm(path, 16, layers=layers), "redknot")
    assert tokens == ref_tokens and torch.equal(logits, ref_logits) and steps > ref_steps


def test_a_decoding_request_gets_a_token_every_step_during_a_long_recovery(path):
    """A short dense request decodes while a long recovery starts: each step gives it a token,
    and the recovery's row-layers per step stay within the budget (one layer at least)."""
    budget = 32
    llm = make_llm(path, budget)
    engine = llm.engine
    short = _decoding_request(llm, 40)
    long = llm.make_sequence(QUESTION, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                             documents=DOCS * 3, method="redknot")
    engine.add_request(long)
    with _recorded_recoveries(engine) as spent:
        steps = 0
        while not long.finished:
            before = len(short.output_token_ids)
            engine.step()
            steps += 1
            assert len(short.output_token_ids) == before + 1  # never held back a step
    assert steps >= 4 and len(spent) >= 4  # split over (at least) its 4 layers
    # a request arriving while a long recovery runs gets its first token within two steps
    long = llm.make_sequence(QUESTION, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                             documents=DOCS[::-1] * 3, method="redknot")
    engine.add_request(long)
    engine.step()
    assert engine.executor.recovering(long)
    late = llm.make_sequence("Hi", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), method="dense")
    engine.add_request(late)
    waited = 0
    while not late.output_token_ids:
        engine.step()
        waited += 1
    assert waited <= 2 and engine.executor.recovering(long)
    while engine.has_unfinished():
        engine.step()
    n = len(long.token_ids)
    for used, allowed in spent:
        assert used <= max(allowed, n)  # within the step's row-layers, or one layer's rows
    assert allowed < (budget - 1) * 4 + 1


def test_aborting_a_recovery_under_way_frees_its_pages_when_it_ends(path):
    llm = make_llm(path, 16)
    engine = llm.engine
    seq = llm.make_sequence(QUESTION, SamplingParams(max_tokens=4, temperature=0), documents=DOCS, method="redknot")
    engine.add_request(seq)
    engine.step()
    assert engine.executor.recovering(seq)
    engine.abort(seq)
    for _ in range(10):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished() and not engine.executor.recovering(seq)
    assert seq.finish_reason == "abort"
    assert engine.request_kv_bytes() == 0  # what is left in use is the cached documents


def test_preempting_a_recovery_under_way_requeues_it_and_it_finishes(path):
    llm = make_llm(path, 16)
    engine = llm.engine
    seq = llm.make_sequence(QUESTION, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                            documents=DOCS, method="redknot")
    engine.add_request(seq)
    engine.step()
    assert engine.executor.recovering(seq)
    engine._preempt(seq)  # what make_room does when the pool runs short
    assert not engine.executor.recovering(seq) and seq in engine.scheduler.waiting
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    assert seq.finish_reason == "length" and len(seq.output_token_ids) == 3 and seq.num_preemptions == 1
    assert engine.request_kv_bytes() == 0


def test_split_recovery_under_tensor_parallelism_equals_one_process(tiny_checkpoint):
    """Two ranks split a recovery at the same layers (their rows agree, the budget is the same
    schedule's) and give one process's tokens."""
    from redknot.config import SparseFFNConfig

    path = tiny_checkpoint("llama", num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3)
    kw = dict(model=path, dtype=torch.float32, device="cpu", kv_pages=2048, page_size=8, cuda_graphs=False,
              head_config=HeadConfig.synthetic(3, 4, 0.5, window=16, sink=4), max_num_batched_tokens=16,
              sparse_ffn=SparseFFNConfig(dense_until=1, keep_fraction=0.4, importance="cross", recent_n=8,
                                         min_keep=4))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    one = LLM(**kw).generate(QUESTION, params, documents=DOCS, method="redknot")[0].outputs[0].token_ids
    with LLM(**kw, tensor_parallel_size=2) as two:
        steps = two.engine.timings["steps"]
        assert two.generate(QUESTION, params, documents=DOCS, method="redknot")[0].outputs[0].token_ids == one
        assert two.engine.timings["steps"] - steps > 4  # the recovery took several steps


def test_the_recovery_with_the_least_work_left_runs_first(path):
    """A short recovery admitted while a long one is under way takes the step's budget first."""
    llm = make_llm(path, 16)
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    long = llm.make_sequence(QUESTION, params, documents=DOCS * 3, method="redknot")
    engine.add_request(long)
    engine.step()
    assert engine.executor.recovering(long)
    short = llm.make_sequence(QUESTION, params, documents=DOCS[:1], method="redknot")
    engine.add_request(short)
    while not short.output_token_ids:
        engine.step()
    assert not long.output_token_ids  # the long one was still under way
    while engine.has_unfinished():
        engine.step()


def test_a_long_dense_prompt_waits_while_a_recovery_runs(path):
    """A recovery starting while a long dense prompt prefills takes the steps it takes alone, and
    the long prompt's chunks wait for it (the budget is kept for the recovery's rows first: its
    steps are not lengthened by the long prompt's chunk)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def run(with_long: bool) -> int:
        llm = make_llm(path, 256)
        engine = llm.engine
        llm.generate(QUESTION, params, documents=DOCS, method="redknot")  # documents cached
        long = None
        if with_long:
            long = llm.make_sequence([5 + i % 300 for i in range(900)], params, method="dense")
            engine.add_request(long)
            engine.step()
        seq = llm.make_sequence(QUESTION, params, documents=DOCS, method="redknot")
        engine.add_request(seq)
        before, steps = long.num_computed if long else 0, 0
        while not seq.output_token_ids:
            engine.step()
            steps += 1
        if long is not None:
            assert long.num_computed == before and not long.output_token_ids
        return steps
    assert run(True) == run(False)


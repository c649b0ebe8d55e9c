"""The engine core: batched paged decode, prefix caching, preemption, device tables, sampler,
detokenizer, fused projections and CUDA-graph decode."""

import os

import numpy as np
import pytest
import torch

from redknot import LLM, HeadConfig, SamplingParams
from redknot.cache import PagePool
from redknot.config import GLOBAL_WINDOW
from redknot.engine.detokenizer import IncrementalDetokenizer
from redknot.engine.scheduler import RequestTooLarge
from redknot.engine.sampling import sample
from redknot.kernels.reference import paged_decode_attention, segpaged_attention_ref

DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")
LONG = ("The archive of Varna keeps the letters of its founders, the ledgers of the salt trade and the maps "
        "drawn by the first surveyors of the river delta. ") * 6


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


# ---------------------------------------------------------------- batched CPU decode attention

@pytest.mark.parametrize("seed", range(6))
def test_paged_decode_attention_equals_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    hkv = int(rng.choice([1, 2, 4]))
    hq = hkv * int(rng.choice([1, 2, 4, 8]))
    ps, d, B = int(rng.choice([16, 32, 64])), 16, int(rng.integers(1, 6))
    lens = rng.integers(1, 300, size=B)
    window = torch.tensor([int(w) for w in rng.choice([1, 7, 64, 500, GLOBAL_WINDOW], size=hkv)], dtype=torch.int32)
    sink = torch.tensor([int(s) for s in rng.choice([0, 1, 4, 40], size=hkv)], dtype=torch.int32)
    max_pages = -(-int(lens.max()) // ps) + 2
    n_pages = B * hkv * max_pages
    k_pages = torch.randn(n_pages, ps, d, generator=g)
    v_pages = torch.randn(n_pages, ps, d, generator=g)
    bt = torch.randperm(n_pages, generator=g).view(B, hkv, max_pages).to(torch.int32)
    for b in range(B):  # pages past the end, and pages no query can see, are absent (-1)
        n = int(lens[b])
        for h in range(hkv):
            for lp in range(max_pages):
                last = (lp + 1) * ps - 1
                if lp * ps >= n or (lp * ps >= sink[h] and last < n - 1 - window[h] + 1):
                    bt[b, h, lp] = -1
    q = torch.randn(B, hq, d, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.arange(B + 1, dtype=torch.int32)
    ref = segpaged_attention_ref(q, k_pages, v_pages, bt, cu, seq_lens, window, sink, 0.25)
    out = paged_decode_attention(q, k_pages, v_pages, bt, seq_lens, window, sink, 0.25, int(lens.max()))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- device tables

def test_device_tables_follow_every_table_change():
    L, H, ps = 2, 3, 4
    window = np.array([[GLOBAL_WINDOW, 5, 9], [3, GLOBAL_WINDOW, 6]])
    pool = PagePool(400, ps, 8, window=window, sink=np.array([[0, 1, 4], [0, 0, 2]]))
    pool.add_plan("dense", np.full((L, H), GLOBAL_WINDOW), np.zeros((L, H)))
    pool.attach_device_tables(max_seqs=4, max_len=64)
    rng = np.random.default_rng(0)
    live = {}
    for step in range(200):
        op = rng.integers(0, 4)
        if op == 0 and len(live) < 4:
            sid = step
            pool.add_sequence(sid, "dense" if rng.integers(2) else "default")
            live[sid] = 0
        elif op == 1 and live:
            sid = int(rng.choice(list(live)))
            if live[sid] < 60:
                live[sid] = min(64, live[sid] + int(rng.integers(1, 9)))
                pool.ensure(sid, live[sid])
                pool.trim(sid)
        elif op == 2 and live:
            sid = int(rng.choice(list(live)))
            pool.free_sequence(sid)
            del live[sid]
        pool.sync_device_tables()
        for sid in live:
            t = pool.table(sid)
            dev = pool.device_tables[:, pool.slot(sid)].numpy()
            np.testing.assert_array_equal(dev[:, :, :t.shape[2]], t)
            assert (dev[:, :, t.shape[2]:] == -1).all()
    assert (pool.device_tables[:, 0] == -1).all()  # the padding slot is never written


# ---------------------------------------------------------------- prefix caching

def test_prefix_cache_hit_equals_a_cold_prefill_and_never_writes_shared_pages(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    warm = LLM(model=path, device="cpu", page_size=16)
    cold = LLM(model=path, device="cpu", page_size=16, enable_prefix_caching=False)
    a, b = LONG + "Who drew the maps?", LONG + "What did the ledgers record?"
    first = warm.generate(a, greedy(12))[0]
    assert first.metrics["cached_tokens"] == 0
    cache = warm.engine.prefix_cache
    assert len(cache) > 0
    cached_pages = np.concatenate([p[p >= 0] for p in cache._blocks.values()])
    idx = torch.from_numpy(cached_pages.astype(np.int64))
    before_k, before_v = warm.pool.k_pages[idx].clone(), warm.pool.v_pages[idx].clone()
    hit = warm.generate(b, greedy(12))[0]
    assert hit.metrics["cached_tokens"] >= 16 * (len(warm.prompt_ids(LONG)) // 16 - 1)
    assert hit.outputs[0].token_ids == cold.generate(b, greedy(12))[0].outputs[0].token_ids
    torch.testing.assert_close(warm.first_token_logits(b), cold.first_token_logits(b), atol=1e-5, rtol=1e-5)
    assert torch.equal(warm.pool.k_pages[idx], before_k) and torch.equal(warm.pool.v_pages[idx], before_v)
    # the same prompt again: everything but its last token comes from the cache
    again = warm.generate(b, greedy(4))[0]
    assert again.metrics["cached_tokens"] == 16 * ((len(again.prompt_token_ids) - 1) // 16)
    assert again.outputs[0].token_ids == hit.outputs[0].token_ids[:4]
    # its page count is kept as blocks come and go
    assert cache.num_pages() == sum(int((p >= 0).sum()) for p in cache._blocks.values())
    cache.evict(1)
    assert cache.num_pages() == sum(int((p >= 0).sum()) for p in cache._blocks.values())


def test_prefix_cache_under_a_head_plan(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    hc = HeadConfig.synthetic(2, 2, 0.5, window=32, sink=4)
    warm = LLM(model=path, device="cpu", page_size=16, method="headsparse", head_config=hc)
    cold = LLM(model=path, device="cpu", page_size=16, method="headsparse", head_config=hc,
               enable_prefix_caching=False)
    warm.generate(LONG + "Who?", greedy(4))
    out = warm.generate(LONG + "Who drew?", greedy(8))[0]
    assert out.outputs[0].token_ids == cold.generate(LONG + "Who drew?", greedy(8))[0].outputs[0].token_ids


# ---------------------------------------------------------------- pool pressure

def test_preemption_keeps_greedy_tokens_and_returns_every_page(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = [f"Request {i}: " + LONG[: 60 + 40 * i] for i in range(5)]
    big = LLM(model=path, device="cpu", page_size=16, enable_prefix_caching=False)
    ref = [o.outputs[0].token_ids for o in big.generate(prompts, greedy(40))]
    # room for about two requests at a time: with optimistic admission decode growth forces preemptions
    small = LLM(model=path, device="cpu", page_size=16, kv_pages=96, enable_prefix_caching=False,
                max_num_batched_tokens=256, reserve_full_length=False)
    out = small.generate(prompts, greedy(40))
    assert small.engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in out] == ref
    assert small.pool.num_free_pages == small.pool.num_pages
    # reserving every request's full length, the same pool runs them without a preemption
    reserved = LLM(model=path, device="cpu", page_size=16, kv_pages=96, enable_prefix_caching=False,
                   max_num_batched_tokens=256)
    assert [o.outputs[0].token_ids for o in reserved.generate(prompts, greedy(40))] == ref
    assert reserved.engine.num_preemptions == 0 and reserved.engine.scheduler.committed == 0


def test_a_request_larger_than_the_pool_is_refused_and_the_next_one_runs(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint("llama"), device="cpu", page_size=16, kv_pages=40)
    with pytest.raises(RequestTooLarge, match="KV pages"):
        llm.generate(LONG, greedy(8))
    assert llm.pool.num_free_pages == llm.pool.num_pages and not llm.engine.has_unfinished()
    assert len(llm.generate("Hello", greedy(4))[0].outputs[0].token_ids) == 4


# ---------------------------------------------------------------- sampler and detokenizer

def test_sampler_is_seeded_per_row_and_greedy_at_tiny_temperature():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3)
    gens = [torch.Generator().manual_seed(3) for _ in range(2)]
    a = sample(logits[:1], [p], gens[:1])
    b = sample(logits[[0, 1, 2]], [p, SamplingParams(temperature=1.0), SamplingParams(temperature=0)],
               [gens[1], None, None])
    assert a[0] == b[0] and b[2] == logits[2].argmax()  # a seeded row ignores its neighbours
    tiny = SamplingParams(temperature=3e-38)
    assert tiny.greedy
    assert sample(logits, [tiny] * 4, [None] * 4).tolist() == logits.argmax(-1).tolist()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))


def test_sampler_draws_from_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]).repeat(20000, 1)
    params = [SamplingParams(temperature=1.0, top_k=3)] * 20000
    draws = sample(logits, params, [None] * 20000)
    freq = torch.bincount(draws, minlength=5).double() / 20000
    want = torch.zeros(5, dtype=torch.float64)
    want[:3] = logits[0, :3].double().softmax(-1)
    assert (freq - want).abs().max() < 0.015


def test_incremental_detokenizer_equals_a_full_decode(tiny_checkpoint):
    llm = LLM(device="cpu")  # the bundled model's byte-level BPE
    rng = np.random.default_rng(0)
    for text in ["Varna was founded in 1201 by Ilse Marr.", "naïve café — 東京 🙂 done", LONG[:200]]:
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        ids = ids + [int(t) for t in rng.integers(0, llm.config.vocab_size, size=20)]
        d = IncrementalDetokenizer(llm.tokenizer)
        pieces = "".join(d.add(t) for t in ids) + d.flush()
        assert pieces == d.text == llm.tokenizer.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- weights and graphs

@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("pack", [False, True])
def test_fused_projections_equal_the_separate_ones(tiny_checkpoint, family, pack):
    """Fused QKV / gate-up (and, on the CPU, prepacked weights and one rotation of q and k
    together) give the separate projections' q, k, v, MLP output and logits."""
    from redknot.models import load_model

    path = tiny_checkpoint(family, num_key_value_heads=4)
    model, _ = load_model(path, device="cpu")
    pos = torch.arange(29)
    layer = model.model.layers[0]
    x = torch.randn(29, model.config.hidden_size)
    o = torch.randn(29, model.config.num_attention_heads * model.config.head_dim)
    with torch.inference_mode():
        before = (*layer.self_attn.qkv(x, pos), layer.mlp(x), layer.self_attn.o_proj(o), model.logits(x))
        model.fuse_projections(pack=pack)
        from redknot.models import linear as projection
        after = (*layer.self_attn.qkv(x, pos), layer.mlp(x),
                 projection.linear(o, layer.self_attn.o_proj.weight, None, layer.self_attn.o_packed), model.logits(x))
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert layer.self_attn.q_proj.weight.data_ptr() == layer.self_attn.qkv_weight.data_ptr()  # no second fused copy
    if pack and projection.pack(torch.ones(2, 2)) is not None:
        assert layer.self_attn.qkv_packed is not None and model.head_packed is not None


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method", ["dense", "headsparse", "h2o"])
def test_cuda_graph_decode_equals_eager_decode(tiny_checkpoint, method):
    """Graph replays give the eager tokens. ``h2o``: dense under a decode KV budget, whose check
    steps replay their graph too (it records every layer's queries for the check)."""
    from redknot.engine.selective import SelectionOptions

    path = tiny_checkpoint("llama", num_key_value_heads=4, num_attention_heads=8)
    hc = HeadConfig.synthetic(2, 4, 0.5, window=32, sink=4)
    selection = SelectionOptions(decode_kv_budget={"global": 48}, decode_kv_window=16) if method == "h2o" else None
    method = "dense" if method == "h2o" else method
    prompts = [LONG[: 50 + 30 * i] for i in range(5)]
    outs = []
    for graphs in (True, False):
        llm = LLM(model=path, device="cuda", dtype="float32", head_config=hc, method=method, cuda_graphs=graphs,
                  page_size=16, kv_pages=4096, selection=selection)
        recorded = []
        if graphs:
            runner = llm.engine.runner
            replay, forward, replays = runner._replay, runner.forward, []
            runner._replay = lambda *a: replays.append(1) or replay(*a)

            def recording_forward(*a):  # a step that records queries for a check, replayed from a graph
                before = len(replays)
                out = forward(*a)
                recorded.append(len(a) > 4 and a[4] is not None and len(replays) > before)
                return out
            runner.forward = recording_forward
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24))])
        if graphs and selection is not None:  # the checks ran, from replayed steps
            assert llm.engine.selection.checks >= len(prompts) and True in recorded
    assert outs[0] == outs[1]


@pytest.mark.parametrize("method", ["dense", "headsparse", "h2o"])
def test_async_decode_gives_the_same_tokens_and_returns_every_page(tiny_checkpoint, method, monkeypatch):
    """Each decode step launched from the last one's samples on the device: the same greedy and
    seeded tokens as step-by-step decode, with requests of different lengths finishing on length,
    a stop string and a stop token (the token computed past a finish is discarded), and every
    page back afterwards. ``h2o``: dense under a decode KV budget, whose check steps (every
    page of decode) run step by step and the others ahead."""
    from redknot.engine.selective import SelectionOptions

    path = tiny_checkpoint("llama", num_key_value_heads=2, num_attention_heads=4)
    hc = HeadConfig.synthetic(2, 2, 0.5, window=16, sink=4)
    selection = SelectionOptions(decode_kv_budget={"global": 48}, decode_kv_window=16) if method == "h2o" else None
    method = "dense" if method == "h2o" else method
    prompts = [LONG[: 40 + 25 * i] for i in range(5)] + [LONG[:40]]  # the last one stops early
    # On a GPU a row's logits depend on the batch's size (GEMM kernels are chosen by shape), and a
    # request that stops on a token or string is still in the launched step, not in the step-by-step
    # one: so there every request finishes on length, and the batches are the same.
    stops = DEVICE == "cpu"
    outs = {}
    for ahead in (False, True):
        llm = LLM(model=path, device=DEVICE, dtype="float32", head_config=hc, method=method, page_size=16,
                  kv_pages=4096, async_decode=ahead, selection=selection)
        launched, held = [], []
        if ahead:  # count the steps launched ahead: a test that never launches one proves nothing
            import redknot.engine.engine as engine_module
            import redknot.engine.lookahead as lookahead

            launch = lookahead.launch_ahead
            for module in (engine_module, lookahead):
                monkeypatch.setattr(module, "launch_ahead", lambda *a: launched.append(launch(*a)) or launched[-1])
            if selection is not None:  # and the steps the budget checks kept step by step
                needed = llm.engine.selection.needed_by_decode
                llm.engine.selection.needed_by_decode = lambda *a: held.append(needed(*a)) or held[-1]
        ref = llm.generate(prompts[0], greedy(12))[0].outputs[0]
        params = [greedy(5 + 3 * i) for i in range(4)]
        params.append(SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True))
        params.append(SamplingParams(max_tokens=20, temperature=0, stop=[ref.text[8:12]] if stops else None,
                                     stop_token_ids=[ref.token_ids[6]] if stops else [], ignore_eos=True))
        out = llm.generate(prompts, params)
        outs[ahead] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in out]
        if ahead:
            assert sum(x is not None for x in launched) >= 10
            if selection is not None:
                assert True in held and False in held
        assert not llm.engine.has_unfinished() and llm.engine.request_kv_bytes() == 0
        llm.engine.clear_caches()
        assert llm.pool.num_free_pages == llm.pool.num_pages
    assert outs[True] == outs[False]
    assert {r for _, _, r in outs[True]} >= ({"length", "stop"} if stops else {"length"})


@pytest.mark.parametrize("slots", [256, 2])
def test_async_decode_yields_to_a_request_that_arrives(tiny_checkpoint, slots):
    """While requests decode step ahead of the host, a new arrival is admitted at the next step
    (the launched step is finished first), or once a slot frees when every slot is taken, and
    every request gets its step-by-step tokens (on the CPU, where a row's arithmetic does not
    depend on the batch it is in; on a GPU the arrival and the abort change batches at other
    steps than step by step, so there each request gets its length)."""
    path = tiny_checkpoint("llama")
    got = {}
    for ahead in (False, True):
        llm = LLM(model=path, device=DEVICE, page_size=16, kv_pages=4096, async_decode=ahead, max_num_seqs=slots)
        first = [llm.make_sequence(LONG[:60 + 20 * i], greedy(16), None, "dense") for i in range(2)]
        late = llm.make_sequence(LONG[:90], greedy(10), None, "dense")
        for s in first:
            llm.engine.add_request(s)
        steps = 0
        while llm.engine.has_unfinished():
            llm.engine.step()
            steps += 1
            if steps == 5:
                llm.engine.add_request(late)
            if steps == 8:
                llm.engine.abort(first[1])
        got[ahead] = [s.output_token_ids for s in first + [late]]
        assert llm.engine.request_kv_bytes() == 0
        assert [len(t) for t in got[ahead][::2]] == [16, 10] and first[1].finish_reason == "abort"
    if DEVICE == "cpu":
        assert got[True] == got[False]


def test_a_row_the_sampler_rejects_fails_only_its_own_request(tiny_checkpoint, monkeypatch):
    import redknot.engine.engine as engine_mod

    real = engine_mod.sample

    def picky(logits, params, generators, grammars=None):
        if any(p.seed == 666 for p in params):
            raise RuntimeError("this row cannot be sampled")
        return real(logits, params, generators, grammars)

    llm = LLM(model=tiny_checkpoint("llama"), device=DEVICE, page_size=16)
    ref = llm.generate("Hello there", greedy(5))[0].outputs[0].token_ids
    monkeypatch.setattr(engine_mod, "sample", picky)
    bad = llm.make_sequence("Bad row", SamplingParams(max_tokens=5, seed=666), None, "dense")
    good = llm.make_sequence("Hello there", greedy(5), None, "dense")
    for s in (bad, good):
        llm.engine.add_request(s)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert bad.finish_reason == "error" and "cannot be sampled" in str(bad.error)
    assert good.error is None and good.output_token_ids == ref


def test_an_abandoned_request_is_dropped_before_prefill(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint("llama"), device=DEVICE, page_size=16, kv_pages=256)  # not sized from free memory
    gone = llm.make_sequence(LONG, greedy(4), None, "dense")
    llm.engine.add_request(gone)
    gone.abandoned = True
    out = llm.engine.step()
    assert gone.finish_reason == "abort" and gone.num_computed == 0 and any(o.seq is gone for o in out)
    assert not llm.engine.has_unfinished() and llm.pool.num_free_pages == llm.pool.num_pages


@pytest.mark.parametrize("method", ["dense", "headsparse"])
def test_a_pool_sized_by_pool_pages_for_runs_the_request(tiny_checkpoint, method):
    """pool_pages_for counts what admission asks for the first step too, so the pool it sizes runs
    the request, at prompt lengths on both sides of a page boundary (a prompt that fills its
    pages exactly got a pool it could never start in); one page less is a clear error."""
    path = tiny_checkpoint("llama")
    hc = HeadConfig([["global", "local"], ["local", "global"]], [[-1, 24], [24, -1]], [[0, 4], [4, 0]])
    llm = LLM(model=path, device="cpu", page_size=16, head_config=hc if method == "headsparse" else None)
    for n in (45, 47, 48, 49, 61):
        ids = list(range(10, 10 + n))
        seq = llm.make_sequence(ids, greedy(1), method=method)
        seq.plan = "headsparse" if method == "headsparse" else "dense"
        llm.engine.clear_caches()
        llm.engine.resize_pool(llm.engine.pool_pages_for(seq))
        out = llm.generate(ids, greedy(1), method=method)[0]
        assert len(out.outputs[0].token_ids) == 1, n
        smaller = llm.engine.pool.num_pages - 1
        llm.engine.clear_caches()
        llm.engine.resize_pool(smaller)
        with pytest.raises(RequestTooLarge):
            llm.generate(ids, greedy(1), method=method)


def test_a_long_prompt_holds_a_short_request_back_at_most_a_step(tiny_checkpoint):
    """Chunked prefill without head-of-line blocking: a 6.7K-token prompt prefilled 1,024 tokens a
    step does not make a short request that arrives during it wait for all its chunks."""
    llm = LLM(model=tiny_checkpoint("llama", max_position_embeddings=8192), device="cpu", page_size=16,
              max_num_batched_tokens=1024, enable_prefix_caching=False, method="dense")
    engine = llm.engine
    long_seq = llm.make_sequence([5 + i % 300 for i in range(6700)], greedy(2))
    engine.add_request(long_seq)
    engine.step()  # the long prompt's first chunk
    short = llm.make_sequence("Hello there", greedy(2))
    engine.add_request(short)
    steps = 0
    while not short.output_token_ids:
        engine.step()
        steps += 1
    assert steps <= 2, steps
    assert not long_seq.output_token_ids  # the long prompt was still prefilling meanwhile
    while engine.has_unfinished():
        engine.step()
    alone = LLM(model=tiny_checkpoint("llama", max_position_embeddings=8192), device="cpu", page_size=16,
                enable_prefix_caching=False, method="dense")
    assert long_seq.output_token_ids == alone.generate([[5 + i % 300 for i in range(6700)]], greedy(2))[0].outputs[0].token_ids


def test_long_prefill_threshold_caps_a_long_prompt_chunk_only_beside_other_work(tiny_checkpoint):
    """``long_prefill_token_threshold``: while another request decodes, a long prompt advances at
    most the threshold per step (steps stay short for arrivals); alone it takes the whole budget.
    The tokens it generates do not change."""
    prompt = [5 + i % 300 for i in range(2000)]
    llm = LLM(model=tiny_checkpoint("llama", max_position_embeddings=4096), device="cpu", page_size=16,
              max_num_batched_tokens=1024, long_prefill_token_threshold=128, enable_prefix_caching=False,
              method="dense")
    engine = llm.engine
    alone = llm.make_sequence(prompt, greedy(2))
    engine.add_request(alone)
    engine.step()
    assert alone.num_computed == 1024  # nothing else runs: the whole budget
    while engine.has_unfinished():
        engine.step()

    talker = llm.make_sequence("Hello there", greedy(64))
    engine.add_request(talker)
    engine.step()  # its prompt
    assert talker.output_token_ids
    beside = llm.make_sequence(prompt, greedy(2))
    engine.add_request(beside)
    seen = []
    while not beside.output_token_ids:
        before = beside.num_computed
        engine.step()
        seen.append(beside.num_computed - before)
    assert max(seen[:-1]) <= 128 and len(seen) >= 2000 // 128, seen
    while engine.has_unfinished():
        engine.step()
    assert beside.output_token_ids == alone.output_token_ids
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(model=tiny_checkpoint("llama"), device="cpu", long_prefill_token_threshold=0)

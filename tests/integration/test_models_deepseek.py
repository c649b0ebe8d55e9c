"""DeepSeek-V2/V3 (multi-head latent attention, DeepSeek's experts) against transformers on tiny
random checkpoints: logits and greedy tokens, the routing variants in float64, a query-head plan
against a float64 masked reference, prefix-cache hits, every reuse method, the relocation of
cached RoPE parts, the profiler over query heads, config errors, and on a GPU the Triton decode
under CUDA graphs."""

import os

import pytest
import torch
import transformers
from transformers import AttentionInterface

from redknot import LLM, HeadConfig, SamplingParams
from redknot.config import SparseFFNConfig
from redknot.models import UnsupportedModelError
from redknot.models.config import ModelConfig
from redknot.models.llama import _ffn
from redknot.reuse.registry import METHODS
from redknot.visibility import visibility_mask
from oracles.hf_reference import hf_last_logits_and_greedy, edited_checkpoint

DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")
PROMPT = "Question: who founded the city of Varna? Answer: the merchants of the old salt road"
DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120. " * 2,
        "Attention heads differ: some look far back, most look at recent tokens. " * 2]
LONG = PROMPT + ". " + DOCS[0] + DOCS[1]

CASES = [
    ("deepseek_v3", {}),
    # no q LoRA, plain RoPE layout, biases, YaRN with mscale in the softmax scale, 4 groups of 2
    ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False, "attention_bias": True, "n_group": 4,
                     "topk_group": 2, "norm_topk_prob": False, "rope": "yarn_mscale"}),
    ("deepseek_v2", {}),
    ("deepseek_v2", {"q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                     "routed_scaling_factor": 1.5, "mlp_bias": True}),
]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("family,kw", CASES, ids=["v3", "v3-plain", "v2", "v2-grouped"])
def test_logits_and_greedy_tokens_match_transformers(tiny_checkpoint, family, kw):
    path = tiny_checkpoint(family, **kw)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, device="cpu", dtype="float32")
    assert llm.config.mla is not None and llm.pool.num_kv_heads == 1  # one latent head per layer
    ids = llm.tokenizer(PROMPT, return_tensors="pt").input_ids
    ref, gen = hf_last_logits_and_greedy(hf, ids)
    ours = llm.first_token_logits(PROMPT)
    assert rel(ours, ref) <= 1e-4 and cos(ours, ref) >= 0.99999
    assert llm.generate(PROMPT, greedy(20))[0].outputs[0].token_ids == gen


def test_pool_holds_one_latent_row_per_token_and_layer(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint("deepseek_v3"), device="cpu", page_size=16)
    m = llm.config.mla
    assert (llm.pool.num_layers, llm.pool.num_kv_heads) == (3, 1)
    # the K and V halves of a page hold [k_rope | latent] rows: 16 + 32 elements per token and layer
    assert llm.pool.bytes_per_page == 16 * (m.qk_rope_head_dim + m.kv_lora_rank) * 4


@pytest.mark.parametrize("family,grouping", [("deepseek_v3", dict(n_group=4, topk_group=2, norm_topk_prob=True)),
                                             ("deepseek_v3", dict(n_group=1, topk_group=1, norm_topk_prob=False)),
                                             ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4,
                                                                  topk_group=1)),
                                             ("deepseek_v2", dict(topk_method="greedy"))])
def test_moe_routing_matches_transformers_in_float64(family, grouping):
    """DeepSeek's MoE block (routing in float32 as transformers does it, experts in float64)."""
    hf_cls, cfg_cls = ((transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE, transformers.DeepseekV3Config)
                       if family == "deepseek_v3" else
                       (transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe, transformers.DeepseekV2Config))
    hf_cfg = cfg_cls(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2,
                     kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                     n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=8, n_shared_experts=2,
                     first_k_dense_replace=1, routed_scaling_factor=2.5 if family == "deepseek_v3" else 1.3,
                     **grouping)
    torch.manual_seed(0)
    hf = hf_cls(hf_cfg).double().eval()
    with torch.no_grad():
        for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            p.normal_(0, 0.5 if "gate.weight" in name else 0.1 if "bias" in name else 0.2)
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    ours = _ffn(cfg, 1).double()
    ours.load_state_dict(hf.state_dict())
    assert ours.gate.weight.dtype == torch.float32  # routing stays float32 under a cast
    x = torch.randn(96, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-10, atol=1e-12)
        weights, ids = ours.gate(x)
        _, ref_w, ref_ids = hf.gate(x)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    if cfg.moe.n_group > 1:  # the groups change the choice for some tokens
        plain = (ours.gate.weight.float() @ x.float().T).T.topk(3).indices
        assert not torch.equal(plain.sort(-1).values, ids.sort(-1).values)


def _f64_reference_with_head_mask(path, head_config):
    """transformers' DeepSeek in float64 with an attention function that masks each query head
    by its own (window, sink) (the model expands one key and value head per query head)."""
    window, sink = head_config.visibility()

    def head_masked(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        layer, h = module.layer_idx, query.shape[1]
        tq, tk = query.shape[2], key.shape[2]
        qpos, kpos = torch.arange(tk - tq, tk), torch.arange(tk)
        mask = torch.stack([visibility_mask(qpos, kpos, int(window[layer, i]), int(sink[layer, i])) for i in range(h)])
        scores = (query @ key.transpose(-1, -2)) * scaling
        probs = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
        return (probs @ value).transpose(1, 2).contiguous(), None

    AttentionInterface.register("redknot_query_head_mask", head_masked)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager",
                                                              attn_implementation="redknot_query_head_mask").eval()


# layer 1 has no global head: its latent pages are trimmed to what its widest window and sink see
HEAD_PLAN = HeadConfig([["global", "local", "local", "global"], ["local", "local", "local", "local"],
                        ["dense", "local", "global", "local"]],
                       [[-1, 5, 13, -1], [9, 30, 20, 3], [-1, 7, -1, 1]],
                       [[0, 4, 0, 0], [2, 0, 1, 4], [0, 3, 0, 0]])


def test_query_head_plan_equals_a_float64_masked_reference(tiny_checkpoint):
    path = tiny_checkpoint("deepseek_v3")
    llm = LLM(model=path, device="cpu", method="headsparse", head_config=HEAD_PLAN, page_size=16)
    hf = _f64_reference_with_head_mask(path, HEAD_PLAN)
    prompt = PROMPT + ". " + DOCS[0]
    ids = llm.tokenizer(prompt, return_tensors="pt").input_ids
    ref, gen = hf_last_logits_and_greedy(hf, ids)
    ours = llm.first_token_logits(prompt)
    assert rel(ours, ref) <= 1e-4
    dense = llm.first_token_logits(prompt, method="dense")
    assert rel(dense, ref) > 1e-3  # the mask really changes the result
    assert llm.generate(prompt, greedy(20))[0].outputs[0].token_ids == gen
    # the pool keeps what any query head of a layer still sees
    window, sink = llm.pool.window_sink("headsparse")
    assert window[1, 0] == 30 and sink[1, 0] == 4 and window[0, 0] == window[2, 0] > len(ids[0])


def test_all_heads_global_plan_equals_dense(tiny_checkpoint):
    path = tiny_checkpoint("deepseek_v3")
    llm = LLM(model=path, device="cpu", method="headsparse", head_config=HeadConfig.all_global(3, 4), page_size=16)
    assert rel(llm.first_token_logits(LONG), llm.first_token_logits(LONG, method="dense")) <= 1e-6
    assert (llm.generate(LONG, greedy(8))[0].outputs[0].token_ids
            == llm.generate(LONG, greedy(8), method="dense")[0].outputs[0].token_ids)


def test_prefix_cache_hit_equals_a_cold_prefill(tiny_checkpoint):
    path = tiny_checkpoint("deepseek_v3")
    for method, hc in (("dense", None), ("headsparse", HeadConfig.synthetic(3, 4, 0.5, window=16, sink=4))):
        warm = LLM(model=path, device="cpu", page_size=16, method=method, head_config=hc)
        cold = LLM(model=path, device="cpu", page_size=16, method=method, head_config=hc, enable_prefix_caching=False)
        warm.generate(LONG + " Who?", greedy(4))
        hit = warm.generate(LONG + " Who drew the maps?", greedy(12))[0]
        assert hit.metrics["cached_tokens"] >= 16 * (len(warm.prompt_ids(LONG)) // 16 - 1)
        assert (hit.outputs[0].token_ids
                == cold.generate(LONG + " Who drew the maps?", greedy(12))[0].outputs[0].token_ids)
        b = LONG + " Which city?"
        warm.generate(b, greedy(1))
        torch.testing.assert_close(warm.first_token_logits(b), cold.first_token_logits(b), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def mla_llm(tiny_checkpoint):
    """deepseek_v3 (a dense first layer, then experts with a shared one) with a query-head plan and a
    sparse FFN from layer 2 on."""
    sparse = SparseFFNConfig(dense_until=1, mass_thresh=0.3, deep_layer_start=2, mass_thresh_deep=0.1, recent_n=8,
                             min_keep=4)
    return LLM(model=tiny_checkpoint("deepseek_v3"), device="cpu", page_size=16, sparse_ffn=sparse,
               head_config=HeadConfig.synthetic(3, 4, 0.5, window=16, sink=4))


def test_every_reuse_method_runs_and_exact_recovery_equals_dense(mla_llm):
    params = greedy(4)
    for method in METHODS:
        out = mla_llm.generate([PROMPT, "Question: what do heads do?"], params, documents=[DOCS, DOCS[::-1]],
                               method=method)
        assert [len(o.outputs[0].token_ids) for o in out] == [4, 4], method
        assert out[0].metrics["flops"]["total"] > 0
    assert mla_llm.engine.request_kv_bytes() == 0
    dense = mla_llm.first_token_logits(PROMPT, documents=DOCS, method="dense")
    exact = mla_llm.first_token_logits(PROMPT, documents=DOCS, method="redknot_exact")
    assert cos(exact, dense) >= 0.99999 and exact.argmax() == dense.argmax()
    mla_llm.engine.clear_caches()
    assert mla_llm.pool.num_free_pages == mla_llm.pool.num_pages


def test_relocated_rope_parts_equal_rows_computed_at_the_new_position(mla_llm):
    """A cached document's rows moved by a RoPE rotation of their k_rope part (the K half's first
    qk_rope_head_dim dims; the latent untouched) equal the rows computed at the new positions:
    layer 0's rows depend only on the tokens, so the cache's own pages are the check."""
    llm = mla_llm
    llm.engine.clear_caches()
    llm.generate(PROMPT, greedy(1), documents=DOCS, method="full_reuse")
    cache = llm.engine.chunk_cache
    key = next(iter(cache._entries))
    entry = cache._entries[key]
    k, v = cache.gather(entry)  # [L, n, 1, w]: keys at the canonical positions
    attn, adapter = llm.model.model.layers[0].self_attn, llm.engine.adapter
    ids = torch.tensor(entry.token_ids)
    with torch.no_grad():
        x = llm.model.model.layers[0].input_layernorm(llm.model.model.embed_tokens(ids))
        for delta in (0, 37, -entry.start):
            pos = torch.arange(entry.start, entry.start + len(ids)) + delta
            rows = attn.project(x, pos)[2]
            w = k.shape[-1]
            moved = adapter.relocate(k[0], delta)
            torch.testing.assert_close(moved[:, 0], rows[:, :w], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[0, :, 0], rows[:, w:], rtol=1e-5, atol=1e-5)
            rope = llm.config.mla.qk_rope_head_dim
            assert torch.equal(moved[:, 0, rope:], k[0, :, 0, rope:])  # only the RoPE part turns
    llm.engine.clear_caches()


def test_profiler_classifies_query_heads(tiny_checkpoint, tmp_path):
    import argparse

    from redknot.profile import cli as profile_cli

    path = tiny_checkpoint("deepseek_v3")
    p = argparse.ArgumentParser()
    profile_cli.add_arguments(p)
    args = p.parse_args(["--model", str(path), "--out", str(tmp_path / "heads.json"), "--samples", "2",
                         "--ref-window", "32", "--page-size", "16", "--max-tokens", "256", "--no-progress",
                         "--target-global", "0.25"])
    assert profile_cli.run(args) == 0
    plan = HeadConfig.from_json(tmp_path / "heads.json").validate_model(3, 4)  # layers x query heads
    counts = plan.class_counts()
    assert counts["global"] == 3 and counts["retrieval"] == 0 and counts["local"] == 9
    llm = LLM(model=path, device="cpu", head_config=plan, method="headsparse", page_size=16)
    assert len(llm.generate(LONG, greedy(4))[0].outputs[0].token_ids) == 4


def test_retrieval_heads_are_refused_by_name(tiny_checkpoint):
    hc = HeadConfig([["global", "retrieval", "local", "local"]] * 3, [[-1, 16, 16, 16]] * 3, [[0, 4, 4, 4]] * 3)
    with pytest.raises(ValueError, match=r"kv_head_classification\[0\]\[1\] = 'retrieval'"):
        LLM(model=tiny_checkpoint("deepseek_v3"), device="cpu", head_config=hc)


@pytest.mark.parametrize("family,edit,match", [
    ("deepseek_v3", lambda c: c.update(num_key_value_heads=2), "num_key_value_heads=2"),
    ("deepseek_v3", lambda c: c.update(kv_lora_rank=33), "kv_lora_rank=33"),
    ("deepseek_v3", lambda c: c.update(qk_rope_head_dim=48), "qk_rope_head_dim=48"),
    ("deepseek_v3", lambda c: c.update(topk_method="greedy"), "topk_method='greedy'"),
    ("deepseek_v3", lambda c: c.update(scoring_func="softmax"), "scoring_func='softmax'"),
    ("deepseek_v3", lambda c: c.update(n_group=3), "n_group=3"),
    ("deepseek_v3", lambda c: c.update(n_routed_experts=0), "n_routed_experts"),
    ("deepseek_v3", lambda c: c.update(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ("deepseek_v3", lambda c: c.update(moe_layer_freq=2), "moe_layer_freq"),
    ("deepseek_v2", lambda c: c.update(norm_topk_prob=True), "norm_topk_prob"),
    ("deepseek_v2", lambda c: c.update(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
])
def test_unsupported_config_names_the_field(tiny_checkpoint, tmp_path, family, edit, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_dir(edited_checkpoint(tiny_checkpoint(family), tmp_path / "ck", edit))


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="the Triton decode and CUDA graphs need a GPU")
@pytest.mark.parametrize("plan", ["dense", "headsparse"])
def test_cuda_graph_decode_equals_eager_and_transformers(tiny_checkpoint, plan):
    """The Triton latent decode (no host sync) inside captured decode graphs, beside the fused
    experts: the tokens of eager decode; the logits of transformers (dense) or of the float64
    masked reference (a query-head plan)."""
    path = tiny_checkpoint("deepseek_v3")
    hc = HEAD_PLAN if plan == "headsparse" else None
    prompts = [LONG[: 20 + 25 * i] for i in range(5)]
    outs = []
    for graphs in (True, False):
        llm = LLM(model=path, device="cuda", dtype="float32", cuda_graphs=graphs, page_size=16, kv_pages=2048,
                  method=plan, head_config=hc)
        replays = []
        if graphs:
            runner = llm.engine.runner
            replay = runner._replay
            runner._replay = lambda *a: replays.append(1) or replay(*a)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24))])
        assert (len(replays) > 0) == graphs
    assert outs[0] == outs[1]
    hf = (_f64_reference_with_head_mask(path, hc) if hc is not None
          else transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    ids = llm.tokenizer(LONG, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids).logits[0, -1].float()
        gen = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    assert cos(llm.first_token_logits(LONG).cpu(), ref) >= 0.99999
    assert llm.generate(LONG, greedy(16))[0].outputs[0].token_ids == gen


def test_decode_bench_bound_reads_the_latent_rows(tmp_path, capsys):
    """`redknot bench decode --arch tiny-deepseek` on a CPU: the KV bytes of the bound are one
    [k_rope | latent] row per token and layer, and a plan of local query heads reads fewer."""
    import argparse

    from redknot.bench import decode as bd

    p = argparse.ArgumentParser()
    bd.add_arguments(p)
    result = bd.run(p.parse_args(["--arch", "tiny-deepseek", "--cases", "2x200", "--methods", "dense,headsparse,hf",
                                  "--tokens", "3", "--head-config", "g0-w64", "--device", "cpu",
                                  "--no-cuda-graphs", "--out", str(tmp_path / "decode.json")]))
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["hf"]["tok_s"] > 0 and rows["dense"]["tok_s"] > 0 and rows["headsparse"]["tok_s"] > 0
    assert rows["dense"]["kv_read_bytes"] == 2 * 200 * 3 * (16 + 32) * 4  # B x context x layers x row x fp32
    # every query head local (window 64, sink 4): a layer reads its sink and window rows once
    assert rows["headsparse"]["kv_read_bytes"] == 2 * (4 + 64) * 3 * (16 + 32) * 4
    assert "latent attention" in capsys.readouterr().out


def test_decode_kv_budgets_are_refused_with_a_reason(tiny_checkpoint):
    with pytest.raises(ValueError, match="selected sets .* are kept per KV head; deepseek_v3 stores 1"):
        LLM(model=tiny_checkpoint("deepseek_v3"), device="cpu", decode_kv_budget=0.5)


@pytest.mark.skipif(DEVICE != "cpu", reason="the Triton kernels under the interpreter (a GPU runs them in the CUDA test)")
def test_triton_path_equals_torch_with_prefill_chunks_beside_decodes(tiny_checkpoint):
    """kernel="triton" (the GPU's path): rows stored by the Triton store, decodes through the Triton
    latent decode, also when a prefill chunk shares the step (16-token budget), prefill chunks and
    a recovery's rows expanded per head through the SegPaged kernel; the torch path's tokens and
    logits."""
    pytest.importorskip("triton")
    path = tiny_checkpoint("deepseek_v3")
    prompts = [PROMPT[:20], PROMPT]
    outs, logits = [], []
    for kernel in ("torch", "triton"):
        llm = LLM(model=path, device="cpu", page_size=16, head_config=HEAD_PLAN, kernel=kernel,
                  max_num_batched_tokens=16, enable_prefix_caching=False)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(6), method="headsparse")])
        logits.append(llm.first_token_logits(PROMPT, documents=DOCS, method="redknot"))
    assert outs[0] == outs[1]
    assert rel(logits[1], logits[0]) <= 1e-5


def test_multi_token_prediction_layers_are_skipped(tiny_checkpoint, tmp_path):
    """DeepSeek-V3 checkpoints carry the MTP module as the layer past the last (transformers skips it)."""
    from safetensors.torch import load_file, save_file

    path = edited_checkpoint(tiny_checkpoint("deepseek_v3"), tmp_path / "ck", lambda c: None)
    weights = load_file(path / "model.safetensors")
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    weights["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(4 * 32, 32)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(model=path, device="cpu")
    assert rel(llm.first_token_logits(PROMPT), LLM(model=tiny_checkpoint("deepseek_v3"), device="cpu")
               .first_token_logits(PROMPT)) == 0

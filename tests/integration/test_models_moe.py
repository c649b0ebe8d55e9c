"""Mixture-of-experts families (qwen3_moe, mixtral, olmoe, qwen2_moe) against transformers on tiny
random checkpoints: logits, greedy tokens, a per-head mask, every reuse method, the sparse FFN's
shared expert, loading errors, and on a GPU the fused experts under CUDA-graph decode."""

import os

import pytest
import torch
import transformers

from redknot import LLM, HeadConfig, SamplingParams
from redknot.config import SparseFFNConfig
from redknot.models import CheckpointError, UnsupportedModelError
from redknot.reuse.prompt import build_prompt
from redknot.reuse.registry import METHODS
from oracles.reuse_engine import reuse_oracle
from oracles.hf_head_mask import hf_with_head_mask
from oracles.hf_reference import hf_last_logits_and_greedy, edited_checkpoint

DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")
PROMPT = "Question: who founded the city of Varna? Answer: the merchants of the old salt road"
DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120. " * 2,
        "Attention heads differ: some look far back, most look at recent tokens. " * 2]

CASES = [
    ("qwen3_moe", {}),
    ("qwen3_moe", {"mlp_only_layers": [0], "attention_bias": True, "norm_topk_prob": False}),
    ("mixtral", {}),
    ("mixtral", {"sliding_window": 7}),
    ("olmoe", {}),
    ("olmoe", {"clip_qkv": 0.3, "attention_bias": True, "norm_topk_prob": True}),
    ("qwen2_moe", {}),
    ("qwen2_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 3, "qkv_bias": False}),
]


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("family,kw", CASES, ids=[f"{f}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'base'}"
                                                  for f, kw in CASES])
def test_logits_and_greedy_tokens_match_transformers(tiny_checkpoint, family, kw):
    path = tiny_checkpoint(family, **kw)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, device="cpu", dtype="float32")
    assert llm.config.moe is not None and any(llm.config.moe.layers)
    ids = llm.tokenizer(PROMPT, return_tensors="pt").input_ids
    ref, gen = hf_last_logits_and_greedy(hf, ids)
    ours = llm.first_token_logits(PROMPT)
    assert ((ours - ref).norm() / ref.norm()).item() <= 1e-4 and cos(ours, ref) >= 0.99999
    assert llm.generate(PROMPT, greedy(20))[0].outputs[0].token_ids == gen


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_headsparse_equals_transformers_with_head_mask(tiny_checkpoint, family):
    path = tiny_checkpoint(family, num_hidden_layers=3, num_key_value_heads=4, num_attention_heads=8, head_dim=8)
    hc = HeadConfig([["global", "local", "local", "retrieval"], ["local", "global", "local", "local"],
                     ["dense", "local", "global", "local"]],
                    [[-1, 5, 13, -1], [9, -1, 20, 3], [-1, 7, -1, 1]],
                    [[0, 4, 0, 0], [2, 0, 1, 4], [0, 3, 0, 0]])
    llm = LLM(model=path, device="cpu", method="headsparse", head_config=hc, page_size=16)
    hf = hf_with_head_mask(path, hc, llm.config)
    prompt = PROMPT + ". " + DOCS[0]
    ids = llm.tokenizer(prompt, return_tensors="pt").input_ids
    ref, gen = hf_last_logits_and_greedy(hf, ids)
    ours = llm.first_token_logits(prompt)
    assert ((ours - ref).norm() / ref.norm()).item() <= 1e-4
    dense = LLM(model=path, device="cpu").first_token_logits(prompt)
    assert ((dense - ref).norm() / ref.norm()).item() > 1e-3  # the mask really changes the result
    assert llm.generate(prompt, greedy(20))[0].outputs[0].token_ids == gen


@pytest.fixture(scope="module")
def moe_llm(tiny_checkpoint):
    """qwen2_moe (routed experts + a shared expert) with a sparse FFN from layer 2 on."""
    sparse = SparseFFNConfig(dense_until=1, mass_thresh=0.3, deep_layer_start=2, mass_thresh_deep=0.1, recent_n=8,
                             min_keep=4)
    return LLM(model=tiny_checkpoint("qwen2_moe", num_hidden_layers=3), device="cpu", page_size=16, sparse_ffn=sparse,
               head_config=HeadConfig.synthetic(3, 2, 0.5, window=16, sink=4))


def test_every_reuse_method_runs_on_a_moe_model(moe_llm):
    params = greedy(4)
    for method in METHODS:
        out = moe_llm.generate([PROMPT, "Question: what do heads do?"], params, documents=[DOCS, DOCS[::-1]],
                               method=method)
        assert [len(o.outputs[0].token_ids) for o in out] == [4, 4], method
    assert moe_llm.engine.request_kv_bytes() == 0
    moe_llm.engine.clear_caches()
    assert moe_llm.pool.num_free_pages == moe_llm.pool.num_pages


def test_exact_recovery_equals_dense_and_sparse_recovery_equals_its_oracle(moe_llm):
    """redknot_exact (every row through every FFN) is the dense prefill; ``redknot`` batched (its
    sparse FFN: skipped rows keep the shared expert) gives the logits and FLOPs of the reference
    recovery forward."""
    moe_llm.engine.clear_caches()
    dense = moe_llm.first_token_logits(PROMPT, documents=DOCS, method="dense")
    exact = moe_llm.first_token_logits(PROMPT, documents=DOCS, method="redknot_exact")
    assert cos(exact, dense) >= 0.99999 and exact.argmax() == dense.argmax()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_first_logits=True)
    out = moe_llm.generate([PROMPT, PROMPT], params, documents=[DOCS, DOCS[::-1]], method="redknot")
    for o, docs in zip(out, [DOCS, DOCS[::-1]]):
        oracle = reuse_oracle(moe_llm).prefill(build_prompt(moe_llm.tokenizer, PROMPT, docs), "redknot").recovered
        torch.testing.assert_close(o.first_token_logits, oracle.logits, rtol=1e-4, atol=1e-4)
        assert o.metrics["flops"] == oracle.flops.totals()
        ffn = oracle.flops
        assert ffn.ffn_tokens[-1] < ffn.tokens[-1]  # the last layer's FFN was sparse


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_sparse_ffn_rows_skip_the_routed_experts_only(tiny_checkpoint, family):
    """A layer's FFN under a row plan: the picked rows get the whole MoE block, the others keep
    their residual plus the shared expert's output (qwen2_moe) or exactly their residual."""
    llm = LLM(model=tiny_checkpoint(family), device="cpu")
    layer = llm.model.model.layers[1]
    x = torch.randn(9, llm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([1, 2, 6])
    rest = torch.tensor([0, 3, 4, 5, 7, 8])
    with torch.no_grad():
        full = layer.add_ffn(x)
        sparse = layer.add_ffn(x, rows)
        normed = layer.post_attention_layernorm(x)
        shared = layer.mlp.shared(normed)
    torch.testing.assert_close(sparse[rows], full[rows], rtol=1e-6, atol=1e-6)
    if family == "qwen2_moe":
        assert torch.equal(sparse[rest], x[rest] + shared[rest])
    else:
        assert shared is None and torch.equal(sparse[rest], x[rest])


@pytest.mark.parametrize("family,edit,match", [
    ("qwen3_moe", lambda c: c.update(num_experts_per_tok=9), "num_experts_per_tok=9"),
    ("qwen3_moe", lambda c: c.update(decoder_sparse_step=0), "decoder_sparse_step"),
    ("qwen2_moe", lambda c: c.update(mlp_only_layers=[5]), "mlp_only_layers"),
    ("qwen2_moe", lambda c: c.update(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
    ("mixtral", lambda c: c.pop("num_local_experts"), "num_local_experts"),
    ("olmoe", lambda c: c.update(head_dim=8), "head_dim"),
    ("olmoe", lambda c: c.update(clip_qkv=-1), "clip_qkv"),
])
def test_unsupported_moe_config_names_the_field(tiny_checkpoint, tmp_path, family, edit, match):
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(model=edited_checkpoint(tiny_checkpoint(family), tmp_path / "ck", edit), device="cpu")


@pytest.mark.parametrize("family,edit,match", [
    ("qwen3_moe", lambda c: c.update(moe_intermediate_size=16), "has shape"),
    ("mixtral", lambda c: c.update(num_local_experts=4), "does not fit"),
])
def test_expert_weights_that_do_not_match_the_config(tiny_checkpoint, tmp_path, family, edit, match):
    with pytest.raises(CheckpointError, match=match):
        LLM(model=edited_checkpoint(tiny_checkpoint(family), tmp_path / "ck", edit), device="cpu")


def test_one_missing_expert_projection_is_a_missing_weight(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = edited_checkpoint(tiny_checkpoint("olmoe"), tmp_path / "ck", lambda c: None)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing weights: \['model.layers.1.mlp.experts.gate_up_proj'\]"):
        LLM(model=path, device="cpu")


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="the fused experts and CUDA graphs need a GPU")
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_cuda_graph_decode_with_fused_experts_equals_eager_and_transformers(tiny_checkpoint, family):
    """The fused Triton experts (no host sync) inside captured decode graphs: the tokens of eager
    decode, and the logits of transformers."""
    path = tiny_checkpoint(family)
    prompts = [PROMPT[: 20 + 15 * i] for i in range(5)]
    outs = []
    for graphs in (True, False):
        llm = LLM(model=path, device="cuda", dtype="float32", cuda_graphs=graphs, page_size=16, kv_pages=2048)
        replays = []
        if graphs:
            runner = llm.engine.runner
            replay = runner._replay
            runner._replay = lambda *a: replays.append(1) or replay(*a)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24))])
        assert (len(replays) > 0) == graphs
    assert outs[0] == outs[1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ids = llm.tokenizer(PROMPT, return_tensors="pt").input_ids.cuda()
    with torch.no_grad():
        ref = hf(ids).logits[0, -1].float().cpu()
    ours = llm.first_token_logits(PROMPT).cpu()
    assert cos(ours, ref) >= 0.99999

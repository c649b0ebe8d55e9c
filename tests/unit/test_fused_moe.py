"""Mixture-of-experts: the torch reference against transformers' MoE blocks, and each step of the
fused Triton kernels against its torch reference (in the interpreter on CPU, small random shapes)."""

import os

import pytest
import torch
import transformers

from redknot.kernels.moe_reference import (align_reference, down_reference, experts_reference, gate_up_reference)
from redknot.models.config import MoEConfig
from redknot.models.loader import expert_target
from redknot.models.moe import SparseMoeBlock

DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")
fm = pytest.importorskip("redknot.kernels.fused_moe")


def routed(t, e, k, seed=0, skew=False):
    """Routing weights and ids [t, k] (``skew``: most pairs on two experts, some experts without any)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if skew:
        logits[:, :2] += 4
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    return w.to(DEVICE), ids.to(DEVICE)


def experts(e, h, i, bias, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    dn = torch.randn(e, h, i, generator=g) * i**-0.5
    bgu = torch.randn(e, 2 * i, generator=g) if bias else None
    bdn = torch.randn(e, h, generator=g) if bias else None
    return [None if w is None else w.to(DEVICE, dtype) for w in (gu, dn, bgu, bdn)]


@pytest.mark.parametrize("t,e,k,block_m,skew", [(1, 8, 2, 16, False), (7, 8, 8, 16, False), (75, 128, 4, 16, True),
                                                (40, 6, 2, 32, True), (130, 4, 1, 64, False)])
def test_align_matches_reference_and_sorts_pairs_by_expert(t, e, k, block_m, skew):
    _, ids = routed(t, e, k, skew=skew)
    slot_pair, block_expert = fm.align(ids, e, block_m)
    ref_pair, ref_expert = align_reference(ids, e, block_m)
    assert torch.equal(slot_pair, ref_pair) and torch.equal(block_expert, ref_expert)
    # the layout itself: worst-case size, every pair once, each block one expert's pairs in pair order
    n = t * k
    assert slot_pair.numel() == -(-(n + e * (block_m - 1)) // block_m) * block_m
    pairs = slot_pair[slot_pair < n].long()
    assert sorted(pairs.tolist()) == list(range(n))
    flat = ids.reshape(-1).cpu()
    for b, expert in enumerate(block_expert.tolist()):
        block = slot_pair[b * block_m:(b + 1) * block_m].cpu().long()
        real = block[block < n]
        if expert < 0:
            assert real.numel() == 0
            continue
        assert (flat[real] == expert).all() and real.tolist() == sorted(real.tolist())
    assert pairs.tolist() == torch.argsort(flat, stable=True).tolist()


@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
@pytest.mark.parametrize("bias", [False, True])
def test_each_kernel_step_matches_its_reference(activation, bias):
    t, e, k, h, i = 9, 8, 3, 40, 24  # H and I not multiples of the blocks
    gu, dn, bgu, bdn = experts(e, h, i, bias)
    if activation == "swiglu_clamped":
        gu = gu * 8  # pre-activations past the clamp limit
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    w, ids = routed(t, e, k, seed=3)
    cfg = fm.block_config(t * k, e)
    slot_pair, block_expert = fm.align(ids, e, cfg["BLOCK_M"])
    valid = slot_pair < t * k
    inter = fm.gate_up(x, gu, slot_pair, block_expert, k, activation, bgu)
    inter_ref = gate_up_reference(x, gu, slot_pair, block_expert, k, activation, bgu)
    torch.testing.assert_close(inter[valid], inter_ref[valid], rtol=1e-5, atol=1e-5)
    if activation == "swiglu_clamped":
        assert inter_ref.abs().max() > 7  # the clamp was exercised ((up + 1) * glu exceeds the limit)
    out = fm.down(inter_ref, dn, slot_pair, block_expert, w, bdn)
    torch.testing.assert_close(out, down_reference(inter_ref, dn, slot_pair, block_expert, w, bdn), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,e,k,activation,bias", [(1, 8, 2, "silu", False), (23, 8, 2, "swiglu_clamped", True),
                                                   (150, 2, 1, "silu", True), (48, 4, 2, "silu", False)])
def test_fused_experts_match_the_reference(t, e, k, activation, bias):
    """Every tile configuration of the grouped path (16-, 32- and 64-row blocks by pairs per expert)."""
    h, i = 32, 48
    gu, dn, bgu, bdn = experts(e, h, i, bias)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    w, ids = routed(t, e, k, seed=5, skew=True)
    ref = experts_reference(x, gu, dn, w, ids, activation, bgu, bdn)
    out = fm.fused_experts(x, gu, dn, w, ids, activation, bgu, bdn, path="grouped")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert fm.fused_experts(x[:0], gu, dn, w[:0], ids[:0], activation, bgu, bdn).shape == (0, h)


@pytest.mark.parametrize("seed", range(6))
def test_few_token_gemv_path_matches_the_reference(seed):
    """Random shapes, T = 1..4, H and I not multiples of the tiles, down's K split or not:
    Qwen3-MoE style (silu, no biases) and gpt-oss style (expert biases, pre-activations past the
    SwiGLU clamp)."""
    g = torch.Generator().manual_seed(100 + seed)
    t, k = 1 + seed % 4, int(torch.randint(1, 5, (1,), generator=g))
    e = k + int(torch.randint(0, 6, (1,), generator=g))
    h, i = (int(v) for v in torch.randint(17, 90, (2,), generator=g))
    gpt_oss = seed % 2 == 1
    activation = "swiglu_clamped" if gpt_oss else "silu"
    gu, dn, bgu, bdn = experts(e, h, i, gpt_oss, seed=seed)
    if gpt_oss:
        gu = gu * 8
    x = torch.randn(t, h, generator=g).to(DEVICE)
    w, ids = routed(t, e, k, seed=seed)
    ref = experts_reference(x, gu, dn, w, ids, activation, bgu, bdn, limit=3.0)
    configs = [None, dict(gate_up=(8, 16, 1), down=(8, 16, 1, 3))]  # the default tiles; 3 splits of down's K
    outs = [fm.gemv_experts(x, gu, dn, w, ids, activation, bgu, bdn, limit=3.0, config=cfg) for cfg in configs]
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # few pairs: the entry point takes this path (the same launches, so the same bits)
    assert t * k <= fm.SMALL_PAIRS
    assert torch.equal(fm.fused_experts(x, gu, dn, w, ids, activation, bgu, bdn, limit=3.0), outs[0])


def test_gemv_config_fills_the_card_and_splits_only_when_short():
    qwen = fm.gemv_config(8, 2048, 768)  # Qwen3-30B-A3B at T = 1
    assert 8 * -(-768 // qwen["gate_up"][0]) >= 256 and qwen["down"][3] == 1
    tiny = fm.gemv_config(2, 64, 512)  # few, narrow rows: down's K is split
    assert tiny["down"][0] == 8 and tiny["down"][3] > 1


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 at real widths on the GPU")
@pytest.mark.parametrize("t", [1, 64, 700])  # 700 x 8 pairs: the sorted (torch) alignment
def test_fused_experts_bf16_at_real_widths(t):
    e, k, h, i = 128, 8, 2048, 768
    gu, dn, _, _ = experts(e, h, i, False, dtype=torch.bfloat16)
    x = torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16)
    w, ids = routed(t, e, k, seed=6)
    ref = experts_reference(x.float(), gu.float(), dn.float(), w, ids)
    for path in ("auto", "grouped"):
        out = fm.fused_experts(x, gu, dn, w, ids, path=path).float()
        assert ((out - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 at real widths on the GPU")
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("arch", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_gemv_path_bf16_at_real_widths(t, arch):
    e, k, h, i, act = (128, 8, 2048, 768, "silu") if arch == "qwen3-30b-a3b" else (32, 4, 2880, 2880, "swiglu_clamped")
    gu, dn, bgu, bdn = experts(e, h, i, act != "silu", dtype=torch.bfloat16)
    x = torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16)
    w, ids = routed(t, e, k, seed=7)
    ref = experts_reference(x.float(), gu.float(), dn.float(), w, ids, act,
                            *(None if b is None else b.float() for b in (bgu, bdn)))
    out = fm.gemv_experts(x, gu, dn, w, ids, act, bgu, bdn).float()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


# ---- the torch forward against transformers' blocks


def _hf_block(cls_config, block_path, **kw):
    cfg = cls_config(hidden_size=32, num_experts_per_tok=2, **kw)
    cfg._experts_implementation = "eager"
    module, name = block_path.rsplit(".", 1)
    block = getattr(__import__(module, fromlist=[name]), name)(cfg).double().eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return block


def _load_block(ours: SparseMoeBlock, hf_state: dict, moe: MoEConfig):
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for key, tensor in hf_state.items():
            name, index, tensor = expert_target(key, tensor, moe) or (key, (slice(None),), tensor)
            params[name][index].copy_(tensor)


def test_qwen2_moe_block_with_shared_expert_equals_transformers():
    from redknot.models.config import ModelConfig
    from redknot.models.llama import MLP

    hf = _hf_block(transformers.Qwen2MoeConfig, "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                   num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=24, norm_topk_prob=False)
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=16, layers=[True], shared_expert_intermediate_size=24)
    cfg = ModelConfig("qwen2_moe", 10, 32, 24, 1, 4, 4, 8, 64, moe=moe)
    ours = SparseMoeBlock(32, moe, MLP(cfg, 24)).double()
    # the per-expert keys transformers' save_pretrained writes
    state = {k: v for k, v in hf.state_dict().items() if not k.startswith("experts.")}
    for e in range(8):
        gate, up = hf.experts.gate_up_proj[e].chunk(2, dim=0)
        state |= {f"experts.{e}.gate_proj.weight": gate, f"experts.{e}.up_proj.weight": up,
                  f"experts.{e}.down_proj.weight": hf.experts.down_proj[e]}
    _load_block(ours, state, moe)
    x = torch.randn(13, 32, dtype=torch.float64)
    with torch.no_grad():
        ref = hf(x[None])[0]
        torch.testing.assert_close(ours(x), ref, rtol=1e-10, atol=1e-10)
        # the sparse FFN: rows outside `routed` get exactly the shared expert, the others the whole block
        rows = torch.tensor([0, 4, 5, 12])
        out = ours(x, routed=rows)
        shared = torch.sigmoid(hf.shared_expert_gate(x)) * hf.shared_expert(x)
        rest = torch.ones(13, dtype=torch.bool)
        rest[rows] = False
        assert torch.equal(out[rest], shared[rest])
        torch.testing.assert_close(out[rows], ref[rows], rtol=1e-10, atol=1e-10)


def test_gpt_oss_block_equals_transformers():
    """gpt-oss: router bias, top-k then softmax, expert biases, the clamped SwiGLU, and its fused
    checkpoint layout ([E, H, 2I] gate/up interleaved) mapped into the experts' [E, 2I, H]."""
    hf = _hf_block(transformers.GptOssConfig, "transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP",
                   num_local_experts=8, intermediate_size=16)
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=16, layers=[True], routing="topk_softmax",
                    activation="swiglu_clamped", router_bias=True, expert_bias=True, router_name="router",
                    checkpoint_layout="gpt_oss")
    ours = SparseMoeBlock(32, moe).double()
    _load_block(ours, hf.state_dict(), moe)
    x = torch.randn(11, 32, dtype=torch.float64) * 3  # wide enough to clamp
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x[None])[0][0], rtol=1e-10, atol=1e-10)
        assert torch.equal(ours(x, routed=torch.tensor([], dtype=torch.long)), torch.zeros_like(x))


def test_expert_target_maps_checkpoint_keys_and_rejects_bad_shapes():
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=3, layers=[True])
    t = torch.zeros(3, 5)
    assert expert_target("model.layers.1.mlp.experts.2.up_proj.weight", t, moe)[:2] == (
        "model.layers.1.mlp.experts.gate_up_proj", (2, slice(3, 6)))
    assert expert_target("model.layers.0.mlp.experts.3.w1.weight", t, moe)[:2] == (
        "model.layers.0.mlp.experts.gate_up_proj", (3, slice(0, 3)))
    assert expert_target("model.layers.0.mlp.experts.1.w2.weight", t.T, moe)[:2] == (
        "model.layers.0.mlp.experts.down_proj", (1,))
    assert expert_target("model.layers.0.mlp.experts.gate_up_proj", t, moe) is None  # already the layout
    assert expert_target("model.layers.0.mlp.gate.weight", t, moe) is None
    assert expert_target("model.layers.0.mlp.experts.1.w2.weight", t, None) is None  # a dense model

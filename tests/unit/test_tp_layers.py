"""The tensor-parallel shards against the unsharded model, in one process: each rank's partial
outputs (no collectives wired) add up, or concatenate, to the full layer's."""

from __future__ import annotations

import pytest
import torch

from redknot.config import HeadConfig
from redknot.distributed.balance import balanced_order, imbalance, permute_head_config
from redknot.distributed.shard import Shard, check_tensor_parallel, shard_model
from redknot.models import load_model
from redknot.models.config import UnsupportedModelError


@pytest.fixture(scope="module")
def full(tiny_checkpoint):
    # qwen2: q/k/v biases; 4 KV heads, 2 query heads each
    return load_model(tiny_checkpoint("qwen2", num_attention_heads=8, num_key_value_heads=4), dtype="float32",
                      device="cpu")


ORDER = [[2, 0, 3, 1], [1, 3, 0, 2]]  # a permutation per layer: rank 0 holds the first two heads


@pytest.fixture(scope="module")
def shards(full):
    model, cfg = full
    return [shard_model(model, Shard(cfg, r, 2, ORDER)) for r in range(2)]


def test_vocab_parallel_embedding_and_lm_head(full, shards):
    model, cfg = full
    ids = torch.tensor([0, 1, 7, cfg.vocab_size // 2, cfg.vocab_size - 1])
    torch.testing.assert_close(sum(s.model.embed_tokens(ids) for s in shards), model.model.embed_tokens(ids),
                               rtol=0, atol=0)
    h = torch.randn(3, cfg.hidden_size)
    logits = torch.cat([s.logits(h) for s in shards], dim=-1)[:, :cfg.vocab_size]
    torch.testing.assert_close(logits, model.logits(h))


def test_column_parallel_qkv_holds_whole_kv_heads_with_their_query_heads(full, shards):
    model, cfg = full
    x, pos = torch.randn(5, cfg.hidden_size), torch.arange(5)
    for layer in range(cfg.num_hidden_layers):
        q, k, v = model.model.layers[layer].self_attn.qkv(x, pos)
        for r, s in enumerate(shards):
            heads = ORDER[layer][2 * r:2 * r + 2]
            ql, kl, vl = s.model.layers[layer].self_attn.qkv(x, pos)
            torch.testing.assert_close(kl, k[:, heads])
            torch.testing.assert_close(vl, v[:, heads])
            torch.testing.assert_close(ql, q[:, [2 * h + i for h in heads for i in range(2)]])


def test_row_parallel_o_proj_and_mlp_sum_to_the_full_layer(full, shards):
    model, cfg = full
    x = torch.randn(4, cfg.hidden_size)
    attn_out = torch.randn(4, cfg.num_attention_heads, cfg.head_dim)
    for layer in range(cfg.num_hidden_layers):
        full_attn = model.model.layers[layer].self_attn
        parts = []
        for r, s in enumerate(shards):
            heads = [2 * h + i for h in ORDER[layer][2 * r:2 * r + 2] for i in range(2)]
            parts.append(s.model.layers[layer].self_attn.project_out(attn_out[:, heads].reshape(4, -1)))
        torch.testing.assert_close(sum(parts), full_attn.o_proj(attn_out.reshape(4, -1)))
        torch.testing.assert_close(sum(s.model.layers[layer].mlp(x) for s in shards), model.model.layers[layer].mlp(x))


def test_each_rank_holds_half_the_weights(full, shards):
    model, _ = full
    total = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    for s in shards:
        assert sum(p.numel() for p in s.parameters()) - norms == pytest.approx((total - norms) / 2, rel=0.02)


def test_head_plan_slices_follow_the_order(full):
    _, cfg = full
    hc = HeadConfig.from_global_mask([[True, False, False, True], [False, True, True, False]], window=8, sink=4)
    sliced = Shard(cfg, 1, 2, ORDER).head_config(hc)
    assert sliced.classes == [["global", "local"], ["local", "global"]]  # layer 0 heads 3, 1; layer 1 heads 0, 2
    assert permute_head_config(hc, ORDER).classes[0] == ["local", "global", "global", "local"]


def test_balancing_spreads_global_heads_and_reports_the_imbalance():
    hc = HeadConfig.from_global_mask([[True, True, True, True, False, False, False, False]] * 3, window=64, sink=4)
    before = imbalance(hc, 2, context=4096)
    assert before["global_heads"] == [12, 0] and before["reads"] == [12 * 4096, 12 * 68]
    order = balanced_order(hc, 2, context=4096)
    after = imbalance(hc, 2, order, context=4096)
    assert after["global_heads"] == [6, 6] and after["max_over_mean"] == 1.0
    assert all(sorted(o) == list(range(8)) for o in order)  # a permutation of each layer's heads
    four = imbalance(hc, 4, balanced_order(hc, 4, context=4096), context=4096)
    assert four["global_heads"] == [3, 3, 3, 3]


def test_what_cannot_be_split_is_a_clear_error(full):
    _, cfg = full
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads=4"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ValueError, match="positive integer"):
        check_tensor_parallel(cfg, -1)


def _agree_min_rank(rank: int, address: str, out) -> None:
    from redknot.distributed.group import close_group, init_group
    group = init_group(rank, 2, address, torch.device("cpu"), timeout_s=30)
    try:
        out.put((rank, group.agree_min(100 + 7 * rank)))
    finally:
        close_group()


def test_ranks_agree_on_the_smallest_pool():
    """Pools are sized alike on every rank (the smallest profiled size), or they would admit differently."""
    import torch.multiprocessing as mp

    from redknot.distributed.group import free_address
    ctx = mp.get_context("spawn")
    out, address = ctx.Queue(), free_address()
    procs = [ctx.Process(target=_agree_min_rank, args=(r, address, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: 100, 1: 100}

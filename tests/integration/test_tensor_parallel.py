"""Tensor parallelism on CPU: two processes over gloo give the tokens one process gives, for dense,
the head plan and the reuse methods, with a head plan whose global heads all sit on rank 0 rebalanced."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from redknot import LLM, HeadConfig, SamplingParams
from redknot.config import SparseFFNConfig
from redknot.distributed.workers import WorkerDied
from redknot.models.config import UnsupportedModelError

DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120, on the delta of the Sel river. " * 2,
        "Attention heads differ: some look far back over the context, most look at recent tokens only. " * 2,
        "The quick brown fox jumps over the lazy dog near the old mill, where the miller keeps geese. " * 2]
QUESTIONS = ["Question: who founded the city of Varna? Answer:", "Question: what does the miller keep? Answer:"]
METHODS = ["dense", "headsparse", "full_reuse", "cacheblend", "redknot", "qrecompute@0.3+qp+kc0.5"]
# heads 0 and 1 of every layer global: unbalanced, both on rank 0 in checkpoint order
PLAN = HeadConfig.from_global_mask([[True, True, False, False]] * 2, window=16, sink=4)
SPARSE = SparseFFNConfig(dense_until=1, keep_fraction=0.4, importance="cross", recent_n=8, min_keep=4)


def _kwargs(path):
    return dict(model=path, dtype=torch.float32, device="cpu", kv_pages=2048, page_size=8, head_config=PLAN,
                sparse_ffn=SPARSE, cuda_graphs=False)


def _tokens(llm: LLM) -> dict[str, list]:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = {}
    for method in METHODS:
        batch = llm.generate(QUESTIONS, params, documents=[DOCS, [DOCS[2], DOCS[0]]], method=method)
        warm = llm.generate(QUESTIONS[0], params, documents=[DOCS[1], DOCS[2], DOCS[0]], method=method)
        out[method] = [r.outputs[0].token_ids for r in batch + warm]
    return out


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def tp2(checkpoint):
    llm = LLM(**_kwargs(checkpoint), tensor_parallel_size=2)
    yield llm
    llm.close()


def test_tp2_tokens_equal_tp1_for_dense_headsparse_and_reuse(checkpoint, tp2):
    one = _tokens(LLM(**_kwargs(checkpoint)))
    two = _tokens(tp2)
    assert two == one
    assert len({tuple(t) for t in one["dense"]}) > 1  # the prompts give different tokens


def test_a_plan_with_every_global_head_on_one_rank_is_rebalanced(tp2):
    before, after = tp2.tp.imbalance["before"], tp2.tp.imbalance["after"]
    assert before["global_heads"] == [4, 0] and before["max_over_mean"] > 1.9
    assert after["global_heads"] == [2, 2] and after["max_over_mean"] == 1.0
    # rank 0 holds one global and one local head of each layer, its pool and plan only those two
    local = tp2.engine.head_config
    assert local.num_kv_heads == 2 and all(sorted(row) == ["global", "local"] for row in local.classes)
    assert tp2.engine.pool.num_kv_heads == 2


def test_bad_tensor_parallel_sizes_fail_before_any_worker_starts(checkpoint, tiny_checkpoint):
    with pytest.raises(ValueError, match="positive integer"):
        LLM(**_kwargs(checkpoint), tensor_parallel_size=0)
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads=4"):
        LLM(**_kwargs(checkpoint), tensor_parallel_size=3)
    with pytest.raises(UnsupportedModelError, match="qwen3_moe"):
        LLM(tiny_checkpoint("qwen3_moe"), dtype=torch.float32, device="cpu", tensor_parallel_size=2)


def test_a_dead_worker_is_a_clear_error_not_a_hang(tp2):
    os.kill(tp2.tp.workers.procs[0].pid, signal.SIGKILL)
    tp2.tp.workers.procs[0].join(10)
    with pytest.raises(WorkerDied, match="rank 1 exited"):
        tp2.generate(QUESTIONS[0], SamplingParams(max_tokens=2, temperature=0))

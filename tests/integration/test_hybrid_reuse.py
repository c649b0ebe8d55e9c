"""Document reuse on a hybrid model's linear-attention layers (Qwen3-Next, tiny random checkpoint,
float32): a placed chunk's state is its cached transition applied to the incoming state (exact),
or its own state where the head's decay over the chunk is at most the threshold (the dropped part
bounded by the decay); full_reuse through the engine, its FLOPs, and the prefix cache beside it."""

import math
import os

import pytest
import torch

from redknot import LLM, SamplingParams
from redknot.cache import linear_chunks
from redknot.kernels import gated_delta as gd
from redknot.reuse.options import ReuseOptions

PROMPT = "Question: who founded the city of Varna? Answer: the merchants of the old salt road"
DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120. " * 2,
        "Attention heads differ: some look far back, most look at recent tokens. " * 2,
        "A ledger bound in blue leather lists the ships. "]
FIRST = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, return_first_logits=True)


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def hybrid(tiny_checkpoint):
    return tiny_checkpoint("qwen3_next")


def make(path, threshold, **kw):
    return LLM(model=path, device="cpu", dtype="float32", page_size=16,
               reuse_options=ReuseOptions(linear_decay_threshold=threshold), **kw)


def placed_with_inputs(llm, documents, threshold, monkeypatch):
    """(the composed linear state of a full_reuse request over ``documents``, per linear layer the
    recurrence inputs (k, v, g, beta) of each piece, prefix first) from a fresh engine."""
    inputs = {}
    call = linear_chunks.ChunkCapture.__call__

    def record(self, layer, mixed, k, v, g, beta):
        inputs.setdefault(layer, []).extend((k[a:a + n], v[a:a + n], g[a:a + n], beta[a:a + n], mixed[a:a + n])
                                            for a, n in self.spans)
        return call(self, layer, mixed, k, v, g, beta)

    monkeypatch.setattr(linear_chunks.ChunkCapture, "__call__", record)
    docs = llm.engine.documents
    seq = llm.make_sequence(PROMPT, FIRST, documents, "full_reuse")
    llm.engine.prepare(seq)
    entries, _ = docs.ensure(seq, 0)
    try:
        placed = docs.compose_linear(seq, threshold)
    finally:
        docs.release(entries)
    assert len(inputs[0]) == len(docs.specs(seq))  # every piece computed by this engine, in prompt order
    return placed, inputs


def sequential(pieces, state=None):
    """float64: the token-by-token rule over the pieces' inputs one after another; every state on the way."""
    states = [torch.zeros(pieces[0][1].shape[1], pieces[0][0].shape[-1], pieces[0][1].shape[-1],
                          dtype=torch.float64) if state is None else state]
    for k, v, g, beta, _ in pieces:
        _, s = gd.recurrent_gated_delta_rule(*(x.double()[None] for x in (k, k, v, g, beta)), states[-1][None])
        states.append(s[0])
    return states


def test_placed_state_with_every_head_exact_is_the_recurrence_over_the_cached_inputs(hybrid, monkeypatch):
    """Threshold 0: every head applies each chunk's transition; the linear layers' state after the
    prefix and three placed chunks is the recurrence run over the chunks' cached inputs (computed
    at their canonical positions) one after another, and the convolution's state their last inputs."""
    llm = make(hybrid, 0.0)
    placed, inputs = placed_with_inputs(llm, DOCS, 0.0, monkeypatch)
    W = llm.config.linear.conv_kernel
    for layer, pieces in inputs.items():
        want = sequential(pieces)[-1]
        assert rel(placed.recurrent[layer], want) < 1e-5
        tail = torch.cat([p[4] for p in pieces])[-(W - 1):].t()
        torch.testing.assert_close(placed.conv[layer], tail)
    hv = llm.config.linear.num_value_heads
    assert placed.exact == [hv] * len(inputs) and placed.composed == [(len(DOCS)) * hv] * len(inputs)
    assert placed.dropped == [0] * len(inputs)


@pytest.mark.parametrize("quantile", [0.5, 1.0])
def test_short_memory_heads_stay_within_the_decay_bound(hybrid, monkeypatch, quantile):
    """A threshold at the chunks' median decay (some heads short-memory) and at 1 (every head drops
    the incoming state): per head, the error against the exact state is at most what the decays
    predict (dropping at a chunk: its decay times the true incoming state's norm; applying the
    transition: the decay times the error before it)."""
    llm = make(hybrid, 0.0)
    exact, inputs = placed_with_inputs(llm, DOCS, 0.0, monkeypatch)
    decays = torch.stack([torch.stack([p[2].double().sum(0).exp() for p in pieces[1:]]) for pieces in inputs.values()])
    threshold = float(decays.flatten().quantile(0.5)) if quantile < 1 else 1.0
    approx = llm.engine.documents.compose_linear(_seq(llm), threshold)
    dropped = 0
    for layer, pieces in inputs.items():
        states = sequential(pieces)
        bound = torch.zeros(states[0].shape[0], dtype=torch.float64)
        for j, (_, _, g, _, _) in enumerate(pieces[1:], start=1):
            d = g.double().sum(0).exp()
            drop = ~(g.double().sum(0) > math.log(threshold))
            bound = torch.where(drop, d * states[j - 1].flatten(1).norm(dim=1), d * bound)
            dropped += int(drop.sum())
        err = (approx.recurrent[layer].double() - states[-1]).flatten(1).norm(dim=1)
        assert (err <= bound * (1 + 1e-4) + 1e-4 * states[-1].flatten(1).norm(dim=1)).all(), (layer, err, bound)
    assert dropped == sum(approx.dropped) > 0
    if quantile < 1:
        assert sum(approx.composed) > 0


def _seq(llm):
    """A prepared full_reuse request over DOCS whose pieces the engine holds (cached by the last ensure)."""
    docs = llm.engine.documents
    seq = llm.make_sequence(PROMPT, FIRST, DOCS, "full_reuse")
    llm.engine.prepare(seq)
    entries, _ = docs.ensure(seq, 0)
    docs.release(entries)
    return seq


def test_full_reuse_after_one_document_equals_dense_and_costs_fewer_flops(hybrid):
    """One document sits where it was encoded (after the prefix): its cached K/V and linear inputs
    are exact, and so is the composed state (threshold 0): full_reuse equals dense prefill. With
    more documents it runs the question only: fewer FLOPs than dense, the counts of its linear heads
    say how each started, and the greedy tokens come from the placed state."""
    llm = make(hybrid, 0.0)
    dense = llm.generate(PROMPT, FIRST, documents=DOCS[:1], method="dense")[0]
    for _ in range(2):  # cold (the chunk computed) and warm (read from the cache)
        out = llm.generate(PROMPT, FIRST, documents=DOCS[:1], method="full_reuse")[0]
        assert cos(out.first_token_logits, dense.first_token_logits) >= 0.99999
        assert rel(out.first_token_logits, dense.first_token_logits) <= 1e-4
    hv3 = 3 * llm.config.linear.num_value_heads
    flops = out.metrics["flops"]
    assert flops["linear_heads_recomputed"] == 0 and flops["linear_heads_composed"] == hv3
    assert flops["total"] < dense.metrics["flops"]["total"]
    many = llm.generate(PROMPT, FIRST, documents=DOCS, method="full_reuse")[0]
    many_dense = llm.generate(PROMPT, FIRST, documents=DOCS, method="dense")[0]
    f, d = many.metrics["flops"], many_dense.metrics["flops"]
    assert f["total"] < d["total"] / 2 and d["linear_heads_recomputed"] == hv3
    assert f["linear_heads_composed"] + f["linear_heads_decayed"] == hv3
    assert llm.engine.request_kv_bytes() == 0 and llm.engine.idle()
    # the default threshold (1e-6) drops only what float32 cannot hold: the same first logits
    default = make(hybrid, 1e-6).generate(PROMPT, FIRST, documents=DOCS, method="full_reuse")[0]
    assert cos(default.first_token_logits, many.first_token_logits) >= 0.99999


def test_a_dropped_linear_entry_recomputes_its_chunk(hybrid):
    """The linear store's entry gone (its byte cap) while the chunk's pages stay cached: the chunk
    counts as missing and is prefilled again, and the result is unchanged."""
    llm = make(hybrid, 0.0)
    want = llm.generate(PROMPT, FIRST, documents=DOCS, method="full_reuse")[0].first_token_logits
    llm.engine.documents.linear.clear()
    out = llm.generate(PROMPT, FIRST, documents=DOCS, method="full_reuse")[0]
    assert out.metrics["cached_tokens"] == 0 and len(llm.engine.documents.linear) == len(DOCS) + 1
    torch.testing.assert_close(out.first_token_logits, want)


def test_chunk_prefills_resume_a_cached_prefix_state(hybrid):
    """With the prefix cache on (linear-state snapshots), a chunk prefill starts from the cached
    prefix of its canonical prompt: the snapshot there is resumed, and the placed result is the
    cold one."""
    import functools
    from unittest import mock

    import redknot.engine.llm as llm_mod
    from redknot.reuse.prompt import ChunkedPrompt

    cold = make(hybrid, 0.0)
    ids = lambda text: tuple(cold.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    prefix = (ids("You answer from the documents. " * 12) * 2)[:48]  # three pages
    prompt = ChunkedPrompt(prefix, tuple(ids(d) for d in DOCS), ids(PROMPT))
    want = cold.generate(prompt, FIRST, method="full_reuse")[0].first_token_logits
    config = functools.partial(llm_mod.EngineConfig, linear_state_snapshots=8)
    with mock.patch.object(llm_mod, "EngineConfig", config):
        warm = make(hybrid, 0.0)
    warm.generate(ChunkedPrompt(prefix, (), ids(" Hi")), FIRST, method="dense")  # snapshots the state at 48
    resumed = []
    resume = warm.engine.prefix_cache.resume
    warm.engine.prefix_cache.resume = lambda *a: resumed.append(a[2]) or resume(*a)
    out = warm.generate(prompt, FIRST, method="full_reuse")[0]
    assert resumed == [48] * len(DOCS)
    assert cos(out.first_token_logits, want) >= 0.99999 and rel(out.first_token_logits, want) <= 1e-4


@pytest.mark.skipif(os.environ.get("REDKNOT_TEST_DEVICE", "cpu") != "cuda" or not torch.cuda.is_available(),
                    reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_reuse_on_cuda_equals_dense_after_one_document(hybrid, dtype):
    """On a GPU (flash-linear-attention's kernels in the prefills where they import, the transitions
    in torch): one placed document equals dense prefill, three run with fewer FLOPs, and CUDA-graph
    decode continues from the placed state."""
    llm = LLM(model=hybrid, device="cuda", dtype=dtype, page_size=16, kv_pages=2048,
              reuse_options=ReuseOptions(linear_decay_threshold=0.0))
    dense = llm.generate(PROMPT, FIRST, documents=DOCS[:1], method="dense")[0].first_token_logits
    out = llm.generate(PROMPT, FIRST, documents=DOCS[:1], method="full_reuse")[0].first_token_logits
    assert cos(out, dense) >= (0.9999 if dtype == "float32" else 0.999)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    many = llm.generate(PROMPT, params, documents=DOCS, method="full_reuse")[0]
    assert len(many.outputs[0].token_ids) == 16
    assert many.metrics["flops"]["total"] < llm.generate(PROMPT, FIRST, documents=DOCS,
                                                         method="dense")[0].metrics["flops"]["total"]
    assert llm.engine.request_kv_bytes() == 0 and llm.engine.idle()

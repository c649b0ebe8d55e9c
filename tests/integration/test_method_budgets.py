"""A request's method may carry its own budget (``cacheblend@0.3``, ``epic@4``, ``redknot@0.5``):
the answer equals an engine whose options are that budget, while other requests keep the engine's."""

import pytest
import torch

from redknot import LLM, HeadConfig, SamplingParams
from redknot.config import SparseFFNConfig
from redknot.reuse.options import ReuseOptions
from redknot.reuse.registry import parse_method

DOCS = ["The quick brown fox jumps over the lazy dog. A river flows past the old mill at dawn.",
        "Question: who founded the city of Varna? Answer: the merchant Ilsa Torv founded it in 1120.",
        "Attention heads differ: some look far back, most look at recent tokens and a few sinks."]
KW = dict(device="cpu", page_size=16, kv_pages=512)


def test_parse_method():
    assert parse_method("cacheblend@0.3") == ("cacheblend", {"cacheblend_ratio": 0.3})
    assert parse_method("epic@4") == ("epic", {"epic_tokens": 4})
    assert parse_method("redknot@0.5+s8") == ("redknot", {"keep_fraction": 0.5, "chunk_start_tokens": 8})
    assert parse_method("redknot_kv@0.5") == parse_method("redknot@0.5")  # the alias resolves
    assert parse_method("redknot_paper@0.5")[0] == "redknot_paper"
    assert parse_method("dense") == ("dense", {})
    for bad in ("dense@0.3", "cacheblend@x", "cacheblend@1.5", "epic@4+s2", "redknot@0", "nosuch@0.1"):
        with pytest.raises(ValueError, match="method"):
            parse_method(bad)


def test_a_request_budget_equals_an_engine_with_that_budget(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    head = HeadConfig.synthetic(2, 2, 0.5, window=16, sink=4)
    llm = LLM(model=path, head_config=head, **KW)
    cases = [("cacheblend@0.6", ReuseOptions(cacheblend_ratio=0.6), None, "cacheblend"),
             ("epic@4", ReuseOptions(epic_tokens=4), None, "epic"),
             ("redknot@0.5", None, SparseFFNConfig(keep_fraction=0.5, chunk_start_tokens=0), "redknot")]
    for spec, options, sparse, method in cases:
        ref = LLM(model=path, head_config=head, reuse_options=options, sparse_ffn=sparse, **KW)
        want = ref.first_token_logits("Who founded Varna?", documents=DOCS, method=method)
        got = llm.first_token_logits("Who founded Varna?", documents=DOCS, method=spec)
        assert torch.allclose(got, want, atol=1e-5), spec
        plain = llm.first_token_logits("Who founded Varna?", documents=DOCS, method=method)
        default = LLM(model=path, head_config=head, **KW).first_token_logits("Who founded Varna?", documents=DOCS,
                                                                              method=method)
        assert torch.allclose(plain, default, atol=1e-5), method  # the engine's own options are untouched
    out = llm.generate(["Who founded Varna?"] * 2, SamplingParams(max_tokens=3, temperature=0),
                       documents=[DOCS, DOCS], method="cacheblend@0.0")
    assert all(o.outputs[0].finish_reason for o in out)

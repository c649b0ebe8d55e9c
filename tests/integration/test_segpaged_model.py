"""Whole-model checks of the SegPaged backend on tiny checkpoints."""

import pytest
import torch

from redknot import LLM, HeadConfig, SamplingParams
from oracles.hf_head_mask import hf_with_head_mask

PROMPT = "Attention heads differ: some look far back, most look at recent tokens and a few sinks. " * 3


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


@pytest.mark.parametrize("family,kw", [("llama", {}), ("qwen3", {"num_key_value_heads": 4}),
                                       ("mistral", {"sliding_window": 7})])
def test_all_global_segpaged_equals_dense(tiny_checkpoint, family, kw):
    path = tiny_checkpoint(family, **kw)
    dense = LLM(model=path, device="cpu")
    cfg = dense.config
    sp = LLM(model=path, device="cpu", method="headsparse", page_size=16,
             head_config=HeadConfig.all_global(cfg.num_hidden_layers, cfg.num_key_value_heads))
    assert cos(sp.first_token_logits(PROMPT), dense.first_token_logits(PROMPT)) >= 0.99999
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [PROMPT, "The quick brown fox"]
    assert ([o.outputs[0].token_ids for o in sp.generate(prompts, params)] ==
            [o.outputs[0].token_ids for o in dense.generate(prompts, params)])
    sp.engine.clear_caches()
    assert sp.pool.num_free_pages == sp.pool.num_pages


@pytest.mark.parametrize("page_size", [16, 64])
def test_headsparse_equals_transformers_with_head_mask(tiny_checkpoint, page_size):
    path = tiny_checkpoint("llama", num_hidden_layers=3, num_key_value_heads=4, num_attention_heads=8)
    hc = HeadConfig([["global", "local", "local", "retrieval"], ["local", "global", "local", "local"],
                     ["dense", "local", "global", "local"]],
                    [[-1, 5, 23, -1], [9, -1, 40, 3], [-1, 17, -1, 1]],
                    [[0, 4, 0, 0], [2, 0, 1, 4], [0, 3, 0, 0]])
    llm = LLM(model=path, device="cpu", method="headsparse", head_config=hc, page_size=page_size)
    hf = hf_with_head_mask(path, hc, llm.config)
    ids = llm.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids).logits[0, -1]
    ours = llm.first_token_logits(PROMPT)
    assert ((ours - ref).norm() / ref.norm()).item() <= 1e-4
    dense = LLM(model=path, device="cpu").first_token_logits(PROMPT)
    assert ((dense - ref).norm() / ref.norm()).item() > 1e-3  # the mask really changes the result
    with torch.no_grad():
        gen = hf.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    out = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == gen
    llm.engine.clear_caches()
    assert llm.pool.num_free_pages == llm.pool.num_pages


def test_headsparse_stores_less_than_dense(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    hc = HeadConfig.synthetic(2, 2, 0.5, window=16, sink=4)
    llm = LLM(model=path, device="cpu", method="headsparse", head_config=hc, page_size=16,
              enable_prefix_caching=False)
    engine, seen = llm.engine, []
    step = engine.step

    def spy():
        out = step()
        if engine.running:
            seen.append((engine.pool.length(engine.running[0].seq_id), engine.pool.occupancy()))
        return out

    engine.step = spy
    llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    n, occ = seen[-1]
    assert occ["local"] <= 2 * (1 + 1 + 1)  # 2 local heads: sink page + window page + partial
    assert occ["global"] == 2 * -(-n // 16)
    assert llm.pool.num_free_pages == llm.pool.num_pages


def test_headsparse_without_head_config_is_a_clear_error(tiny_checkpoint):
    with pytest.raises(ValueError, match="needs a head_config"):
        LLM(model=tiny_checkpoint("llama"), device="cpu", method="headsparse")


def test_head_config_that_does_not_fit_the_model(tiny_checkpoint):
    with pytest.raises(ValueError, match="num_hidden_layers"):
        LLM(model=tiny_checkpoint("llama"), device="cpu", head_config=HeadConfig.all_global(5, 2))

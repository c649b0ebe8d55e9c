"""redknot's own forward against HF transformers on tiny random checkpoints of each family."""

import pytest
import torch
import transformers

from redknot import LLM, SamplingParams
from redknot.models import CheckpointError, UnsupportedModelError
from oracles.hf_reference import edited_checkpoint

PROMPTS = ["The quick brown fox jumps", "Question: who founded the city of Varna? Answer:",
           "Attention heads differ: some look far back, most look at recent tokens and a few sinks. 0 1 2 3"]

CASES = [
    ("llama", {}),
    ("llama", {"rope": "llama3"}),
    ("llama", {"rope": "yarn"}),
    ("llama", {"rope": "linear", "tie_word_embeddings": True}),
    ("mistral", {}),
    ("mistral", {"sliding_window": 7}),
    ("qwen2", {"num_key_value_heads": 1}),
    ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def hf_cache():
    return {}


def load_pair(tiny_checkpoint, hf_cache, family, kw):
    path = tiny_checkpoint(family, **kw)
    if path not in hf_cache:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf_cache[path] = (hf, LLM(model=path, device="cpu", dtype="float32"))
    return hf_cache[path]


@pytest.mark.parametrize("family,kw", CASES, ids=[f"{f}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'base'}"
                                                  for f, kw in CASES])
def test_prefill_logits_and_greedy_match_transformers(tiny_checkpoint, hf_cache, family, kw):
    hf, llm = load_pair(tiny_checkpoint, hf_cache, family, kw)
    ids = llm.tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids).logits[0, -1].float()
    ours = llm.first_token_logits(PROMPTS[1])
    assert ours.dtype == torch.float32
    assert rel_err(ours, ref) <= 1e-4
    with torch.no_grad():
        gen = hf.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, ids.shape[1]:].tolist()
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == gen
    assert out.finish_reason == "length"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_prompts_equal_one_by_one(tiny_checkpoint, hf_cache, family):
    _, llm = load_pair(tiny_checkpoint, hf_cache, family, dict(CASES)[family] if family != "llama" else {})
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    single = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == single
    # chunked prefill (tiny token budget) computes the same thing
    llm.max_num_batched_tokens = 5
    try:
        chunked = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.max_num_batched_tokens = 8192
    assert chunked == batched


def test_sharded_checkpoint_and_token_id_prompts(tiny_checkpoint):
    path = tiny_checkpoint("llama", sharded=True, seed=3)
    assert (path / "model.safetensors.index.json").is_file()
    llm = LLM(model=path, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = llm.tokenizer.encode(PROMPTS[0])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert rel_err(llm.first_token_logits(ids), ref) <= 1e-4


def test_sampling_is_seeded_and_respects_stop(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint("llama"), device="cpu")
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a, b = (llm.generate(PROMPTS[0], p)[0].outputs[0].token_ids for _ in range(2))
    assert a == b and len(a) == 10
    greedy = llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].outputs[0]
    stop = greedy.text[3:6]
    if stop.strip():
        cut = llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0, stop=stop, ignore_eos=True))
        assert cut[0].outputs[0].text == greedy.text[: greedy.text.find(stop)]
        assert cut[0].outputs[0].finish_reason == "stop"


def test_bad_inputs_give_clear_errors(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    llm = LLM(model=path, device="cpu")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        llm.generate([[5] * 2000])
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="vocab"):
        llm.generate([[10**6]])
    with pytest.raises(ValueError, match="unknown method"):
        llm.first_token_logits("hi", method="nope")
    with pytest.raises(ValueError, match="needs a head_config"):
        llm.first_token_logits("hi", method="redknot_paper")
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=path, device="cpu", dtype="int3")


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(model_type="gpt2"), "model_type='gpt2'"),
    (lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_type='longrope'"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
])
def test_unsupported_config_names_the_field(tiny_checkpoint, tmp_path, edit, match):
    path = edited_checkpoint(tiny_checkpoint("llama"), tmp_path / "ck", edit)
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(model=path, device="cpu")


def test_weights_that_do_not_match_config(tiny_checkpoint, tmp_path):
    path = edited_checkpoint(tiny_checkpoint("llama"), tmp_path / "ck", lambda c: c.update(intermediate_size=50))
    with pytest.raises(CheckpointError, match="has shape"):
        LLM(model=path, device="cpu")
    path = edited_checkpoint(tiny_checkpoint("llama"), tmp_path / "ck3", lambda c: c.update(num_hidden_layers=3))
    with pytest.raises(CheckpointError, match="missing weights"):
        LLM(model=path, device="cpu")

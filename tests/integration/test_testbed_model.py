"""The bundled testbed model: it ships, loads offline with its head config, answers from its context,
and the reuse correctness gate holds on trained weights. Its answer quality per question type is in
tests/slow/test_testbed_model_quality.py."""

import pytest
import torch

from redknot import LLM, SamplingParams
from redknot.bench.quality import exact_match
from redknot.testbed import head_config_path, model_path
from redknot.testbed.easy import easy_records
from redknot.testbed.records import generate_records


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")  # no model given: the bundled one and its heads.json


def test_bundled_model_and_head_config_ship_and_load(llm):
    path = model_path()
    assert (path / "model.safetensors").stat().st_size <= 60 << 20
    assert llm.model_dir == path and llm.head_config is not None
    assert llm.head_config.num_layers == llm.config.num_hidden_layers == 12
    assert llm.config.num_key_value_heads >= 4 and llm.config.max_position_embeddings >= 8192
    assert head_config_path() == path / "heads.json"
    n = sum(p.numel() for p in llm.model.parameters())
    assert 10e6 <= n <= 30e6


def test_answers_come_from_the_context(llm):
    """Short key-value contexts: the right documents give right answers, another context's documents
    (same kinds of facts, other entities) give none: the model looks the answer up."""
    recs = easy_records(424242, 2, context_tokens=128, questions_per_context=4, tokens_per_word=1.85)
    params = SamplingParams(max_tokens=10, temperature=0)

    def em(doc_lists):
        outs = llm.generate([r["question"] for r in recs], params, documents=doc_lists)
        return sum(exact_match(o.outputs[0].text, r["answers"]) for o, r in zip(outs, recs)) / len(recs)

    right = em([r["documents"] for r in recs])
    wrong = em([recs[(i + 4) % len(recs)]["documents"] for i in range(len(recs))])  # the other context's
    assert right >= 0.25 and right >= wrong + 0.2, (right, wrong)


def test_redknot_exact_equals_dense_on_trained_weights(llm):
    rec = generate_records(4242, 1, context_tokens=512)[0]
    dense = llm.first_token_logits(rec["question"], documents=rec["documents"], method="dense")
    exact = llm.first_token_logits(rec["question"], documents=rec["documents"][::-1], method="redknot_exact")
    dense_rev = llm.first_token_logits(rec["question"], documents=rec["documents"][::-1], method="dense")
    assert torch.nn.functional.cosine_similarity(exact.double(), dense_rev.double(), dim=0) >= 0.99999
    assert exact.argmax() == dense_rev.argmax()
    assert dense.shape == exact.shape

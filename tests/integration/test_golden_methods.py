"""Every method's greedy tokens and first-token logits on fixed fixtures, against a recorded file.

The file was recorded before the runtime's upper half was restructured; the restructured engine must
reproduce it (tokens exactly, float32 logits within 1e-5). Methods are recorded under their serving
names: ``redknot`` is the method redknot serves (KV reuse with a sparse FFN), ``redknot_paper`` the
paper's form. Re-record only for an intended behaviour change:
``python tests/integration/test_golden_methods.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from redknot import LLM, HeadConfig, SamplingParams
from redknot.config import SparseFFNConfig

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden_methods.npz"
METHODS = ["dense", "headsparse", "prefix", "full_reuse", "epic", "cacheblend", "redknot", "redknot_paper",
           "redknot_exact"]
DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120, on the delta of the Sel river. " * 3,
        "Attention heads differ: some look far back over the context, most look at recent tokens only. " * 3,
        "The quick brown fox jumps over the lazy dog near the old mill, where the miller keeps geese. " * 3]
QUESTIONS = ["Question: who founded the city of Varna? Answer:", "Question: what does the miller keep? Answer:"]
SPARSE = SparseFFNConfig(dense_until=2, keep_fraction=0.4, importance="cross", recent_n=8, min_keep=4)
NEW_TOKENS = 8


def make_llm() -> LLM:
    """The bundled model in float32 under a synthetic plan narrow enough for local heads to matter."""
    heads = HeadConfig.synthetic(12, 4, 0.5, window=32, sink=4)
    return LLM(device="cpu", dtype=torch.float32, head_config=heads, sparse_ffn=SPARSE, page_size=16,
               cuda_graphs=False)


def run_cases(llm: LLM) -> dict[str, np.ndarray]:
    """For each method: two prompts batched (cold chunk caches), then the first again with its
    documents warm and in another order. Tokens int64 [3, NEW_TOKENS], logits float32 [3, V]."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, return_first_logits=True)
    out = {}
    for method in METHODS:
        llm.engine.clear_caches()
        batch = llm.generate(QUESTIONS, params, documents=[DOCS, [DOCS[2], DOCS[0]]], method=method)
        warm = llm.generate(QUESTIONS[0], params, documents=[DOCS[1], DOCS[2], DOCS[0]], method=method)
        results = batch + warm
        out[f"{method}/tokens"] = np.array([r.outputs[0].token_ids for r in results], dtype=np.int64)
        out[f"{method}/logits"] = torch.stack([r.first_token_logits for r in results]).numpy()
    return out


@pytest.fixture(scope="module")
def golden_llm():
    return make_llm()


@pytest.mark.parametrize("method", METHODS)
def test_every_method_reproduces_its_recorded_tokens_and_logits(golden_llm, method):
    golden = np.load(GOLDEN)
    got = run_cases_for(golden_llm, method)
    np.testing.assert_array_equal(got["tokens"], golden[f"{method}/tokens"])
    np.testing.assert_allclose(got["logits"], golden[f"{method}/logits"], atol=1e-5, rtol=1e-5)


def run_cases_for(llm: LLM, method: str) -> dict[str, np.ndarray]:
    global METHODS
    saved, METHODS = METHODS, [method]
    try:
        res = run_cases(llm)
    finally:
        METHODS = saved
    return {"tokens": res[f"{method}/tokens"], "logits": res[f"{method}/logits"]}


if __name__ == "__main__":
    names = dict(arg.split("=", 1) for arg in sys.argv[1:])  # recorded-name=method-name-to-run-it-with
    llm = make_llm()
    record = {}
    for method in METHODS:
        res = run_cases_for(llm, names.get(method, method))
        record[f"{method}/tokens"], record[f"{method}/logits"] = res["tokens"], res["logits"]
    np.savez_compressed(GOLDEN, **record)
    print(f"wrote {GOLDEN}: {', '.join(METHODS)}")

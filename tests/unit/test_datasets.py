"""Public QA formats into redknot records, and chunk layouts (``relayout``), on small hand-written
fixtures in the real formats."""

import json
import re
from pathlib import Path

import pytest

from redknot.bench.datasets import (DatasetError, load_2wikimultihopqa, load_dataset, load_hotpotqa, load_longbench,
                                    load_musique, relayout, split_passages)
from redknot.qa.records import check_record, write_jsonl
from redknot.testbed.records import generate_records
from redknot.tiny import make_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def ntok(tok, text):
    return len(tok.encode(text, add_special_tokens=False))


def all_records():
    return (load_hotpotqa(FIXTURES / "hotpotqa_sample.json") + load_2wikimultihopqa(FIXTURES / "2wiki_sample.json")
            + load_musique(FIXTURES / "musique_sample.jsonl") + load_longbench(FIXTURES / "longbench_sample.jsonl"))


def test_hotpotqa():
    recs = load_hotpotqa(FIXTURES / "hotpotqa_sample.json")
    assert len(recs) == 3
    r = recs[1]
    assert r["id"] == "5a8c7595554299585d9e36b6" and r["type"] == "hotpotqa/bridge"
    assert r["answers"] == ["Chief of Protocol"] and r["question"].startswith("What government position")
    assert len(r["documents"]) == 4
    assert r["documents"][2].startswith("Shirley Temple\nShirley Temple Black (April 23, 1928")
    assert "diplomat. As an adult" in r["documents"][2]  # sentences keep their own spacing
    assert r["supporting"] == [1, 2]
    assert recs[0]["answers"] == ["yes"] and recs[0]["type"] == "hotpotqa/comparison"
    for r in recs:
        check_record(r)
        assert any(r["answers"][0].lower() in r["documents"][k].lower() for k in r["supporting"]) or \
            r["answers"][0] in ("yes", "no")


def test_hotpotqa_hf_dict_layout(tmp_path):
    item = json.loads((FIXTURES / "hotpotqa_sample.json").read_text())[1]
    item["context"] = {"title": [t for t, _ in item["context"]], "sentences": [s for _, s in item["context"]]}
    item["supporting_facts"] = {"title": [t for t, _ in item["supporting_facts"]],
                                "sent_id": [i for _, i in item["supporting_facts"]]}
    path = tmp_path / "hf.jsonl"
    path.write_text(json.dumps(item) + "\n")
    assert load_hotpotqa(path) == load_hotpotqa(FIXTURES / "hotpotqa_sample.json")[1:2]


def test_2wikimultihopqa():
    recs = load_2wikimultihopqa(FIXTURES / "2wiki_sample.json")
    assert [r["type"] for r in recs] == ["2wikimultihopqa/compositional", "2wikimultihopqa/comparison"]
    r = recs[0]
    assert r["answers"] == ["Małgorzata Braunek"] and r["supporting"] == [0, 1]
    assert "in Warsaw) is a Polish film director. In 1995" in r["documents"][0]  # a space added between sentences
    assert recs[1]["supporting"] == [0, 1]


def test_musique():
    recs = load_musique(FIXTURES / "musique_sample.jsonl")
    assert [r["id"] for r in recs] == ["2hop__131818_161450", "3hop1__305282_282081_73772"]  # unanswerable skipped
    assert [r["type"] for r in recs] == ["musique/2hop", "musique/3hop1"]
    assert recs[0]["answers"] == ["the Mahakali River", "Mahakali", "Sharda River"]
    assert recs[0]["supporting"] == [1, 2] and recs[0]["documents"][2].startswith("Nepal\nThe Mahakali River")
    assert recs[1]["answers"] == ["1895"] and recs[1]["supporting"] == [0, 1, 2]
    assert len(load_musique(FIXTURES / "musique_sample.jsonl", include_unanswerable=True)) == 3
    assert len(load_musique(FIXTURES / "musique_sample.jsonl", limit=1)) == 1


def test_longbench():
    recs = load_longbench(FIXTURES / "longbench_sample.jsonl")
    assert [r["type"] for r in recs] == ["longbench/hotpotqa", "longbench/multifieldqa_en", "longbench/2wikimqa"]
    hp = recs[0]
    assert hp["id"] == "e2d4c2f7b1a0c6f4d1e3" and hp["answers"] == ["Miller v. California"]
    assert hp["documents"] == [
        "Miller v. California\nMiller v. California, 413 U.S. 15 (1973), was a landmark decision of the "
        "Supreme Court of the United States.",
        "Gates v. Collier\nGates v. Collier was a case decided in federal court in 1974 that brought an end to the "
        "trusty system at Parchman Farm.",
        "Parchman Farm\nParchman Farm is the oldest prison in the state of Mississippi."]
    assert len(recs[1]["documents"]) == 4 and recs[1]["documents"][2].startswith("The most active fan club")
    assert len(recs[2]["documents"]) == 4 and not any("Passage" in d for d in recs[2]["documents"])
    assert "supporting" not in hp


def test_split_passages():
    assert split_passages("intro\nPassage 1:\nA\nPassage 2: B b\n") == ["intro", "A", "B b"]
    assert split_passages("Paragraph 1: one.\nParagraph 2: two.") == ["one.", "two."]
    assert split_passages("a\n\n  \nb\n\nc") == ["a", "b", "c"]
    assert split_passages("one block only") == ["one block only"]


def test_load_dataset_dispatch_and_errors(tmp_path):
    hotpot = FIXTURES / "hotpotqa_sample.json"
    assert load_dataset("HotpotQA", hotpot) == load_hotpotqa(hotpot)
    assert load_dataset("2wiki", FIXTURES / "2wiki_sample.json", limit=1) == \
        load_2wikimultihopqa(FIXTURES / "2wiki_sample.json")[:1]
    assert load_dataset("musique", FIXTURES / "musique_sample.jsonl")[0]["type"] == "musique/2hop"
    synth = generate_records(0, 2, context_tokens=512)
    assert load_dataset("redknot", write_jsonl(synth, tmp_path / "s.jsonl")) == synth
    with pytest.raises(DatasetError, match=r"unknown dataset 'squad'.*hotpotqa"):
        load_dataset("squad", FIXTURES / "hotpotqa_sample.json")
    with pytest.raises(FileNotFoundError):
        load_dataset("hotpotqa", tmp_path / "missing.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "q", "context": "c", "answers": ["a"]}\n{"input": \n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: malformed JSON"):
        load_dataset("longbench", bad)
    wrong = r"musique_sample.jsonl:1: missing \['input', 'context', 'answers'\] for a longbench record"
    with pytest.raises(DatasetError, match=wrong):
        load_dataset("longbench", FIXTURES / "musique_sample.jsonl")  # wrong format for the name
    with pytest.raises(DatasetError, match=r"missing \['context'\] for a hotpotqa record"):
        load_dataset("hotpotqa", FIXTURES / "musique_sample.jsonl")
    with pytest.raises(DatasetError, match="malformed JSON"):
        (tmp_path / "trunc.json").write_text('[{"question": "q"')
        load_dataset("hotpotqa", tmp_path / "trunc.json")


def test_relayout_chunks(tok):
    recs = all_records()
    out = relayout(recs, tok, n_chunks=4, chunk_tokens=256)
    assert out == relayout(recs, tok, n_chunks=4, chunk_tokens=256)  # deterministic
    assert out != relayout(recs, tok, n_chunks=4, chunk_tokens=256, seed=1)
    for src, r in zip(recs, out):
        check_record(r)
        assert r["id"] == src["id"] and r["question"] == src["question"] and r["answers"] == src["answers"]
        assert len(r["documents"]) == 4 and r["layout"] == {"n_chunks": 4, "chunk_tokens": 256}
        sizes = [ntok(tok, c) for c in r["documents"]]
        assert all(s <= 256 for s in sizes)
        assert sum(sizes) > 0.7 * 4 * 256  # padded with other records' documents
        joined = "\n\n".join(r["documents"])
        assert all(d in joined for d in src["documents"])  # nothing of this record is lost or split
        for k in src.get("supporting", []):  # a supporting document stays whole in a supporting chunk
            assert any(src["documents"][k] in r["documents"][c] for c in r["supporting"])
        own_pos = [joined.index(d) for d in src["documents"]]
        assert own_pos == sorted(own_pos)  # document order kept
        for d in joined.split("\n\n"):  # padding comes from other records and never holds an answer
            if d not in src["documents"]:
                assert not any(a in d for a in src["answers"])


def test_relayout_spreads_few_documents_over_chunks(tok):
    recs = load_musique(FIXTURES / "musique_sample.jsonl")
    out = relayout(recs, tok, n_chunks=4, chunk_tokens=128)
    for src, r in zip(recs, out):  # 4 documents, 4 chunks: one each
        assert [sum(d in c for d in src["documents"]) for c in r["documents"]] == [1, 1, 1, 1]


def test_relayout_truncates_long_records(tok):
    # synthetic documents are ~1000 tiny-tokenizer tokens each: longer than a chunk, and the records
    # far longer than 3 x 400 tokens: non-supporting documents go first, then answer-free pieces
    recs = generate_records(0, 3, context_tokens=2048)
    out = relayout(recs, tok, n_chunks=3, chunk_tokens=400)
    for src, r in zip(recs, out):
        assert len(r["documents"]) == 3 and all(ntok(tok, c) <= 400 for c in r["documents"])
        assert r["supporting"] and src["answers"][0] in "".join(r["documents"][c] for c in r["supporting"])
        assert ntok(tok, "".join(r["documents"])) > 0.5 * 3 * 400  # whole ~1000-token pads cannot fit
    # enough room: long documents are split at sentence boundaries but nothing is lost
    big = relayout(recs[:1], tok, n_chunks=20, chunk_tokens=400)[0]
    assert all(ntok(tok, c) <= 400 for c in big["documents"])
    text = " ".join(big["documents"])
    assert all(s in text for d in recs[0]["documents"] for s in re.split(r"(?<=\.)\s+", d))


def test_relayout_single_record_without_padding(tok):
    rec = load_musique(FIXTURES / "musique_sample.jsonl")[:1]
    out = relayout(rec, tok, n_chunks=8, chunk_tokens=512)[0]
    assert len(out["documents"]) == 4  # nothing to pad with: empty chunks are left out
    assert out["supporting"] == [1, 2]
    with pytest.raises(ValueError):
        relayout(rec, tok, n_chunks=0, chunk_tokens=512)

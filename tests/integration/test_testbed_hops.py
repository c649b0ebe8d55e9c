"""`redknot testbed hops`: multi_hop answers split into first hop, second hop and composition."""

import argparse
import json

import pytest

from redknot.testbed import cli as testbed_cli
from redknot.qa.records import write_jsonl
from redknot.testbed.records import generate_records


def _parser():
    p = argparse.ArgumentParser()
    testbed_cli.add_arguments(p)
    return p


def test_hops_counts_every_outcome(tiny_checkpoint, tmp_path, capsys):
    model = tiny_checkpoint("llama", max_position_embeddings=4096)
    recs = generate_records(3, 4, 300, types=("multi_hop", "single_hop"), meta=True)
    data = write_jsonl(recs, tmp_path / "d.jsonl")
    out = tmp_path / "hops.json"
    args = _parser().parse_args(["hops", "--data", str(data), "--out", str(out), "--model", str(model),
                                 "--device", "cpu", "--max-tokens", "3"])
    assert testbed_cli.run(args) == 0
    res = json.loads(out.read_text())
    multi = [r for r in recs if r["type"] == "multi_hop"]
    assert res["n"] == len(multi) == 2 and [r["id"] for r in res["records"]] == [r["id"] for r in multi]
    assert sum(res["outcomes"].values()) == res["n"]
    for row, rec in zip(res["records"], multi):
        assert row["composed"]["question"] == rec["question"] and row["hop2"]["gold"] == rec["answers"]
        assert row["hop1"]["gold"] == [rec["meta"]["bridge"]]
    for k in ("hop1", "hop2", "composed"):  # the summary is the mean of the per-record scores
        assert res["em"][k] == sum(r[k]["em"] for r in res["records"]) / res["n"]
    assert "composed when both hops alone are right" in capsys.readouterr().out


def test_hops_scores_a_reasoned_answers_bridge(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """A composed answer written as 'BRIDGE => ANSWER' gets its bridge scored against the record's."""
    from redknot.engine import LLM

    model = tiny_checkpoint("llama", max_position_embeddings=4096)
    multi = generate_records(3, 3, 300, types=("multi_hop",), meta=True)
    data = write_jsonl(multi, tmp_path / "d.jsonl")
    by_q = {r["question"]: r for r in multi}
    texts = {multi[0]["question"]: f"{multi[0]['meta']['bridge']} => {multi[0]['answers'][0]}",  # both right
             multi[1]["question"]: f"{multi[1]['meta']['bridge']} => nobody",                   # bridge only
             multi[2]["question"]: "nowhere"}                                                    # plain, wrong
    real = LLM.generate

    def fake(self, prompt, params, documents=None, method="dense"):
        outs = real(self, prompt, params, documents=documents, method=method)
        outs[0].outputs[0].text = texts.get(prompt, outs[0].outputs[0].text) if prompt in by_q else "x"
        return outs

    monkeypatch.setattr(LLM, "generate", fake)
    out = tmp_path / "hops.json"
    assert testbed_cli.run(_parser().parse_args(["hops", "--data", str(data), "--out", str(out), "--model", str(model),
                                                 "--device", "cpu", "--max-tokens", "2"])) == 0
    res = json.loads(out.read_text())
    assert [r["composed"].get("bridge_em") for r in res["records"]] == [1.0, 1.0, None]
    assert [r["composed"]["em"] for r in res["records"]] == [1.0, 0.0, 0.0]
    assert res["em"]["reasoned"] == pytest.approx(2 / 3) and res["em"]["bridge"] == 1.0
    assert res["em"]["composed_given_bridge"] == 0.5
    assert "reasoned answers: 2 of 3" in capsys.readouterr().out


def test_hops_bad_data_fails_before_the_model_loads(tmp_path):
    no_meta = write_jsonl(generate_records(3, 2, 300, types=("multi_hop",)), tmp_path / "a.jsonl")
    with pytest.raises(ValueError, match="--meta"):
        testbed_cli.run(_parser().parse_args(["hops", "--data", str(no_meta), "--out", str(tmp_path / "o.json"),
                                              "--model", str(tmp_path / "missing")]))
    single = write_jsonl(generate_records(3, 2, 300, types=("single_hop",), meta=True), tmp_path / "b.jsonl")
    with pytest.raises(ValueError, match="no multi_hop records"):
        testbed_cli.run(_parser().parse_args(["hops", "--data", str(single), "--out", str(tmp_path / "o.json"),
                                              "--model", str(tmp_path / "missing")]))

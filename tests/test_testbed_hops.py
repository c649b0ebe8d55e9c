"""`redknot testbed hops`: multi_hop answers split into first hop, second hop and composition."""

import argparse
import json

import pytest

from redknot.testbed import cli as testbed_cli
from redknot.testbed.data import generate_records, write_jsonl


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


def test_hops_bad_data_fails_before_the_model_loads(tmp_path):
    no_meta = write_jsonl(generate_records(3, 2, 300, types=("multi_hop",)), tmp_path / "a.jsonl")
    with pytest.raises(ValueError, match="--meta"):
        testbed_cli.run(_parser().parse_args(["hops", "--data", str(no_meta), "--out", str(tmp_path / "o.json"),
                                              "--model", str(tmp_path / "missing")]))
    single = write_jsonl(generate_records(3, 2, 300, types=("single_hop",), meta=True), tmp_path / "b.jsonl")
    with pytest.raises(ValueError, match="no multi_hop records"):
        testbed_cli.run(_parser().parse_args(["hops", "--data", str(single), "--out", str(tmp_path / "o.json"),
                                              "--model", str(tmp_path / "missing")]))

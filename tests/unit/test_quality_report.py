"""`redknot bench quality-report`: runs merged over their common records, plan labels, table, plot."""

import json

import pytest

from redknot.bench import quality_report


def _row(top1, flops, f1=0.5, aF1=1.0):
    return {"text": "x", "em": 0.0, "f1": f1, "answer_em": float(aF1 == 1.0), "answer_f1": aF1,
            "top1_agreement": top1, "top10_overlap": 0.8, "logit_cos": 0.99, "kl": 0.1 * (1 - top1),
            "cached_tokens": 10, "flops": flops, "dense_flops": 100}


def _run(path, ids, methods, head_config=None, args=None):
    recs = [{"id": i, "type": "bridge", "answers": ["a"],
             "predictions": {m: _row(*methods[m](i)) for m in methods}} for i in ids]
    path.write_text(json.dumps({"methods": {m: {} for m in methods}, "records": recs, "head_config": head_config,
                                "args": args or {}, "model": "/m/smol", "data": "hotpotqa:x"}))
    return path


def test_runs_merge_over_common_records_with_plan_labels(tmp_path):
    a = _run(tmp_path / "a.json", ["r1", "r2", "r3"],
             {"dense": lambda i: (1.0, 100), "cacheblend@0.3": lambda i: (1.0 if i != "r3" else 0.0, 40),
              "redknot_kv": lambda i: (1.0, 20)}, head_config="plans/prof_g25.json")
    b = _run(tmp_path / "b.json", ["r1", "r2"], {"dense": lambda i: (1.0, 100), "redknot_kv": lambda i: (0.0, 30),
                                                 "headsparse": lambda i: (1.0, None)}, head_config="plans/rand.json")
    rep = quality_report.merge([a, b], labels={str(b): "random"})
    assert rep["n_records"] == 2  # r3 is not in b: left out everywhere
    by = {x["label"]: x for x in rep["rows"]}
    assert list(by) == ["dense", "cacheblend@0.3", "redknot_kv [prof_g25]", "redknot_kv [random]",
                        "headsparse [random]"]
    assert by["cacheblend@0.3"]["top1_agreement"] == 1.0 and by["cacheblend@0.3"]["flops_fraction"] == 0.4
    assert by["redknot_kv [random]"]["top1_agreement"] == 0.0 and by["dense"]["f1_ratio"] == 1.0
    assert by["headsparse [random]"]["flops_fraction"] is None
    table = quality_report.markdown(rep)
    assert "| redknot_kv [prof_g25] | 0.000 | 0.500 | 1.00 |" in table and "| headsparse [random] |" in table
    png = quality_report.plot(rep, tmp_path / "p.png")
    assert png.stat().st_size > 1000


def test_runs_without_common_records_fail_clearly(tmp_path):
    a = _run(tmp_path / "a.json", ["r1"], {"dense": lambda i: (1.0, 100)})
    b = _run(tmp_path / "b.json", ["r2"], {"dense": lambda i: (1.0, 100)})
    with pytest.raises(ValueError, match="no finished record"):
        quality_report.merge([a, b])


def test_gzipped_runs_read_like_plain_ones(tmp_path):
    import gzip

    a = _run(tmp_path / "a.json", ["r1", "r2"], {"dense": lambda i: (1.0, 100), "epic": lambda i: (0.0, 10)})
    gz = tmp_path / "a.json.gz"
    gz.write_bytes(gzip.compress(a.read_bytes()))
    assert quality_report.markdown(quality_report.merge([gz])) == quality_report.markdown(quality_report.merge([a]))
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"\x1f\x8b" + b"not gzip")
    with pytest.raises(ValueError, match="bad.json.gz: not a results JSON"):
        quality_report.merge([bad])


def test_runs_with_another_shallow_window_or_sparse_ffn_file_get_their_own_rows(tmp_path):
    common = {"dense": lambda i: (1.0, 100), "redknot_kv@0.3": lambda i: (1.0, 40)}
    a = _run(tmp_path / "a.json", ["r1"], common, head_config="plans/all.json")
    b = _run(tmp_path / "b.json", ["r1"], {**common, "redknot_kv@0.3": lambda i: (0.0, 45)},
             head_config="plans/all.json", args={"shallow_window": 8192, "sparse_ffn": "sparse/dev_k30.json"})
    by = {x["label"]: x for x in quality_report.merge([a, b])["rows"]}
    assert list(by) == ["dense", "redknot_kv@0.3 [all]", "redknot_kv@0.3 [all, dev_k30, shallow W 8192]"]
    assert by["redknot_kv@0.3 [all, dev_k30, shallow W 8192]"]["top1_agreement"] == 0.0


def test_normalised_recovery_against_full_reuse_and_dense(tmp_path):
    """(score(method) - score(full_reuse)) / (score(dense) - score(full_reuse)) for answer F1 and gold
    F1, in the merged rows, the table and `bench quality`'s own summaries; none without full_reuse."""
    from redknot.bench.quality import add_recovery

    a = _run(tmp_path / "a.json", ["r1", "r2"],
             {"dense": lambda i: (1.0, 100, 0.6, 1.0), "full_reuse": lambda i: (0.5, 5, 0.2, 0.4),
              "qrecompute@0.25": lambda i: (1.0, 30, 0.5, 0.85)})
    by = {x["label"]: x for x in quality_report.merge([a])["rows"]}
    assert by["qrecompute@0.25"]["answer_f1_recovery"] == pytest.approx(0.75)
    assert by["qrecompute@0.25"]["f1_recovery"] == pytest.approx(0.75)
    assert by["dense"]["f1_recovery"] == 1.0 and by["full_reuse"]["answer_f1_recovery"] == 0.0
    assert "| qrecompute@0.25 | 0.000 | 0.500 | 0.83 | 0.000 | 0.850 | 0.75 | 0.75 |" in quality_report.markdown(
        {"rows": list(by.values())})
    summaries = add_recovery({"dense": {"f1": 0.6, "answer_f1": 1.0}, "cacheblend": {"f1": 0.4, "answer_f1": 0.7}})
    assert summaries["cacheblend"]["f1_recovery"] is None  # no full_reuse row
    summaries = add_recovery({"dense": {"f1": 0.2, "answer_f1": 1.0}, "full_reuse": {"f1": 0.2, "answer_f1": 0.5},
                              "m": {"f1": 0.3, "answer_f1": 0.75}})
    assert summaries["m"]["f1_recovery"] is None and summaries["m"]["answer_f1_recovery"] == 0.5


def test_pareto_front_keeps_the_settings_nothing_beats():
    rows = [{"label": n, "flops_fraction": f, "answer_f1": q, "kl": k}
            for n, f, q, k in (("a", 0.1, 0.5, 0.3), ("b", 0.3, 0.4, 0.2), ("c", 0.3, 0.7, 0.1), ("d", 0.6, 0.6, 0.05),
                               ("e", 1.0, 1.0, 0.0), ("h", None, 0.9, 0.0))]
    assert [x["label"] for x in quality_report.pareto_front(rows, "answer_f1")] == ["a", "c", "e"]
    assert [x["label"] for x in quality_report.pareto_front(rows, "kl", higher=False)] == ["a", "c", "d", "e"]


def test_the_report_writes_its_pareto_png_beside_its_json(tmp_path):
    import argparse

    a = _run(tmp_path / "a.json", ["r1", "r2"], {"dense": lambda i: (1.0, 100), "full_reuse": lambda i: (0.0, 5, 0.2, 0.3),
                                                 "cacheblend@0.3": lambda i: (1.0, 40, 0.4, 0.7),
                                                 "qrecompute@0.25+kc": lambda i: (1.0, 33, 0.5, 0.8)})
    p = argparse.ArgumentParser()
    quality_report.add_arguments(p)
    quality_report.run(p.parse_args([str(a), "--out", str(tmp_path / "rep.json")]))
    png = tmp_path / "rep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    quality_report.run(p.parse_args([str(a), "--plot", str(tmp_path / "kl.png"), "--plot-columns", "kl"]))
    assert (tmp_path / "kl.png").is_file()
    with pytest.raises(ValueError, match="plot columns"):
        quality_report.run(p.parse_args([str(a), "--plot", str(tmp_path / "x.png"), "--plot-columns", "em"]))

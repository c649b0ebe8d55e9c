"""CPU smoke test of `redknot bench kernel --h2o --quick --device cpu`: the H2O decode shape's
page layout, selection and JSON (the torch reference stands in for the Triton kernel on CPU)."""

import argparse
import json

import torch

from redknot.bench import kernel as kb
from redknot.bench import kernel_cli
from redknot.bench import kernel_h2o as kh


def test_h2o_quick_run(tmp_path):
    out = tmp_path / "h2o.json"
    p = argparse.ArgumentParser()
    kernel_cli.add_arguments(p)
    result = kernel_cli.run(p.parse_args(["--h2o", "--quick", "--device", "cpu", "--repeats", "1", "--out", str(out)]))
    on_disk = json.loads(out.read_text())
    assert [s["name"] for s in on_disk["shapes"]] == list(kh.QUICK_SHAPES)
    e = result["shapes"][0]
    sh = kh.QUICK_SHAPES["h2o-quick"]
    for m in kh.METHODS:
        if m == "segpaged_fused":  # a launch choice of the Triton kernel: the CPU's torch reference has none
            assert "Triton" in e["methods"][m]["skipped"], e["methods"][m]
            continue
        assert e["methods"][m]["ms"] > 0, e["methods"][m]
    for m in ("segpaged_h2o", "dense_selected"):
        assert e["correctness"][f"{m}_vs_ref"]["cos"] >= 0.99998
    # the budget: sink + window + heavy pages, every head alike
    assert e["heavy_pages"] > 0
    assert e["kept_tokens"] == kh.H2O_SINK + sh.window + e["heavy_pages"] * kb.PAGE_SIZE
    pages_per_head = e["kv_bytes"]["segpaged_h2o"] / (sh.batch * kb.HKV * kb.PAGE_SIZE * 2 * kb.HEAD_DIM * 2)
    assert pages_per_head * kb.PAGE_SIZE <= sh.budget * sh.ctx + kb.PAGE_SIZE
    assert 0 < e["kv_bytes"]["saved_vs_dense"] < 1


def test_h2o_case_pool_holds_only_kept_pages():
    c = kh.make_h2o_case(kh.QUICK_SHAPES["h2o-quick"], torch.device("cpu"), 0)
    bt, sel = c["block_table"], c["sel_pos"]
    held = (bt >= 0)
    assert int(held.sum()) == c["num_pages"]
    # every selected position sits in a held page, and the pages are distinct physical pages
    lp = sel.long() // kb.PAGE_SIZE
    assert held.gather(2, lp).all()
    assert bt[held].unique().numel() == c["num_pages"]

"""CPU smoke test of the attention-kernel benchmark (`redknot bench kernel --quick --device cpu`).

Only the torch paths run here (SDPA baselines, the torch reference of segpaged_attention); the
point is the JSON structure and the bench's own bookkeeping (page layout, visible-work count,
exact reference), not speed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
import torch

from redknot.bench import kernel as kb


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "kernel.json"
    p = argparse.ArgumentParser()
    kb.add_arguments(p)
    args = p.parse_args(["--quick", "--device", "cpu", "--repeats", "1", "--rows", "64",
                         "--out", str(out)])
    result = kb.run(args)
    return result, out


def _has_reference() -> bool:
    try:
        return importlib.util.find_spec("redknot.kernels.reference") is not None
    except ModuleNotFoundError:
        return False


def test_json_structure(quick_run):
    result, out = quick_run
    on_disk = json.loads(out.read_text())
    assert on_disk["shapes"] == json.loads(json.dumps(result["shapes"], default=str))
    for key in ("argv", "date", "device", "torch", "triton", "config", "fa_probe", "wall_s"):
        assert key in on_disk, key
    assert on_disk["config"]["hq"] == 32 and on_disk["config"]["hkv"] == 8
    assert [s["name"] for s in on_disk["shapes"]] == list(kb.QUICK_SHAPES)
    for s in on_disk["shapes"]:
        assert set(s["methods"]) == set(kb.METHODS)
        for m, r in s["methods"].items():
            # every method either has a time, an error string or a reason it was skipped
            assert sum(k in r for k in ("ms", "error", "skipped")) == 1, (s["name"], m, r)
        assert "skipped" in s["methods"]["flex"]  # no compile in the CPU smoke test
        for m in ("fa_dense", "fa_buckets", "sdpa_mask"):  # torch SDPA paths always run on CPU
            assert s["methods"][m]["ms"] > 0, (s["name"], m, s["methods"][m])
            assert s["methods"][m]["tflops_visible"] > 0
        # the materialised-mask SDPA implements the exact rule: checks mask + reference
        assert s["correctness"]["sdpa_mask_vs_ref"]["cos"] >= 0.99998
        assert s["correctness"]["sdpa_mask_vs_ref"]["nonfinite"] == 0
        kv = s["kv_bytes"]
        assert kv["segpaged"] == kv["segpaged_pages"] * kv["page_bytes"]
        if s["kind"] == "decode":
            assert kv["segpaged"] < kv["dense"]  # local heads hold only sink + window pages
            assert s["visible_kv_bytes"] > 0 and "tbps_visible" in s["methods"]["fa_dense"]


@pytest.mark.skipif(not _has_reference(), reason="redknot.kernels.reference not present yet")
def test_segpaged_reference_path(quick_run):
    result, _ = quick_run
    for s in result["shapes"]:
        seg = s["methods"]["segpaged"]
        assert "ms" in seg, seg
        c = s["correctness"]["segpaged_vs_ref"]
        assert c["cos"] >= 0.99998 and c["nonfinite"] == 0, c
        assert "fa_dense" in s["speedup"]
        if s["kind"] == "prefill" and "skipped" not in s["store"]:
            assert s["store"]["exact_match"] is True, s["store"]


def test_table_printed(quick_run, capsys):
    result, _ = quick_run
    kb.print_table(result)
    tail = capsys.readouterr().out.strip().splitlines()[-6:]
    assert any(line.startswith("prefill-quick") for line in tail)
    assert any(line.startswith("decode-quick") for line in tail)


def test_visible_work_matches_mask():
    """visible_counts (used for TFLOP/s and bytes/s) equals a brute-force count of the rule."""
    windows, sinks, L = [2**30, 7, 1, 64], [0, 4, 3, 0], 150
    pos = torch.arange(L)
    counts = kb.visible_counts(pos, windows, sinks)
    j = torch.arange(L)[None]
    p = pos[:, None]
    for h, (w, s) in enumerate(zip(windows, sinks)):
        brute = ((j <= p) & ((j < s) | (p - j < w))).sum(1)
        assert torch.equal(counts[:, h], brute), h


def test_page_layout_roundtrip():
    """make_case puts token t of head h at block_table[b, h, t // 64], slot t % 64."""
    shape = kb.Shape("t", "decode", 2, 300, 64)
    case = kb.make_case(shape, torch.device("cpu"), 0, 2**30)
    bt = case.block_table
    assert bt.shape == (2, kb.HKV, 5)
    phys = bt[bt >= 0]
    assert phys.unique().numel() == phys.numel() == case.num_pages  # each page used once
    for b in range(2):
        for h in range(kb.HKV):
            for t in (0, 3, 63, 64, 236, 299):
                page = int(bt[b, h, t // 64])
                if page >= 0:
                    assert torch.equal(case.k_pages[page, t % 64], case.k[b, t, h])
            if h not in kb.GLOBAL_KV_HEADS:  # window 64 at p=299 starts at 236 -> pages 3, 4
                assert bt[b, h].ge(0).tolist() == [True, False, False, True, True]

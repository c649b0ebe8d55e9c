"""CPU smoke tests of the MoE benchmarks: `redknot bench kernel --moe --quick` (the fused kernel in
the Triton interpreter, the per-expert loop and transformers' block agree and are timed) and
`redknot bench decode --arch tiny-moe` (the bound counts the active experts' bytes)."""

import argparse
import json

import pytest

from redknot.bench import decode as bd
from redknot.bench import kernel_cli, kernel_moe


def test_kernel_moe_quick_run(tmp_path, capsys):
    out = tmp_path / "moe.json"
    p = argparse.ArgumentParser()
    kernel_cli.add_arguments(p)
    result = kernel_cli.run(p.parse_args(["--moe", "--quick", "--device", "cpu", "--repeats", "1", "--out", str(out)]))
    assert json.loads(out.read_text())["arch"] == "tiny"
    assert [r["tokens"] for r in result["rows"]] == list(kernel_moe.QUICK_TOKENS)
    for r in result["rows"]:
        for m in kernel_moe.METHODS:
            assert r["methods"][m]["ms"] > 0 and r["methods"][m]["cos_vs_ref"] >= 0.99999, (m, r["methods"][m])
        assert 0 < r["experts_touched"] <= 8
    assert "MoE block, tiny" in capsys.readouterr().out


def test_decode_bench_bound_reads_the_active_experts(tmp_path, capsys):
    out = tmp_path / "decode.json"
    p = argparse.ArgumentParser()
    bd.add_arguments(p)
    result = bd.run(p.parse_args(["--arch", "tiny-moe", "--cases", "1x200,4x200", "--methods", "dense,hf", "--tokens", "3",
                                  "--device", "cpu", "--no-cuda-graphs", "--out", str(out)]))
    rows = {(r["method"], r["batch"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("hf", 1)]["tok_s"] > 0 and rows[("dense", 4)]["tok_s"] > 0
    total, one, four = result["weight_bytes"], rows[("dense", 1)]["weight_read_bytes"], rows[("dense", 4)]["weight_read_bytes"]
    assert one < four < total  # 2 of 8 experts at B=1, 1-(3/4)^4 = 68% of them at B=4
    expert_bytes = (total - one) / (1 - 2 / 8)  # B=1 reads 2 of the 8 experts
    assert four == pytest.approx(total - expert_bytes * (3 / 4) ** 4, rel=1e-6)
    assert "the bound's weight bytes are the active ones" in capsys.readouterr().out

"""CPU smoke test of the TTFT benchmark harness (the real run is on a GPU)."""

import json
import re

import pytest

from redknot.cli import main


def test_ttft_bench_runs_every_method_and_plots(tmp_path):
    out, png = tmp_path / "ttft.json", tmp_path / "ttft.png"
    assert main(["bench", "ttft", "--archs", "tiny", "--layouts", "4x64", "--repeats", "1", "--device", "cpu",
                 "--head-configs", "g50-w16", "--out", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == {"hf_dense", "forward", "dense", "headsparse", "full_reuse", "epic", "cacheblend",
                                           "redknot_paper", "redknot"}
    assert not [r for r in rows if "error" in r]
    dense = next(r for r in rows if r["method"] == "dense")
    assert dense["flop_reduction"] == 1.0
    reuse = next(r for r in rows if r["method"] == "full_reuse")
    assert reuse["flop_reduction"] > 2 and reuse["cached_tokens"] == 16 + 4 * 64
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hf_baseline_computes_the_same_attention_as_ours():
    """HF's MistralConfig defaults to a 4096-token sliding window; the baseline must not inherit it,
    or HF dense would compute windowed (masked) attention while ours computes full causal."""
    import torch

    from redknot.bench.common import hf_model as _hf_model
    from redknot.models.config import ModelConfig

    arch = {"model_type": "mistral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "max_position_embeddings": 8192}
    hf = _hf_model(arch, torch.device("cpu"), torch.float32)
    assert hf.config.sliding_window is None
    assert ModelConfig.from_dict(arch).sliding_windows in ([], [None])


def test_ttft_profile_names_the_engine_phases(tmp_path):
    """--profile: every engine row gets the step's phase times (schedule, forward or recover, sample)
    and torch's op table; the HF row only its ops."""
    out, folder = tmp_path / "ttft.json", tmp_path / "prof"
    assert main(["bench", "ttft", "--archs", "tiny", "--layouts", "4x64", "--repeats", "1", "--device", "cpu",
                 "--head-configs", "g50-w16", "--methods", "hf_dense,dense,redknot", "--out", str(out),
                 "--profile", str(folder)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert {"engine.schedule", "engine.forward", "engine.sample"} <= set(rows["dense"]["profile"]["phases_ms"])
    assert {"engine.schedule", "engine.recover", "engine.sample"} <= set(rows["redknot"]["profile"]["phases_ms"])
    assert "engine.recover" not in rows["dense"]["profile"]["phases_ms"]  # dense prefills in the pool
    for m in ("dense", "redknot"):
        assert all(v > 0 for v in rows[m]["profile"]["phases_ms"].values())
    assert not rows["hf_dense"]["profile"]["phases_ms"] and rows["hf_dense"]["profile"]["top_ops"]
    tables = sorted(p.name for p in folder.iterdir())
    assert tables == sorted(f"tiny_g50-w16_4x64_{m}.txt" for m in ("hf_dense", "dense", "redknot"))
    assert "engine.recover" in (folder / "tiny_g50-w16_4x64_redknot.txt").read_text()


def test_ttft_rows_measure_the_engine_against_its_floor(tmp_path):
    """Every engine row is LLM.generate with warm documents in another order: reuse methods compute
    only what they must, and dense is compared with one unchunked forward of the same prompt."""
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--archs", "tiny", "--layouts", "4x64", "--repeats", "2", "--device", "cpu",
                 "--head-configs", "g50-w16", "--methods", "forward,dense,full_reuse,redknot", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["dense"]["over_forward"] > 0 and rows["dense"]["cached_tokens"] < 64  # no whole-prompt prefix hit
    assert rows["full_reuse"]["cached_tokens"] == 16 + 4 * 64 and rows["redknot"]["cached_tokens"] >= 4 * 64
    assert rows["redknot"]["flops"]["total"] < rows["dense"]["flops"]["total"]
    assert all(r["cold_s"] > 0 for m, r in rows.items() if m != "forward")


@pytest.mark.parametrize("option,value,match", [("--archs", "tiny,mistral7b", "unknown arch"),
                                                ("--layouts", "2x64", "unknown layout.*4x64"),
                                                ("--methods", "dense,redknotkv", "unknown method"),
                                                ("--head-configs", "g15", "head config")])
def test_ttft_bench_names_a_bad_option_before_building_a_model(tmp_path, capsys, option, value, match):
    args = {"--archs": "tiny", "--layouts": "4x64", "--methods": "dense", "--head-configs": "g50-w16", option: value}
    assert main(["bench", "ttft", "--device", "cpu", "--out", str(tmp_path / "t.json")]
                + [x for kv in args.items() for x in kv]) != 0
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "t.json").exists()

"""CPU smoke test of the TTFT benchmark harness (the real run is on a GPU)."""

import json

from redknot.cli import main


def test_ttft_bench_runs_every_method_and_plots(tmp_path):
    out, png = tmp_path / "ttft.json", tmp_path / "ttft.png"
    assert main(["bench", "ttft", "--archs", "tiny", "--layouts", "4x64", "--repeats", "1", "--device", "cpu",
                 "--head-configs", "g50-w16", "--out", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == {"hf_dense", "dense", "headsparse", "full_reuse", "epic", "cacheblend",
                                           "redknot", "redknot_kv"}
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

    from redknot.bench.ttft import _hf_model
    from redknot.models.config import ModelConfig

    arch = {"model_type": "mistral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "max_position_embeddings": 8192}
    hf = _hf_model(arch, torch.device("cpu"), torch.float32)
    assert hf.config.sliding_window is None
    assert ModelConfig.from_dict(arch).sliding_windows in ([], [None])

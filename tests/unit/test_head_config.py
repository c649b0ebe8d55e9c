import json

import numpy as np
import pytest

from redknot import HeadConfig, HeadConfigError
from redknot.cli import main
from redknot.config import GLOBAL_WINDOW


def test_anchor_mistral_config_loads_and_validates(anchor_head_config):
    cfg = HeadConfig.from_json(anchor_head_config)
    assert (cfg.num_layers, cfg.num_kv_heads) == (32, 8)
    cfg.validate_model(32, 8)  # Mistral-7B shape
    counts = cfg.class_counts()
    assert counts["global"] == 160 and counts["local"] == 96
    window, sink = cfg.visibility()
    assert window.shape == (32, 8)
    assert (window[:20] == GLOBAL_WINDOW).all() and (window[20:] == 4096).all()
    assert (sink[20:] == 4).all() and (sink[:20] == 0).all()  # top-level sink_size fills the missing matrix
    assert cfg.metadata["model"] == "Mistral-7B-Instruct-v0.3"


@pytest.mark.parametrize("layers,heads,match", [(30, 8, "32 layers but the model has 30"),
                                                (32, 4, "8 KV heads per layer but the model has 4")])
def test_mismatched_model_shape(anchor_head_config, layers, heads, match):
    with pytest.raises(HeadConfigError, match=match):
        HeadConfig.from_json(anchor_head_config).validate_model(layers, heads)


def test_round_trip_keeps_keys_and_adds_schema_version(anchor_head_config, tmp_path):
    cfg = HeadConfig.from_json(anchor_head_config)
    out = tmp_path / "out.json"
    cfg.to_json(out)
    raw = json.loads(out.read_text())
    assert raw["schema_version"] == 1
    for key in ("kv_head_classification", "kv_head_max_distance", "kv_head_sink_size", "retrieval_top_p",
                "dense_prefix_layers"):
        assert key in raw
    again = HeadConfig.from_json(out)
    assert again.classes == cfg.classes and again.windows == cfg.windows and again.sinks == cfg.sinks


def _write(tmp_path, obj):
    p = tmp_path / "h.json"
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def test_legacy_names_and_dense_prefix(tmp_path):
    raw = {"kv_head_classification": [["global", "local_full"], ["streaming", "retrieval"], ["limited", "sink_dominant"]],
           "kv_head_max_distance": [[-1, 64], [32, -1], [16, 16]],
           "kv_head_sink_size": [[0, 4], [2, 4], [0, 1]], "dense_prefix_layers": 1}
    cfg = HeadConfig.from_json(_write(tmp_path, raw))
    assert cfg.classes == [["global", "local"], ["local", "retrieval"], ["local", "local"]]
    assert cfg.effective_classes()[0] == ["dense", "dense"]
    window, sink = cfg.visibility()
    np.testing.assert_array_equal(window, [[GLOBAL_WINDOW] * 2, [32, GLOBAL_WINDOW], [16, 16]])
    np.testing.assert_array_equal(sink, [[0, 0], [2, 0], [0, 1]])
    w_sel, _ = cfg.visibility(selection=True)  # retrieval heads keep their window when a selection exists
    assert w_sel[1, 1] == GLOBAL_WINDOW  # -1 distance: still unlimited
    w_model, s_model = cfg.visibility(model_windows=[None, 20, 8])  # the architecture's own sliding window caps
    assert w_model[1].tolist() == [20, 20] and w_model[2].tolist() == [8, 8]


@pytest.mark.parametrize("content,match", [
    ("{not json", "malformed JSON"),
    ([1, 2], "expected a JSON object"),
    ({"kv_head_max_distance": [[1]]}, "missing field kv_head_classification"),
    ({"kv_head_classification": [["global", "banana"]]}, r"kv_head_classification\[0\]\[1\] = 'banana'"),
    ({"kv_head_classification": [["global"], ["global", "local"]]}, r"kv_head_classification\[1\] has 2 heads"),
    ({"kv_head_classification": [["local"]], "kv_head_max_distance": [[-1]]}, "needs a window > 0"),
    ({"kv_head_classification": [["local"]], "kv_head_max_distance": [[8, 8]]}, "kv_head_max_distance is 1x2"),
    ({"kv_head_classification": [["global"]], "kv_head_sink_size": [["x"]]}, "not an integer"),
    ({"kv_head_classification": [["global"]], "num_layers": 4}, "num_layers=4"),
    ({"kv_head_classification": [["global"]], "retrieval_top_p": 3}, "retrieval_top_p"),
])
def test_malformed_configs_give_one_line_errors(tmp_path, content, match):
    with pytest.raises(HeadConfigError, match=match) as e:
        HeadConfig.from_json(_write(tmp_path, content))
    assert "\n" not in str(e.value)


def test_synthetic_ratio():
    cfg = HeadConfig.synthetic(4, 8, 0.25, window=128, sink=4, seed=1)
    assert all(row.count("global") == 2 for row in cfg.classes)
    assert cfg.class_counts()["local"] == 24


def test_config_show_cli(anchor_head_config, capsys):
    assert main(["config", "show", str(anchor_head_config)]) == 0
    out = capsys.readouterr().out
    assert "32 layers x 8 KV heads" in out
    assert "   20       0      8     0      0  4096" in out
    assert "global=160  local=96" in out


def test_config_show_bad_file(tmp_path, capsys):
    assert main(["config", "show", str(_write(tmp_path, "{oops"))]) == 2
    assert "malformed JSON" in capsys.readouterr().err

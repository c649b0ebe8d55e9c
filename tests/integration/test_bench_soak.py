"""`redknot bench soak` at a few seconds: every kind of client runs, nothing answers 5xx, the pool
comes back, and the report carries each check."""

import json

from redknot.cli import main


def test_soak_smoke(tmp_path):
    out = tmp_path / "soak.json"
    assert main(["bench", "soak", "--minutes", "0.15", "--normal-clients", "1", "--long-prompt-words", "300",
                 "--small-documents", "16", "--write-timeout", "1", "--read-timeout", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    kinds = {k.split(":")[0] for k in report["statuses"]}
    assert {"normal", "health", "trickler", "slow_reader"} <= kinds
    assert report["server_errors_5xx"] == 0 and report["checks"]["no_5xx"]
    assert report["pool_pages_back"] is True
    assert report["health_max_s"] < 5
    assert report["samples"] and all(s["rss_bytes"] > 0 for s in report["samples"])
    assert report["command"].startswith("redknot bench soak") and "--think-s 2.0" in report["command"]
    assert "--only-normal" not in report["command"] and not report["only_normal"]
    assert 0 < report["normal_load_share"] < 1
    assert report["environment"]["torch"] and report["heap_trims"] >= 0 and "waiting_share_of_samples" in report
    assert 0 < report["engine_busy_share"] <= 1.0 and report["engine_steps"] > 0
    assert 0 <= report["ttft_outside_heavy_n"] <= report["normal_requests"]
    assert len(report["ttft_unloaded_s"]) == report["ttft_unloaded_n"] > 0
    assert report["ttft_floor_p99_s"] >= min(report["ttft_unloaded_s"]) and report["ttft_floor_p99_ratio"] > 0
    assert 0 <= report["rss_band_last_two_thirds"] <= report["rss_spread_last_two_thirds"]
    assert "rss_growth_last_third" in report
    assert set(report["checks"]) == {"no_5xx", "health_under_1s", "ttft_p99_within_2x", "pages_back", "rss_flat_10pct",
                                     "rss_floor_flat_10pct"}


def test_soak_only_normal_runs_the_normal_clients_alone(tmp_path):
    out = tmp_path / "soak.json"
    assert main(["bench", "soak", "--minutes", "0.1", "--normal-clients", "2", "--only-normal", "--kv-pages", "6144",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {k.split(":")[0] for k in report["statuses"]} == {"normal", "health"}
    assert report["only_normal"] and " --only-normal" in report["command"] and report["server_errors_5xx"] == 0
    assert report["normal_requests"] > 0 and report["pool_pages_back"] is True and report["kv_pages"] == 6144


def test_outside_heavy_drops_the_first_tokens_that_waited_beside_a_heavy_request():
    from redknot.bench.soak import _outside_heavy

    log = {"heavy": [["long_prompt", 10.0, 2.0]],
           "ttft_s": [0.5, 0.5, 0.5, 0.5], "ttft_at": [5.0, 9.8, 11.0, 12.5]}
    assert _outside_heavy(log) == [0.5, 0.5]  # 9.8-10.3 and 11.0-11.5 overlap 10-12; 5.0 and 12.5 do not


def test_rss_band_is_the_half_range_over_its_middle_and_growth_compares_thirds():
    from redknot.bench.soak import _band, _growth, _spread

    swings = [1000, 1130, 1010, 1140, 1000, 1150]  # trims and forwards: no creep
    assert abs(_band(swings) - 150 / 2150) < 1e-12 and abs(_spread(swings) - 0.15) < 1e-12
    assert abs(_growth(swings)) < 0.02
    creep = [1000, 1010, 1100, 1110, 1200, 1210]
    assert abs(_growth(creep) - (1210 / 1110 - 1)) < 1e-12

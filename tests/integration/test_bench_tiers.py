"""`redknot bench tiers` on the bundled model: a short stream, with and without a CPU tier."""

import json

from redknot.cli import main


def test_bench_tiers_reports_hit_rates_and_the_same_tokens(tmp_path):
    out = tmp_path / "tiers.json"
    assert main(["bench", "tiers", "--docs", "16", "--queries", "16", "--docs-per-query", "2", "--doc-tokens", "32",
                 "--window", "4", "--variants", "none,cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    none, cpu = result["variants"]["none"]["summary"], result["variants"]["cpu"]["summary"]
    assert cpu["first_tokens_match_first_variant"]
    assert cpu["queries_by_source"].get("cpu", 0) > 0 and "cpu" not in none["queries_by_source"]
    assert cpu["hit_rate_late"] >= none["hit_rate_late"] and cpu["chunk_cache"]["tiers"]["cpu"]["rejected"] == 0
    assert set(cpu["ttft_p50_s"]) <= {"gpu", "cpu", "computed"} and len(result["variants"]["cpu"]["queries"]) == 16

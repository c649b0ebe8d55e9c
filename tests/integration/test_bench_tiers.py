"""`redknot bench tiers` on the bundled model: a short stream, with and without a CPU tier."""

import json

from redknot.cli import main


def test_bench_tiers_reports_hit_rates_and_the_same_tokens(tmp_path):
    out = tmp_path / "tiers.json"
    assert main(["bench", "tiers", "--docs", "8", "--queries", "10", "--docs-per-query", "2", "--doc-tokens", "16",
                 "--window", "2", "--variants", "none,cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    none, cpu = result["variants"]["none"]["summary"], result["variants"]["cpu"]["summary"]
    assert cpu["first_tokens_match_first_variant"]
    assert cpu["queries_by_source"].get("cpu", 0) > 0 and "cpu" not in none["queries_by_source"]
    assert cpu["hit_rate_late"] >= none["hit_rate_late"] and cpu["chunk_cache"]["tiers"]["cpu"]["rejected"] == 0
    assert set(cpu["ttft_p50_s"]) <= {"gpu", "cpu", "computed"} and len(result["variants"]["cpu"]["queries"]) == 10


def test_bench_tier_ttft_loads_the_request_from_its_tier(tmp_path):
    out = tmp_path / "tier_ttft.json"
    assert main(["bench", "tier-ttft", "--docs", "2", "--doc-tokens", "32", "--repeats", "1", "--variants", "cpu",
                 "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["variant"] == "cpu" and row["tier_hits"] == {"cpu": 2}  # both documents (token-id prompts: no prefix piece)
    assert row["served_from_tier"] and row["bytes_loaded"] > 0 and row["ttft_tier_s"] > 0 and row["ttft_dense_s"] > 0

"""``redknot bench pd`` on the CPU (tiny arch): the bytes the KV server sent per plan, the decode
leg equal to a colocated run, and the load comparison's JSON."""

import argparse

from redknot.bench import pd


def test_bench_pd_bytes_on_cpu(tmp_path):
    p = argparse.ArgumentParser()
    pd.add_arguments(p)
    args = p.parse_args(["--arch", "tiny", "--head-configs", "g50-w32", "--lengths", "128,512", "--page-size", "16",
                         "--check", "--device", "cpu", "--decode-tokens", "4", "--out", str(tmp_path / "pd.json")])
    rows = pd.run(args)["bytes"]
    assert [r["plan"] for r in rows] == ["dense", "dense", "g50-w32", "g50-w32"]
    assert all(r["equals_colocated"] for r in rows)
    for r in rows:
        page_bytes = 16 * 16 * 4  # page size x head dim x float32, for K (or V)
        assert r["bytes_sent"] == r["bytes"] == 2 * r["pages"] * page_bytes  # sent is what was received
        assert sum(r["bytes_by_head_class"].values()) == r["bytes_sent"]
    sparse = {r["tokens"]: r for r in rows if r["plan"] == "g50-w32"}
    # half the heads keep sink + a 32-token window: about half of dense, less as the prompt grows
    assert sparse[512]["ratio_to_dense"] < sparse[128]["ratio_to_dense"] < 1
    assert sparse[512]["bytes_by_head_class"]["local"] > 0
    assert sparse[512]["decode_pages_held"] < rows[1]["decode_pages_held"]

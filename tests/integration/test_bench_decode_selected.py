"""CPU smoke test of the selected-set rows of `redknot bench decode` (tiny architecture): the
h2o / headsparse_h2o / retrieval rows run through the engine, hold fewer KV bytes than dense and
write JSON."""

import argparse
import json

from redknot.bench import decode as bd


def test_decode_bench_selected_rows(tmp_path, capsys):
    out = tmp_path / "decode.json"
    p = argparse.ArgumentParser()
    bd.add_arguments(p)
    args = p.parse_args(["--arch", "tiny", "--cases", "2x1000", "--methods", "dense,h2o,headsparse_h2o,retrieval",
                         "--tokens", "70", "--device", "cpu", "--decode-kv-budget", "0.3",
                         "--retrieval-ratio", "0.5", "--head-config", "g50-w64", "--decode-kv-window", "32", "--no-cuda-graphs", "--out", str(out)])
    result = bd.run(args)
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", "h2o", "headsparse_h2o", "retrieval"}
    for m, r in rows.items():
        assert "error" not in r and r["tok_s"] > 0, r
    dense = rows["dense"]["kv_read_bytes"]
    assert rows["h2o"]["kv_bytes_held_at_start"] < 0.5 * dense  # 30% budget on every head
    assert rows["retrieval"]["kv_bytes_held_at_start"] < rows["dense"]["kv_bytes_held_at_start"]
    assert result["decode_kv_budget"] == "0.3"
    assert "selected-set rows" in capsys.readouterr().out

"""CPU smoke test of `redknot bench decode --structured-output json` (tiny architecture): each
row also runs with every sequence under a JSON-schema grammar, through the engine, and the guided
rows say how their speed compares and that the grammar held for the whole timing."""

import argparse
import json

import pytest

pytest.importorskip("xgrammar")

from redknot.bench import decode as bd  # noqa: E402


def test_decode_bench_guided_rows(tmp_path, capsys):
    out = tmp_path / "decode.json"
    p = argparse.ArgumentParser()
    bd.add_arguments(p)
    args = p.parse_args(["--arch", "tiny", "--cases", "4x256", "--methods", "dense", "--tokens", "24",
                         "--device", "cpu", "--no-cuda-graphs", "--structured-output", "json", "--out", str(out)])
    bd.run(args)
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", "dense+json"}
    g = rows["dense+json"]
    assert g["tok_s"] > 0 and 0 < g["of_unguided"] and g["constrained_at_end"] == 4, g
    assert "guided decoding" in capsys.readouterr().out

"""`redknot demo` end to end on a tiny checkpoint: every method's row, exact methods agree with dense."""

import argparse

import redknot
from redknot import demo


def test_demo_prints_every_method_and_exact_methods_match_dense(tiny_checkpoint, capsys):
    model = tiny_checkpoint("llama", max_position_embeddings=4096)
    redknot.HeadConfig.synthetic(2, 2, 0.5, window=16, sink=4).to_json(model / "heads.json")
    try:
        assert demo.run(argparse.Namespace(model=str(model), device="cpu")) == 0
    finally:
        (model / "heads.json").unlink()  # the checkpoint is shared by other tests
    out = capsys.readouterr().out
    assert "relative logit error" in out and "same top-1: True" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in demo.METHODS}
    assert set(rows) == set(demo.METHODS)
    for m in ("dense", "prefix", "redknot_exact"):  # exact methods: same first token as dense on all three
        assert rows[m][4] == "3/3", rows[m]
    # chunk-reusing methods serve every document from the cache on the warm requests
    assert float(rows["dense"][3]) < float(rows["full_reuse"][3])  # dense: exact prefixes only
    assert float(rows["redknot"][-1]) < 1  # local heads hold less KV than dense

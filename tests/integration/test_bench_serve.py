"""CPU smoke test of the serving benchmark (the real run is on a GPU with a 7B architecture)."""

import json

import pytest

pytest.importorskip("openai")

from redknot.cli import main  # noqa: E402


def test_serve_bench_runs_methods_with_shared_documents(tmp_path):
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--arch", "tiny", "--device", "cpu", "--methods", "dense,full_reuse,redknot",
                 "--head-config", "g50-w16", "--clients", "4", "--requests", "8", "--pool-docs", "4",
                 "--docs-per-request", "2", "--doc-words", "30", "--max-tokens", "4", "--out", str(out)]) == 0
    methods = json.loads(out.read_text())["methods"]
    assert set(methods) == {"dense", "full_reuse", "redknot"}
    for m, r in methods.items():
        assert r["requests"] == 8 and not r["errors"] and not r["warmup_errors"], (m, r["errors"], r["warmup_errors"])
        assert r["ttft_p50_s"] > 0 and r["throughput_tok_s"] > 0
    # dense reuses only exact prefixes (automatic prefix caching), chunk methods every document
    assert 0 <= methods["dense"]["cached_tokens_mean"] < methods["full_reuse"]["cached_tokens_mean"]
    assert methods["full_reuse"]["cached_tokens_mean"] > 0  # documents recur across requests


@pytest.mark.parametrize("option,value,match", [("--methods", "dense,redknotkv", "unknown method"),
                                                ("--arch", "mistral7b", "unknown arch")])
def test_serve_bench_names_a_bad_option_before_building_a_model(tmp_path, capsys, monkeypatch, option, value, match):
    from redknot.bench import serve

    monkeypatch.setattr(serve, "_llm", lambda *a: pytest.fail("built a model for a bad option"))
    args = {"--arch": "tiny", "--methods": "dense", option: value}
    assert main(["bench", "serve", "--device", "cpu", "--out", str(tmp_path / "s.json")]
                + [x for kv in args.items() for x in kv]) != 0
    assert match in capsys.readouterr().err and not (tmp_path / "s.json").exists()

"""`redknot bench quality`: SQuAD scoring on known cases, data validation, and an end-to-end run on a
tiny random checkpoint (answers are noise there; the first-token gates against dense are not)."""

import argparse
import json
import re

import pytest

from redknot.bench import quality
from redknot.bench.quality import exact_match, f1_score, normalize_answer
from oracles.reuse_engine import reuse_oracle

RECORDS = [
    {"id": "q1", "type": "single", "question": "Who founded the city of Varna?",
     "documents": ["The merchant Ilsa Torv founded Varna in 1120.", "A river flows past the old mill at dawn."],
     "answers": ["Ilsa Torv", "the merchant Ilsa Torv"]},
    {"id": "q2", "type": "single", "question": "What jumps over the lazy dog?",
     "documents": ["The quick brown fox jumps over the lazy dog."], "answers": ["the quick brown fox"]},
    {"id": 3, "type": "multi", "question": "When was Varna founded, and by whom?",
     "documents": ["Attention heads differ: some look far back.", "Varna was founded in 1120.",
                   "Ilsa Torv was a merchant."], "answers": ["1120"]},
]


# ---- SQuAD normalisation, EM, F1 ----------------------------------------------------------------
@pytest.mark.parametrize("raw, norm", [
    ("The Eiffel Tower", "eiffel tower"),
    ("  an   apple, a pear! ", "apple pear"),
    ("Theory of the atom.", "theory of atom"),  # "the" inside "Theory" is not an article
    ("U.S.A.", "usa"),
    ("A", ""),
    ("", ""),
])
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_exact_match_is_max_over_golds_after_normalisation():
    assert exact_match("the Eiffel Tower.", ["Louvre", "Eiffel tower"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel Tower"]) == 0.0
    assert exact_match("An apple", "apple") == 1.0  # a single gold string works too
    assert exact_match("", ["a", "the"]) == 1.0  # gold reduces to empty, so does the prediction


def test_a_reasoned_answer_is_scored_on_its_conclusion():
    """'BRIDGE => ANSWER' (a model trained with --reasoned-answers) scores the part after the last '=>';
    a right bridge with a wrong conclusion scores nothing, plain answers are unchanged."""
    assert exact_match("Kestrel Works => Brar", ["Brar"]) == 1.0 and f1_score("Kestrel Works => Brar", "Brar") == 1.0
    assert exact_match("Brar => Kestrel Works", ["Brar"]) == 0.0
    assert exact_match("a => b => Brar.", "brar") == 1.0 and exact_match("Brar", "Brar") == 1.0
    assert f1_score("Kestrel Works => Orla Venn", "Orla Venn Smith") == pytest.approx(0.8)


def test_f1_known_values():
    assert f1_score("Eiffel Tower", ["The Eiffel Tower!"]) == 1.0
    assert f1_score("the Eiffel", ["Eiffel Tower"]) == pytest.approx(2 / 3)  # p=1, r=1/2
    assert f1_score("Paris France", ["Lyon"]) == 0.0
    # max over golds: 2 of 3 tokens against "quick brown fox", exact against the other
    assert f1_score("quick brown", ["quick brown fox", "brown quick"]) == 1.0
    assert f1_score("quick brown", ["quick brown fox", "dog"]) == pytest.approx(0.8)
    assert f1_score("fox fox", ["fox"]) == pytest.approx(2 / 3)  # bag of tokens: duplicates count once each
    assert f1_score("", ["fox"]) == 0.0 and f1_score("the", ["a"]) == 1.0  # empty vs empty is a match


# ---- data validation ----------------------------------------------------------------------------
def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("bad, message", [
    ("{not json", "malformed JSON"),
    (json.dumps({"id": "x", "documents": [], "question": "q", "answers": ["a"]}), "missing field(s) ['type']"),
    (json.dumps({"id": "x", "documents": "doc", "question": "q", "answers": ["a"], "type": "t"}),
     "'documents' must be list"),
    (json.dumps({"id": "x", "documents": ["d"], "question": "q", "answers": [], "type": "t"}), "'answers' is empty"),
    (json.dumps([1, 2]), "expected a JSON object"),
])
def test_malformed_data_names_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path / "data.jsonl", [json.dumps(RECORDS[0]), "", bad])
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        quality.load_records(path)
    assert f"{path}:3:" in str(err.value)


def test_limit_stops_before_later_lines(tmp_path):
    path = _write(tmp_path / "data.jsonl", [json.dumps(r) for r in RECORDS] + ["{broken"])
    assert [r["id"] for r in quality.load_records(path, limit=2)] == ["q1", "q2"]


def test_method_list_is_checked_before_loading(tmp_path):
    with pytest.raises(ValueError, match="unknown method"):
        quality.parse_methods("dense,nope", None)
    with pytest.raises(ValueError, match="need --head-config"):
        quality.parse_methods("dense,redknot", None)
    assert quality.parse_methods("dense, full_reuse,dense", None) == ["dense", "full_reuse"]


# ---- end to end ---------------------------------------------------------------------------------
def _args(**kw):
    p = argparse.ArgumentParser()
    quality.add_arguments(p)
    argv = []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    import redknot

    tmp = tmp_path_factory.mktemp("quality")
    model = tiny_checkpoint("llama", num_hidden_layers=2)
    heads = tmp / "heads.json"
    redknot.HeadConfig.synthetic(2, 2, 0.5, window=16, sink=4).to_json(heads)
    data = _write(tmp / "data.jsonl", [json.dumps(r) for r in RECORDS])
    return model, heads, data, tmp


def test_end_to_end_json_and_gates(setup, capsys):
    model, heads, data, tmp = setup
    out = tmp / "results.json"
    methods = ["dense", "full_reuse", "redknot_paper", "redknot_exact"]
    result = quality.run(_args(model=model, data=data, methods=",".join(methods), head_config=heads, out=out,
                               max_tokens=4, device="cpu", dtype="float32"))
    saved = json.loads(out.read_text())
    assert saved["methods"].keys() == set(methods) and saved == json.loads(json.dumps(result))
    for key in ("model", "data", "args", "date"):
        assert key in saved
    assert saved["args"]["max_tokens"] == 4

    for m, s in saved["methods"].items():
        assert s["n"] == 3
        for key in ("em", "f1", "top1_agreement", "top10_overlap", "logit_cos"):
            assert s[key] is not None, (m, key)
        assert 0 <= s["em"] <= s["f1"] <= 1  # an exact match is also a full F1 match
        assert set(s["by_type"]) == {"single", "multi"}
        assert s["by_type"]["single"]["n"] == 2 and s["by_type"]["multi"]["n"] == 1
        for t in s["by_type"].values():
            assert {"em", "f1", "top1_agreement", "top10_overlap", "logit_cos", "n"} <= t.keys()
            assert 0 <= t["em"] <= 1 and 0 <= t["f1"] <= 1

    dense, exact, reuse = saved["methods"]["dense"], saved["methods"]["redknot_exact"], saved["methods"]["full_reuse"]
    assert dense["top1_agreement"] == 1.0 and dense["top10_overlap"] == 1.0
    assert dense["logit_cos"] == pytest.approx(1.0, abs=1e-9)
    assert dense["cached_tokens"] == 0 and dense["flops_fraction"] == 1.0
    # redknot_exact is the redknot code path made exact: it must match dense at the first token
    assert exact["top1_agreement"] == 1.0 and exact["logit_cos"] >= 0.99999
    # and it answers exactly as dense does, record by record
    for rec in saved["records"]:
        assert rec["predictions"]["redknot_exact"]["text"] == rec["predictions"]["dense"]["text"]
    # reuse methods serve the documents from the cache and execute fewer FLOPs than dense
    assert reuse["cached_tokens"] > 0 and 0 < reuse["flops_fraction"] < 1

    # the page pool fits the longest record and its answer (the paged methods above decoded in it),
    # instead of the serving default (half the free GPU memory)
    from redknot.engine import LLM
    from redknot.reuse.prompt import build_prompt

    llm = LLM(model=model, head_config=heads, device="cpu", dtype="float32")
    longest = max(len(build_prompt(llm.tokenizer, r["question"], r["documents"]).token_ids)
                  for r in RECORDS)
    heads = llm.config.num_hidden_layers * llm.config.num_key_value_heads
    # its context, and for the chunk methods the chunk pages it copies from
    assert heads * -(-(longest + 4) // 64) <= saved["kv_pages"] <= 3 * heads * (-(-(longest + 4) // 64) + 1)

    table = capsys.readouterr().out
    for m in methods:
        assert any(line.startswith(m + " ") for line in table.splitlines())
    assert "EM:multi" in table and "EM:single" in table


def test_shallow_window_reaches_the_recovery(setup):
    """--shallow-window is the window redknot's shallow layers recover within: with every head global,
    every layer shallow and a dense FFN, a window wider than the prompt is the exact recompute (dense),
    a narrow one is not; a window < 1 is refused before the model loads."""
    import redknot

    model, _, data, tmp = setup
    heads = tmp / "all_global.json"
    redknot.HeadConfig.all_global(2, 2).to_json(heads)
    sparse = tmp / "all_shallow.json"
    sparse.write_text(json.dumps({"dense_until": 2, "deep_layer_start": 2}))

    def cos(window):
        out = quality.run(_args(model=model, data=data, methods="dense,redknot_paper", head_config=heads, sparse_ffn=sparse,
                                shallow_window=window, out=tmp / f"sw{window}.json", max_tokens=2, device="cpu",
                                dtype="float32"))
        return out["methods"]["redknot_paper"]["logit_cos"]

    assert cos(100_000) >= 0.99999
    assert cos(2) < 0.9999
    with pytest.raises(ValueError, match="--shallow-window must be >= 1"):
        quality.run(_args(model=model, data=data, methods="dense", shallow_window=0, out=tmp / "x.json"))


def test_dense_flops_match_the_recovery_forward(setup):
    """The analytic dense count is the FLOPs the dense recovery forward reports for the same prompt."""
    from redknot import LLM
    from redknot.reuse.prompt import build_prompt

    model, heads, _, _ = setup
    llm = LLM(model=model, device="cpu", dtype="float32")
    rec = RECORDS[2]
    cp = build_prompt(llm.tokenizer, rec["question"], rec["documents"])
    measured = reuse_oracle(llm).prefill(cp, "dense").recovered.flops.totals()["total"]
    assert quality.dense_prefill_flops(llm.config, len(cp.token_ids)) == measured


def test_malformed_data_fails_before_the_model_loads(setup, tmp_path):
    _, heads, _, _ = setup
    bad = _write(tmp_path / "bad.jsonl", [json.dumps(RECORDS[0]), json.dumps({"id": "x", "question": "q"})])
    with pytest.raises(ValueError, match=re.escape(f"{bad}:2: missing field(s) ['documents', 'answers', 'type']")):
        quality.run(_args(model=tmp_path / "no-such-model", data=bad, methods="dense", out=tmp_path / "r.json"))


def test_a_stopped_run_keeps_the_records_it_finished(setup, monkeypatch):
    """Results are saved after every record: a run cut short (time limit, Ctrl-C) leaves a valid JSON
    of the records done, marked incomplete."""
    model, heads, data, tmp = setup
    out = tmp / "partial.json"
    real, calls = quality._score, []

    def score(llm, rec, m, *a):
        if rec["id"] == RECORDS[1]["id"]:
            raise KeyboardInterrupt  # stopped during the second record
        calls.append(m)
        return real(llm, rec, m, *a)

    monkeypatch.setattr(quality, "_score", score)
    with pytest.raises(KeyboardInterrupt):
        quality.run(_args(model=model, data=data, methods="dense,full_reuse", out=out, max_tokens=2, device="cpu",
                          dtype="float32"))
    saved = json.loads(out.read_text())
    assert saved["complete"] is False and saved["n_records_done"] == 1 and saved["n_records"] == 3
    assert [r["id"] for r in saved["records"]] == [RECORDS[0]["id"]]
    assert saved["methods"]["full_reuse"]["n"] == 1 and calls == ["dense", "full_reuse"]
    assert not (tmp / "partial.json.tmp").exists()


def test_a_reasoned_answers_bridge_is_scored_per_type(monkeypatch):
    """A record made with --meta names its bridge: a reasoned answer's bridge is scored, and the
    summary gives how often it was right and how often the answer followed a right one."""
    from types import SimpleNamespace

    import torch

    monkeypatch.setattr(quality, "dense_prefill_flops", lambda cfg, n: 100 * n)
    logits = torch.randn(32)

    def row(text, rec):
        out = SimpleNamespace(outputs=[SimpleNamespace(text=text)], metrics={}, prompt_token_ids=[1, 2, 3],
                              first_token_logits=logits)
        return {**quality._score(SimpleNamespace(config=None), rec, "dense", out, out), "type": rec["type"]}

    rec = {"answers": ["Brar"], "type": "multi_hop", "meta": {"bridge": "Kestrel Works"}}
    rows = [row("Kestrel Works => Brar", rec), row("Kestrel Works => Lund", rec), row("Vell Mills => Brar", rec),
            row("Brar", rec), row("Brar", {"answers": ["Brar"], "type": "single_hop"})]
    assert [r["bridge_em"] for r in rows] == [1.0, 1.0, 0.0, None, None]
    summary = quality._aggregate(rows)
    mh = summary["by_type"]["multi_hop"]
    assert (mh["bridge_em"], mh["bridge_n"], mh["em_given_bridge"]) == (pytest.approx(2 / 3), 3, 0.5)
    assert "bridge_em" not in summary["by_type"]["single_hop"]


def test_the_twins_answer_is_counted_apart_from_other_errors():
    """A testbed record with --meta names its same-variant twins' answers: a wrong answer that is one
    of them is a twin match (the right kind of fact about the wrong entity); other errors are not."""
    rec = {"answers": ["Brar"], "type": "description", "meta": {"distractor_answers": ["Lund"]}}
    assert [quality.twin_match(t, rec) for t in ("Brar", "Lund", "the Lund", "Vell", "Kestrel => Lund")] == \
        [0.0, 1.0, 1.0, 0.0, 1.0]
    assert quality.twin_match("Lund", {"answers": ["Brar"], "type": "single_hop"}) is None


def _results_file(tmp_path, rows_by_record):
    """A results JSON as `bench quality` writes it, from (record, text) pairs, without twin scores."""
    entries, rows = [], []
    for rec, text in rows_by_record:
        row = {"text": text, "em": exact_match(text, rec["answers"]), "f1": 0.0, "top1_agreement": 1.0,
               "top10_overlap": 1.0, "logit_cos": 1.0, "cached_tokens": 0, "flops": 10, "dense_flops": 10,
               "prompt_tokens": 5, "bridge_em": None}
        entries.append({"id": rec["id"], "type": rec["type"], "answers": rec["answers"],
                        "predictions": {"dense": row}})
        rows.append({**row, "type": rec["type"]})
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"methods": {"dense": quality._aggregate(rows)}, "records": entries,
                                "model": "m", "n_records": len(entries)}))
    return path


def test_rescore_adds_the_twin_share_to_stored_answers(tmp_path, capsys):
    """--rescore scores a results file's answers again against the records (no model): the twin
    share appears per type, first-token figures are kept, and records that do not match fail."""
    recs = [{"id": f"r{i}", "type": "description", "question": "q", "documents": ["d"], "answers": ["Brar"],
             "meta": {"distractor_answers": ["Lund"]}} for i in range(4)]
    recs.append({"id": "s", "type": "single_hop", "question": "q", "documents": ["d"], "answers": ["Vell"]})
    old = _results_file(tmp_path, zip(recs, ["Brar", "Lund", "Lund", "Oss", "Vell"]))
    data = _write(tmp_path / "data.jsonl", [json.dumps(r) for r in recs])
    out = tmp_path / "new.json"
    result = quality.run(_args(rescore=old, data=data, out=out))
    saved = json.loads(out.read_text())
    assert saved["methods"] == result["methods"] and saved["rescored"]["from"] == str(old)
    dense = saved["methods"]["dense"]
    assert dense["by_type"]["description"]["em"] == 0.25 and dense["by_type"]["description"]["twin_em"] == 0.5
    assert "twin_em" not in dense["by_type"]["single_hop"] and dense["twin_em"] == 0.5
    assert dense["top1_agreement"] == 1.0 and dense["flops_fraction"] == 1.0
    assert "answered with the twin's answer" in capsys.readouterr().out

    with pytest.raises(ValueError, match="drop --limit"):
        quality.run(_args(rescore=old, data=data, out=out, limit=2))
    other = _write(tmp_path / "other.jsonl", [json.dumps({**recs[0], "answers": ["Oss"]})] +
                   [json.dumps(r) for r in recs[1:]])
    with pytest.raises(ValueError, match="'r0' has other answers"):
        quality.run(_args(rescore=old, data=other, out=out))
    with pytest.raises(ValueError, match="'r1' is not in the data"):
        quality.run(_args(rescore=old, data=_write(tmp_path / "few.jsonl", [json.dumps(recs[0])]), out=out))
    bad = tmp_path / "bad.json"
    bad.write_text("{\"methods\": ")
    with pytest.raises(ValueError, match="not a results JSON"):
        quality.run(_args(rescore=bad, data=data, out=out))


def test_selected_set_rows_run_and_bound_to_their_references(setup):
    """h2o@B / headsparse_h2o@B / retrieval rows: a budget wider than any prompt is dense exactly, a
    16-token budget on a ~600-token prompt is not; live retrieval heads with top-p 1 are the plan
    with those heads global."""
    import redknot

    model, _, _, tmp = setup
    words = " ".join(f"w{i}" for i in range(90))
    recs = [{"id": "long", "type": "single", "question": "Which word comes first?",
             "documents": [f"The first word is alpha. {words}", f"The last word is omega. {words}"],
             "answers": ["alpha"]}]
    data = _write(tmp / "long.jsonl", [json.dumps(r) for r in recs])
    heads = tmp / "retrieval.json"
    redknot.HeadConfig([["retrieval", "local"], ["global", "retrieval"]], [[64, 64], [-1, 64]], [[4, 4], [0, 4]],
                       retrieval_top_p=1.0).to_json(heads)
    # full_reuse sizes the pool for the chunks it copies from too: room for earlier rows' prefixes
    methods = ["dense", "h2o@100000", "h2o@16", "headsparse", "retrieval", "headsparse_h2o@0.05", "full_reuse"]
    out = quality.run(_args(model=model, data=data, methods=",".join(methods), head_config=heads,
                            out=tmp / "sel.json", max_tokens=3, device="cpu", dtype="float32"))
    rows = out["methods"]
    assert rows["h2o@100000"]["logit_cos"] >= 0.99999 and rows["h2o@100000"]["top1_agreement"] == 1.0
    pred = out["records"][0]["predictions"]
    # a budget applies from the end of the prompt on: the first token is dense's, later ones differ
    assert rows["h2o@16"]["logit_cos"] >= 0.99999 and pred["h2o@16"]["text"] != pred["dense"]["text"]
    assert pred["h2o@100000"]["text"] == pred["dense"]["text"]
    assert pred["retrieval"]["text"] == pred["headsparse"]["text"]
    assert rows["retrieval"]["logit_cos"] == pytest.approx(rows["headsparse"]["logit_cos"], abs=1e-5)
    assert rows["headsparse_h2o@0.05"]["n"] == 1
    # a selected row prefills the whole prompt under its base plan (no hits on earlier rows' prefixes)
    for m in ("h2o@100000", "h2o@16"):
        assert rows[m]["flops_fraction"] == pytest.approx(1.0) and rows[m]["cached_tokens"] == 0
    for m in ("retrieval", "headsparse_h2o@0.05"):
        assert rows[m]["flops_fraction"] == pytest.approx(rows["headsparse"]["flops_fraction"])
        assert rows[m]["cached_tokens"] == 0
    # the budget rows' window is the run's --decode-kv-window: a 16-token budget with a 4-token
    # window keeps other pages than with the default 128
    narrow = quality.run(_args(model=model, data=data, methods="dense,h2o@16", out=tmp / "sel4.json", max_tokens=3,
                               device="cpu", dtype="float32", decode_kv_window=4))
    assert narrow["args"]["decode_kv_window"] == 4
    assert narrow["records"][0]["predictions"]["h2o@16"]["text"] != pred["h2o@16"]["text"]
    with pytest.raises(ValueError, match="decode_kv_budget"):
        quality.split_variant("h2o@1.5")
    with pytest.raises(ValueError, match="need --head-config"):
        quality.parse_methods("dense,retrieval", None)

import argparse
import json

import numpy as np
import pytest
import torch

from redknot.config import HeadConfig
from redknot.models import load_model
from redknot.profile import (CalibrationError, Sample, attention_stats, builtin_records, coverage_window,
                             load_calibration, measure_heads, n_global_target, select_heads, window_error)
from redknot.profile import cli as profile_cli

SPEC = dict(num_hidden_layers=3, num_key_value_heads=4, num_attention_heads=8)
PAGE = 64


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", **SPEC)


def _args(ckpt, tmp_path, *extra):
    p = argparse.ArgumentParser()
    profile_cli.add_arguments(p)
    return p.parse_args(["--model", str(ckpt), "--out", str(tmp_path / "heads.json"), "--samples", "3",
                         "--ref-window", "64", "--max-tokens", "512", "--no-progress", *extra])


# ---- metric functions on synthetic attention ---------------------------------------------------
def _rows(n, weights_fn):
    """[1, n, n] causal attention whose row p is weights_fn(p) normalised over keys 0..p."""
    probs = torch.zeros(1, n, n)
    for p in range(n):
        w = torch.as_tensor(weights_fn(p), dtype=torch.float32)
        probs[0, p, :p + 1] = w / w.sum()
    return probs


def test_attention_stats_local_uniform_and_spike():
    n, sink, ref, buckets = 256, 4, 32, 256 // 16
    pos = torch.arange(n)
    stats = lambda probs: attention_stats(probs, pos, sink, ref, 16, buckets, retrieval_k=4)  # noqa: E731
    q = pos >= sink + ref  # the measured queries

    local = stats(_rows(n, lambda p: [1.0 if p - j < 10 else 0.0 for j in range(p + 1)]))
    assert local["edge"][0, q].abs().max() < 1e-6
    assert torch.allclose(local["covered"][0, q], torch.ones(int(q.sum()), buckets))  # 10 tokens < one page
    assert coverage_window(local["covered"][0, q].mean(0), 0.95, 16) == 16

    uniform = stats(_rows(n, lambda p: [1.0] * (p + 1)))
    p = pos[q].float()
    assert torch.allclose(uniform["edge"][0, q], (p + 1 - sink - ref) / (p + 1), atol=1e-5)
    assert torch.allclose(uniform["retrieval"][0, q], (p + 1 - sink - ref).clamp(max=4) / (p + 1), atol=1e-5)
    # covered(W) = (sink + W) / (p + 1) while the window does not reach the sink
    assert torch.allclose(uniform["covered"][0, -1, 3], torch.tensor((sink + 64) / n), atol=1e-5)
    assert coverage_window(uniform["covered"][0, q].mean(0), 0.95, 16) > n // 2

    # all of the mass on key 4 (the first after the sink: distant for every measured query) and key 0
    spike = stats(_rows(n, lambda p: [0.5 if j in (0, sink) else 0.0 for j in range(p + 1)]))
    assert torch.allclose(spike["retrieval"][0, q], torch.full((int(q.sum()),), 0.5))
    assert torch.allclose(spike["edge"][0, q], spike["retrieval"][0, q])
    sink_only = stats(_rows(n, lambda p: [1.0 if j < sink else 0.0 for j in range(p + 1)]))
    assert sink_only["edge"][0, q].max() < 1e-6 and sink_only["retrieval"][0, q].max() < 1e-6
    assert coverage_window(sink_only["covered"][0, q].mean(0), 0.95, 16) == 16  # the sink is always kept


def test_window_error_is_what_a_local_head_loses():
    n, d = 64, 8
    values = torch.randn(1, n, d, generator=torch.Generator().manual_seed(0))
    q_pos = torch.tensor([n - 1])
    local = torch.zeros(1, 1, n)
    local[..., -4:] = 0.25                    # inside the window: nothing changes
    far = torch.zeros(1, 1, n)
    far[..., 10] = 0.9
    far[..., -1] = 0.1                        # 90% on one distant token: the output changes
    same = torch.zeros(1, 1, n)
    same[..., 10] = 0.5
    same[..., -1] = 0.5
    vals_same = values.clone()
    vals_same[:, 10] = vals_same[:, -1]       # far mass on a value equal to a near one: no loss
    kw = dict(sink=2, window=8)
    assert window_error(local, q_pos, values, **kw).item() < 1e-10
    assert window_error(far, q_pos, values, **kw).item() > 0.5
    assert window_error(same, q_pos, vals_same, **kw).item() < 1e-10
    assert attention_stats(same, q_pos, 2, 8, 8, 8, 4)["edge"].item() == pytest.approx(0.5)  # edge mass says 0.5


def test_question_weight_selects_by_the_question_s_loss():
    edge = np.linspace(0.0, 0.9, 12).reshape(3, 4)
    m = _metrics(edge)
    m["question_window_error"] = edge[::-1].copy()  # the layers in the opposite order
    top = lambda classes: [(l, h) for l, row in enumerate(classes) for h, c in enumerate(row) if c == "global"]  # noqa: E731
    assert top(select_heads(m, target_global=0.25, min_global_edge=None, question_weight=0.0)[0]) == [(2, 1), (2, 2), (2, 3)]
    assert top(select_heads(m, target_global=0.25, min_global_edge=None, question_weight=1.0)[0]) == [(0, 1), (0, 2), (0, 3)]


def test_coverage_window_rounds_up_to_pages():
    frac = np.array([[0.5, 0.94, 0.96, 1.0], [0.97, 1.0, 1.0, 1.0], [0.1, 0.2, 0.3, 0.9]])
    np.testing.assert_array_equal(coverage_window(frac, 0.95, 64), [192, 64, 256])  # never reached: widest


# ---- metrics on a hand-built model -------------------------------------------------------------
def _forced_heads_model(ckpt, special):
    """Layer 0 of the tiny model rewired: KV head 0 attends to the last few tokens (local), head 1
    uniformly (global), head 2 to the token ``special`` wherever it is (retrieval)."""
    model, cfg = load_model(ckpt, "float32", "cpu")
    d, g = cfg.head_dim, cfg.num_kv_groups
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 2:] /= emb[:, 2:].norm(dim=1, keepdim=True)  # every row: norm 1 outside dims 0, 1
        emb[:, 0], emb[:, 1] = 1.0, 0.0  # dim 0: the same for every token, so q/k read from it are constant
        emb[special, 1] = 1.0  # dim 1: only the special token
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        x0 = cfg.hidden_size**0.5 / 2**0.5  # RMS-normed dim 0 of an ordinary token
        wq, wk = attn.q_proj.weight, attn.k_proj.weight
        for kv in range(3):
            wq[kv * g * d:(kv + 1) * g * d] = 0
            wk[kv * d:(kv + 1) * d] = 0
        # RoPE pair 4 turns by 0.01 rad per token: q.k = a^2 cos(0.01 (p - j)) decays with distance
        a = (4 * 20000) ** 0.5 / x0
        for qh in range(g):
            wq[qh * d + 4, 0] = a
            wq[(2 * g + qh) * d + 7, 0] = 1.0  # pair 7 barely turns: position-blind
        wk[0 * d + 4, 0] = a
        wk[2 * d + 7, 1] = 1.5  # only the special token has a key for head 2
        attn.v_proj.weight[:, :2] = 0  # values: token content only, no offset shared by every token
    return model, cfg


def test_metrics_separate_forced_local_global_and_retrieval_heads(ckpt):
    n, c0, special = 320, 220, 7
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 300, (n,), generator=gen)
    ids[ids == special] = 11
    ids[0], ids[4] = 1, special  # BOS; the special token right after the sink
    alt = ids.clone()
    alt[1:c0] = torch.randint(10, 300, (c0 - 1,), generator=gen)
    alt[alt == special] = 12
    model, cfg = _forced_heads_model(ckpt, special)
    m = measure_heads(model, cfg, [Sample(ids, alt, (c0, n))], sink=4, ref_window=PAGE, page_size=PAGE,
                      retrieval_k=4, progress=False)
    edge, cov, retr, sens = (m[k][0] for k in ("edge_mass", "coverage_window", "retrieval_score",
                                               "prefix_sensitivity"))
    local, uniform, retrieval = 0, 1, 2
    assert edge[local] < 0.01 and cov[local] == PAGE and retr[local] < 0.01
    assert edge[uniform] > 0.5 and cov[uniform] >= 4 * PAGE and retr[uniform] < 0.05
    assert retr[retrieval] > 0.9 and edge[retrieval] > 0.9
    assert sens[local] < 0.3 and sens[local] < sens[uniform] / 2 and sens[local] < sens[retrieval] / 2
    # blocks of 16 query rows (bounded memory) give the same numbers as one block
    small = measure_heads(model, cfg, [Sample(ids, alt, (c0, n))], sink=4, ref_window=PAGE, page_size=PAGE,
                          retrieval_k=4, progress=False, block_elems=16 * cfg.num_attention_heads * n)
    for k in ("edge_mass", "coverage_window", "retrieval_score", "prefix_sensitivity"):
        np.testing.assert_allclose(small[k], m[k], atol=1e-4)
    # layer 0 sees identical inputs in both runs: the isolated and the end-to-end measures agree
    np.testing.assert_allclose(m["prefix_sensitivity_e2e"][0], sens, rtol=1e-5)
    # with one global head to give, the score picks a head that reads the prefix, never the local one
    classes, windows, _, _ = select_heads(m, target_global=1 / 12, page_size=PAGE, ref_window=PAGE,
                                          retrieval_threshold=0.5, min_global_edge=None)
    assert classes[0][local] == "local" and windows[0][local] == PAGE
    assert sum(r.count("global") for r in classes) == 1
    assert classes[0][retrieval] == "global" or (classes[0][retrieval], windows[0][retrieval]) == ("retrieval", PAGE)


# ---- selection rule ----------------------------------------------------------------------------
def _metrics(edge, sens=None, retr=None, cover=None):
    edge = np.asarray(edge, dtype=float)
    return {"edge_mass": edge, "prefix_sensitivity": edge if sens is None else np.asarray(sens, dtype=float),
            "retrieval_score": np.zeros_like(edge) if retr is None else np.asarray(retr, dtype=float),
            "coverage_window": np.full(edge.shape, 128) if cover is None else np.asarray(cover)}


def test_select_heads_target_thresholds_dense_prefix_and_retrieval():
    edge = np.linspace(0.0, 0.9, 12).reshape(3, 4)
    for target in (0.0, 0.1, 0.15, 0.3, 0.5, 1.0):
        classes, *_ = select_heads(_metrics(edge), target_global=target, min_global_edge=None)
        assert sum(r.count("global") for r in classes) == n_global_target(target, 12) == int(target * 12 + 0.5)
    classes, windows, score, s = select_heads(_metrics(edge), target_global=0.25, min_global_edge=None)
    assert classes[2] == ["local", "global", "global", "global"]  # the three highest scores
    assert windows[2] == [128, -1, -1, -1] and s["global"] == 3 and np.nanargmax(score) == 11
    # below the floor: never global (fewer than the target); above the ceiling: always global
    classes, _, _, s = select_heads(_metrics(edge), target_global=0.5, min_global_edge=0.75)
    assert s["global"] == 2 and s["below_min_edge"] == 10
    # a head that reads far only from the question (answer retrieval) stays a candidate
    m = _metrics(edge)
    m["question_edge_mass"] = np.zeros_like(edge)
    m["question_edge_mass"][0, 1] = 0.8
    classes, _, _, s = select_heads(m, target_global=0.5, min_global_edge=0.75)
    assert s["below_min_edge"] == 9 and classes[0][1] == "global"
    classes, _, _, s = select_heads(_metrics(edge), target_global=0.1, force_global_edge=0.5, min_global_edge=None)
    assert s["global"] == 5 and s["forced_global"] == 4  # edges >= 0.5: the top one by rank, four forced
    # dense prefix: written global, forced dense, outside the budget
    classes, windows, score, s = select_heads(_metrics(edge[::-1].copy()), target_global=0.25, dense_prefix_layers=1,
                                              min_global_edge=None)
    assert classes[0] == ["global"] * 4 and windows[0] == [-1] * 4 and np.isnan(score[0]).all()
    assert s["eligible"] == 8 and sum(r.count("global") for r in classes[1:]) == 2
    # retrieval: a concentrated distant head that is not global
    retr = np.zeros((3, 4))
    retr[0, 1] = 0.6
    classes, windows, _, _ = select_heads(_metrics(edge, retr=retr, cover=np.full((3, 4), 512)), target_global=0.25,
                                          ref_window=100, page_size=64, retrieval_threshold=0.5, min_global_edge=None)
    assert classes[0][1] == "retrieval" and windows[0][1] == 128 and windows[0][0] == 512


# ---- the whole profiler on a tiny checkpoint ---------------------------------------------------
def test_profile_cli_writes_valid_plan_and_plot(ckpt, tmp_path):
    args = _args(ckpt, tmp_path, "--plot", str(tmp_path / "heads.png"), "--target-global", "0.25",
                 "--min-global-edge", "none")
    assert profile_cli.run(args) == 0
    plan = HeadConfig.from_json(tmp_path / "heads.json").validate_model(3, 4)
    counts = plan.class_counts()
    assert counts["global"] == round(0.25 * 12) == 3 and counts["dense"] == 0
    windows = np.array(plan.windows)
    limited = np.isin(np.array(plan.classes), ["local", "retrieval"])
    assert limited.any() and (windows[limited] % PAGE == 0).all() and (windows[limited] >= PAGE).all()
    raw = json.loads((tmp_path / "heads.json").read_text())
    prof = raw["profiling"]
    assert prof["samples"] == 3 and prof["parameters"]["page_size"] == PAGE and raw["model"] == ckpt.name
    for name in ("prefix_sensitivity", "edge_mass", "coverage_window", "retrieval_score"):
        assert np.array(prof["metrics"][name]).shape == (3, 4)
    assert (tmp_path / "heads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_dense_prefix_and_default_thresholds(ckpt, tmp_path):
    args = _args(ckpt, tmp_path, "--dense-prefix-layers", "1", "--page-size", "32", "--samples", "2")
    assert profile_cli.run(args) == 0
    plan = HeadConfig.from_json(tmp_path / "heads.json").validate_model(3, 4)
    assert plan.dense_prefix_layers == 1 and plan.effective_classes()[0] == ["dense"] * 4
    edge = np.array(plan.metadata["profiling"]["metrics"]["edge_mass"])
    assert (edge[1:] >= 0.02).all()  # random weights: the default floor overrides nothing
    assert plan.class_counts()["global"] == round(0.15 * 8) == 1  # target over the 8 heads outside the prefix
    limited = np.isin(np.array(plan.classes), ["local", "retrieval"])
    assert (np.array(plan.windows)[limited] % 32 == 0).all()


# ---- calibration -------------------------------------------------------------------------------
def test_builtin_records_are_deterministic_multi_document():
    a, b = builtin_records(4, seed=1), builtin_records(4, seed=1)
    assert a == b and a != builtin_records(4, seed=2)
    for r in a:
        assert set(r) == {"id", "documents", "question", "answers", "type"} and len(r["documents"]) >= 4
    docs, answer = a[1]["documents"], a[1]["answers"][0]  # a multi-hop record
    founder = a[1]["question"].split("founded by ")[1].removesuffix(" based?")
    company = next(d for d in docs if founder in d).split(" founded ")[1].split(" in ")[0]
    # two hops: founder -> company in one document, company -> city in another
    assert sum(company in d for d in docs) >= 2
    assert any(answer in d and company in d and founder not in d for d in docs)


def test_calibration_files(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps({"id": "x", "documents": ["one", "two"], "question": "q?", "answers": ["a"],
                                "type": "t"}) + "\n\n" + json.dumps({"documents": ["three"]}) + "\n")
    recs = load_calibration(good)
    assert [r["documents"] for r in recs] == [["one", "two"], ["three"]] and recs[1]["question"]
    text = tmp_path / "c.txt"
    text.write_text("para one\nstill one\n\n\npara two\n  \npara three\n")
    assert load_calibration(text)[0]["documents"] == ["para one\nstill one", "para two", "para three"]
    cases = [("bad.jsonl", '{"documents": ["a"]}\n{not json}\n', r"bad.jsonl:2: malformed JSON"),
             ("nodocs.jsonl", '{"question": "q"}\n', r"nodocs.jsonl:1: 'documents' must be a non-empty list"),
             ("list.jsonl", '["a", "b"]\n', r"list.jsonl:1: expected a JSON object"),
             ("empty.txt", "\n \n", r"empty.txt: no calibration records")]
    for name, content, match in cases:
        (tmp_path / name).write_text(content)
        with pytest.raises(CalibrationError, match=match):
            load_calibration(tmp_path / name)
    with pytest.raises(CalibrationError, match="no such calibration file"):
        load_calibration(tmp_path / "missing.jsonl")


def test_bad_calibration_fails_before_loading_the_model(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"documents": "not a list"}\n')
    args = ["--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "h.json"), "--calib",
            str(tmp_path / "bad.jsonl")]
    assert profile_cli.main(args) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1: 'documents' must be a non-empty list" in err and "no-model" not in err


def test_ablation_measures_each_head_s_effect_on_the_answer(ckpt, tmp_path):
    """Making a head local changes the last position's prediction only as much as the head reads
    beyond its window: nothing for a head that is local already, more for one reading everything."""
    from redknot.profile.profiler import ablation_kl

    n, special = 320, 7
    ids = torch.randint(10, 300, (n,), generator=torch.Generator().manual_seed(1))
    ids[ids == special] = 11
    ids[0], ids[4] = 1, special
    model, cfg = _forced_heads_model(ckpt, special)
    kl = ablation_kl(model, cfg, [Sample(ids, ids, (200, n))], sink=4, window=PAGE, progress=False)
    assert kl.shape == (3, 4) and (kl >= -1e-6).all()
    local, uniform = 0, 1
    assert kl[0][uniform] > 0 and kl[0][local] < kl[0][uniform] / 100
    with pytest.raises(ValueError, match="ablation_kl"):
        select_heads(_metrics(np.ones((3, 4))), ablation_weight=1.0)
    # the CLI: the score is the ablation alone, recorded in the plan's metadata
    args = _args(ckpt, tmp_path, "--samples", "2", "--target-global", "0.25", "--min-global-edge", "none",
                 "--ablation-weight", "1.0")
    assert profile_cli.run(args) == 0
    plan = HeadConfig.from_json(tmp_path / "heads.json").validate_model(3, 4)
    prof = plan.metadata["profiling"]
    measured = np.array(prof["metrics"]["ablation_kl"])
    assert measured.shape == (3, 4) and prof["parameters"]["ablation_weight"] == 1.0
    top3 = set(np.argsort(-measured, axis=None)[:3].tolist())
    glob = {l * 4 + h for l, row in enumerate(plan.classes) for h, c in enumerate(row) if c == "global"}
    assert glob == top3

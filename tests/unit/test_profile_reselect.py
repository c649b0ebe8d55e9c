"""Plans at other global ratios from a stored profile (`redknot profile --reselect`), and the share
of heads that can be local at each window."""

import numpy as np
import pytest

from redknot.config import HeadConfig
from redknot.profile.profiler import local_share, reselect, select_heads


def _profiled(target=0.25, seed=0, L=6, H=2):
    rng = np.random.default_rng(seed)
    metrics = {"prefix_sensitivity": rng.random((L, H)), "edge_mass": rng.random((L, H)) * 0.5 + 0.03,
               "question_edge_mass": rng.random((L, H)), "question_window_error": rng.random((L, H)),
               "retrieval_score": rng.random((L, H)) * 0.2,
               "coverage_window": rng.choice([64, 128, 256, 512, 1024], size=(L, H))}
    params = dict(target_global=target, coverage=0.95, page_size=64, dense_prefix_layers=0, sink=4, ref_window=256,
                  retrieval_k=8, retrieval_threshold=0.25, min_global_edge=0.02, force_global_edge=None,
                  sensitivity_weight=0.5, question_weight=0.5, ablation_weight=0.0, max_tokens=4096)
    keys = ("dense_prefix_layers", "page_size", "ref_window", "retrieval_threshold", "min_global_edge",
            "force_global_edge", "sensitivity_weight", "question_weight", "ablation_weight")
    classes, windows, _, _ = select_heads(metrics, target_global=target, **{k: params[k] for k in keys})
    prof = {"parameters": params, "metrics": {k: v.tolist() for k, v in metrics.items()}}
    return HeadConfig(classes, windows, [[4] * H for _ in classes], metadata={"profiling": prof}), metrics


def test_reselect_at_the_same_target_is_the_profile_and_other_targets_move_the_count():
    plan, metrics = _profiled(0.25)
    same = reselect(plan, 0.25)
    assert same.classes == plan.classes and same.windows == plan.windows
    more, fewer = reselect(plan, 0.5), reselect(plan, 0.1)
    n = lambda p: p.class_counts()["global"]  # noqa: E731
    assert n(fewer) < n(plan) < n(more) and n(more) == 6
    # the heads kept global at a lower ratio are global at the higher one too (one score, one order)
    g = lambda p: {(l, h) for l, row in enumerate(p.classes) for h, c in enumerate(row) if c == "global"}  # noqa
    assert g(fewer) <= g(plan) <= g(more)
    assert more.metadata["profiling"]["parameters"]["target_global"] == 0.5


def test_local_share_counts_heads_whose_coverage_fits_the_window():
    plan, metrics = _profiled()
    share = local_share(plan, windows=(64, 256, 1024))
    cover = metrics["coverage_window"]
    assert share == {64: pytest.approx((cover <= 64).mean()), 256: pytest.approx((cover <= 256).mean()), 1024: 1.0}


def test_a_plan_without_a_profile_says_so():
    with pytest.raises(ValueError, match="no profile metrics"):
        reselect(HeadConfig.all_global(2, 2), 0.5)

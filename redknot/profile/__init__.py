"""Head profiler: per-(layer, KV head) metrics on calibration prompts -> a head plan (HeadConfig)."""

from .calib import CalibrationError, builtin_records, load_calibration
from .profiler import (Sample, attention_stats, coverage_window, make_samples, measure_heads, n_global_target,
                       profile_heads, select_heads, window_error)

__all__ = ["CalibrationError", "Sample", "attention_stats", "builtin_records", "coverage_window",
           "load_calibration", "make_samples", "measure_heads", "n_global_target", "plot_heads", "profile_heads",
           "select_heads", "window_error"]


def plot_heads(*args, **kwargs):
    """See :func:`redknot.profile.plot.plot_heads` (imported lazily: matplotlib is optional)."""
    from .plot import plot_heads as _plot

    return _plot(*args, **kwargs)

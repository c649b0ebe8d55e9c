"""`redknot bench quality-report`: one table and one Pareto plot from several `bench quality` runs.

Each run measures dense and some methods at one head plan (and any ``cacheblend@R`` / ``epic@N``
budgets); budgets of the head-plan methods are separate runs with other ``--head-config`` files.
The report keeps the records every run finished (so each row averages the same records),
labels a head-plan method with its plan and the run's other settings (``redknot_kv [profiled_g25]``,
``redknot_kv [all_global, shallow W 8192]``; ``--label FILE=NAME`` names a run's plan), keeps one row
per label, and writes:

- a markdown table: EM / F1 against gold, F1 ÷ dense, answer EM / F1 against dense's answer,
  their normalised recovery ((method − full_reuse) ÷ (dense − full_reuse); with a full_reuse run), first-token top-1 / top-10 / KL against dense, prefill FLOPs ÷ dense;
- a Pareto PNG (``--plot``, or beside ``--out``): prefill FLOPs ÷ dense against answer F1 vs dense,
  first-token top-1 agreement and KL (``--plot-columns``), one marker per method and setting, the
  non-dominated settings joined (methods without a FLOPs count, headsparse, are left out of it).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from .quality import BASELINE, NEEDS_HEAD_CONFIG, RECOVERED, REFERENCE, _aggregate, split_variant


def _plan_name(result: dict, path: Path, labels: dict[str, str]) -> str:
    """The run's head plan, and the run-wide settings that make its rows another measurement."""
    if str(path) in labels:
        return labels[str(path)]
    hc = result.get("head_config")
    name = Path(hc).stem if hc else path.stem
    args = result.get("args") or {}
    if args.get("sparse_ffn"):
        name += f", {Path(args['sparse_ffn']).stem}"
    if args.get("shallow_window"):
        name += f", shallow W {args['shallow_window']}"
    return name


def merge(paths: list[Path], labels: dict[str, str] | None = None) -> dict:
    """{"n_records", "rows": [{"label", "method", "plan", **summary}], "sources"} over the records all
    runs finished (dense from the first run; a label seen twice is kept from its first run)."""
    labels = labels or {}
    results = []
    for p in paths:
        try:
            raw = Path(p).read_bytes()
            results.append((Path(p), json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)))
        except (OSError, ValueError) as e:
            raise ValueError(f"{p}: not a results JSON ({e})") from e
    common = None
    for p, r in results:
        ids = [e["id"] for e in r["records"]]
        common = ids if common is None else [i for i in common if i in set(ids)]
    if not common:
        raise ValueError("the runs share no finished record")
    keep = set(common)
    rows, seen = [], set()
    for p, r in results:
        plan = _plan_name(r, p, labels)
        for m in r["methods"]:
            if m == REFERENCE and seen:
                continue
            base, knobs = split_variant(m)
            label = f"{m} [{plan}]" if base in NEEDS_HEAD_CONFIG else m
            if label in seen:
                continue
            seen.add(label)
            per = [{**e["predictions"][m], "type": e["type"]} for e in r["records"] if e["id"] in keep]
            rows.append({"label": label, "method": base, "plan": plan if base in NEEDS_HEAD_CONFIG else None,
                         "knobs": knobs, "source": str(p), **_aggregate(per)})
    dense = next(x for x in rows if x["method"] == REFERENCE)
    low = next((x for x in rows if x["label"] == BASELINE), None)
    for x in rows:
        x["f1_ratio"] = x["f1"] / dense["f1"] if dense["f1"] else None
        for key in RECOVERED:  # normalised recovery (quality.add_recovery), over the common records
            gap = None if low is None else dense[key] - low[key]
            x[f"{key}_recovery"] = (x[key] - low[key]) / gap if gap else None
    return {"n_records": len(common), "rows": rows, "sources": [str(p) for p, _ in results],
            "model": results[0][1].get("model"), "data": results[0][1].get("data")}


def markdown(report: dict) -> str:
    def num(x, fmt="{:.3f}"):
        return "–" if x is None else fmt.format(x)

    lines = ["| method | EM | F1 | F1 ÷ dense | answer EM vs dense | answer F1 vs dense | answer F1 recovery | "
             "F1 recovery | top-1 = dense | top-10 overlap | KL(dense‖method) | prefill FLOPs ÷ dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in report["rows"]:
        lines.append(f"| {x['label']} | {num(x['em'])} | {num(x['f1'])} | {num(x['f1_ratio'], '{:.2f}')} | "
                     f"{num(x['answer_em'])} | {num(x['answer_f1'])} | {num(x.get('answer_f1_recovery'), '{:.2f}')} | "
                     f"{num(x.get('f1_recovery'), '{:.2f}')} | {num(x['top1_agreement'])} | "
                     f"{num(x['top10_overlap'])} | {num(x['kl'], '{:.4f}')} | {num(x['flops_fraction'], '{:.2f}')} |")
    return "\n".join(lines)


# Quality columns a Pareto plot may put against FLOPs: column -> (axis label, higher is better).
PLOT_COLUMNS = {"answer_f1": ("answer F1 vs dense's answer", True),
                "top1_agreement": ("first-token top-1 = dense", True),
                "kl": ("KL(dense ‖ method), nats", False),
                "f1_ratio": ("gold F1 ÷ dense", True),
                "answer_f1_recovery": ("answer F1 recovery", True)}
DEFAULT_PLOT_COLUMNS = ("answer_f1", "top1_agreement", "kl")
_MARKERS = "o^sDvP<>Xhp*d"


def pareto_front(rows: list[dict], column: str, higher: bool = True) -> list[dict]:
    """The rows no other row beats on both prefill FLOPs (fewer) and ``column`` (better), by FLOPs."""
    pts = sorted((x for x in rows if x.get(column) is not None and x["flops_fraction"] is not None),
                 key=lambda x: (x["flops_fraction"], -x[column] if higher else x[column]))
    front, best = [], None
    for x in pts:
        q = x[column] if higher else -x[column]
        if best is None or q > best:
            front.append(x)
            best = q
    return front


def plot(report: dict, path: str | Path, title: str | None = None,
         columns: tuple[str, ...] = DEFAULT_PLOT_COLUMNS) -> Path:
    """A Pareto PNG: one panel per quality column against prefill FLOPs ÷ dense, one marker per
    method and setting (colour: the method), the non-dominated settings joined by a line. Rows
    without a FLOPs count (headsparse) are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unknown = [c for c in columns if c not in PLOT_COLUMNS]
    if unknown or not columns:
        raise ValueError(f"plot columns {', '.join(unknown) or '(none)'}: use {', '.join(PLOT_COLUMNS)}")
    rows = [x for x in report["rows"] if x["flops_fraction"] is not None]
    fig, axes = plt.subplots(1, len(columns), figsize=(4.2 * len(columns) + 2.4, 4.0), sharex=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    family = {m: colors[i % len(colors)] for i, m in enumerate(dict.fromkeys(x["method"] for x in rows))}
    marker = {x["label"]: _MARKERS[i % len(_MARKERS)] for i, x in enumerate(rows)}
    for ax, key in zip(axes[0], columns):
        name, higher = PLOT_COLUMNS[key]
        for x in rows:
            if x.get(key) is not None:
                ax.scatter(x["flops_fraction"], x[key], marker=marker[x["label"]], color=family[x["method"]], s=42,
                           label=x["label"], zorder=3)
        front = pareto_front(rows, key, higher)
        ax.plot([x["flops_fraction"] for x in front], [x[key] for x in front], color="grey", lw=0.8, zorder=2)
        if key in ("answer_f1", "top1_agreement"):  # the asks: 0.90 / 0.95 at <= 0.35x FLOPs
            ax.axhline(0.9 if key == "answer_f1" else 0.95, color="grey", lw=0.6, ls="--")
        ax.axvline(0.35, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("prefill FLOPs ÷ dense")
        ax.set_ylabel(name)
        ax.set_xlim(0, 1.05)
        ax.grid(alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    uniq = dict(zip(names, handles))
    fig.legend(uniq.values(), uniq.keys(), fontsize=6, loc="center right")
    fig.suptitle(title or f"{Path(str(report.get('model'))).name}, {report['n_records']} records", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 2.2 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return Path(path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="results JSONs of `redknot bench quality` on the same data (gzipped ones too)")
    p.add_argument("--label", action="append", default=[], metavar="FILE=NAME",
                   help="name of a run's head plan in the labels (default: the head config's file name)")
    p.add_argument("--plot", default=None,
                   help="Pareto PNG to write (default: beside --out, its name with .png; none without --out)")
    p.add_argument("--plot-columns", default=",".join(DEFAULT_PLOT_COLUMNS),
                   help=f"quality columns plotted against FLOPs, one panel each: {', '.join(PLOT_COLUMNS)}")
    p.add_argument("--title", default=None)
    p.add_argument("--out", default=None, help="merged report JSON to write")


def run(args) -> dict:
    labels = {}
    for spec in args.label:
        f, eq, name = spec.partition("=")
        if not eq:
            raise ValueError(f"--label {spec!r}: use FILE=NAME")
        labels[f] = name
    report = merge([Path(p) for p in args.results], labels)
    print(f"{report['n_records']} records common to {len(report['sources'])} run(s)")
    print(markdown(report))
    png = args.plot or (Path(args.out).with_suffix(".png") if args.out else None)
    if png:
        plot(report, png, args.title, tuple(c.strip() for c in args.plot_columns.split(",") if c.strip()))
        print(f"wrote {png}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report

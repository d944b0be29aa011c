"""Plots of ``benchmarks/results/*.json``, drawn from the JSON alone (no GPU, no torch needed).

``python3 -m benchmarks.plots [results_dir]`` writes ``<workload>.png`` beside each JSON file:

- W1: latency against budget, one panel per seq_len, with the bound line;
- W2: fraction of the copy-bandwidth bound achieved, per configuration;
- W3: TFLOP/s per configuration, with the measured GEMM ceiling;
- W4, W5: speedups (no-split / planned; best plain decode / cascade) per configuration;
- W6: ``plan()`` host time against batch size;
- W7: the makespan ratios and the read-amplification model against its expectation;
- W8: host time per call of a tight loop, per configuration;
- W9: a transformers model's time per decode step, per configuration;
- W10: each variant's time over the same implementation's time with no variant, one panel per case;
- W11: fraction of the bound achieved (bytes over the copy bandwidth or FLOPs over the GEMM rate, the larger), per
  configuration.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from benchmarks.records import RESULTS_DIR, config_label, load_results
from benchmarks.report import NO_SPLIT


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend(ax, **kwargs):
    """A legend when something was drawn (a workload whose implementations all failed draws nothing)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def _ok(records):
    return [r for r in records if r["status"] == "ok" and "time_us" in r]


def _impls(records):
    return list(dict.fromkeys(r["impl"] for r in records))


def _configs(records):
    return list(dict.fromkeys(config_label(r["config"]) for r in records))


def _bars(ax, labels, series: dict, ylabel: str):
    """Grouped bars: ``series`` maps a name to ``{label: value}``."""
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(labels))
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, [values.get(lab, np.nan) for lab in labels], width,
               label=name)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)


def plot_w1(payload, fig):
    recs = _ok(payload["records"])
    seq_lens = sorted({r["config"]["seq_len"] for r in recs})
    axes = np.atleast_1d(fig.subplots(1, max(len(seq_lens), 1), sharey=True))
    for ax, seq_len in zip(axes, seq_lens):
        rows = [r for r in recs if r["config"]["seq_len"] == seq_len]
        for impl in _impls(rows):
            mine = [r for r in rows if r["impl"] == impl]
            pts = sorted((r["config"]["budget"], r["time_us"]) for r in mine)
            modes = {r.get("time_mode") for r in mine} - {"graph"}  # the numba tier: no graph capture
            ax.plot(*zip(*pts), marker="o", label=f"{impl} ({', '.join(sorted(modes))})" if modes else impl)
        bounds = sorted({(r["config"]["budget"], r["bound_us"]) for r in rows if "bound_us" in r})
        if bounds:
            ax.plot(*zip(*bounds), "k--", label="bound (bytes / copy bw)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"seq_len {seq_len}")
        ax.set_xlabel("budget (pages)")
    axes[0].set_ylabel("µs (graph mode unless marked queued or eager)")
    _legend(axes[-1], fontsize=7)


def _fractions(payload, fig, ylabel: str):
    """Bars of each implementation's bound / time, per configuration."""
    recs = [r for r in _ok(payload["records"]) if "fraction" in r]
    labels = _configs(recs)
    series = {impl: {config_label(r["config"]): r["fraction"] for r in recs if r["impl"] == impl}
              for impl in _impls(recs)}
    ax = fig.subplots()
    _bars(ax, labels, series, ylabel)
    ax.axhline(1.0, color="k", ls="--", lw=1)
    _legend(ax, fontsize=7, ncol=2)


def plot_w2(payload, fig):
    _fractions(payload, fig, "bound / time (fraction of copy bandwidth)")


def plot_w3(payload, fig):
    recs = [r for r in _ok(payload["records"]) if "tflop_per_s" in r]
    labels = _configs(recs)
    series = {impl: {config_label(r["config"]): r["tflop_per_s"] for r in recs if r["impl"] == impl}
              for impl in _impls(recs)}
    ax = fig.subplots()
    _bars(ax, labels, series, "TFLOP/s (causal FLOPs counted once)")
    if payload.get("ceilings"):
        ax.axhline(payload["ceilings"]["gemm_flops_per_s"] / 1e12, color="k", ls="--", lw=1, label="bf16 GEMM")
    _legend(ax, fontsize=7, ncol=2)


def _speedup_series(records, pairs):
    """``{name: {config: num.time / den.time}}`` for ``(name, numerator impls, denominator impls)``."""
    by_config = {}
    for r in _ok(records):
        by_config.setdefault(config_label(r["config"]), {})[r["impl"]] = r["time_us"]
    series = {}
    for name, num, den in pairs:
        values = {}
        for config, times in by_config.items():
            n = [times[i] for i in times if num(i)]
            d = [times[i] for i in times if den(i)]
            if n and d:
                values[config] = min(n) / min(d)
        if values:
            series[name] = values
    return list(by_config), series


def plot_w4(payload, fig):
    impls = _impls(payload["records"])
    pairs = [(base, (lambda i, u=unsplit: i == u), (lambda i, b=base: i == b))
             for unsplit in impls if unsplit.endswith(NO_SPLIT) for base in [unsplit[: -len(NO_SPLIT)]]]
    labels, series = _speedup_series(payload["records"], pairs)
    ax = fig.subplots()
    _bars(ax, labels, series, "no-split time / planned time")
    ax.axhline(1.0, color="k", ls="--", lw=1)
    _legend(ax, fontsize=7, ncol=2)


def plot_w5(payload, fig):
    pairs = [(lib, (lambda i, p=lib: i.startswith(p) and "plain" in i),
              (lambda i, p=lib: i.startswith(p) and "cascade" in i)) for lib in ("bsrattn", "flashinfer")]
    labels, series = _speedup_series(payload["records"], pairs)
    ax = fig.subplots()
    _bars(ax, labels, series, "best plain decode / best cascade")
    ax.axhline(1.0, color="k", ls="--", lw=1)
    _legend(ax, fontsize=7, ncol=2)


def plot_w6(payload, fig):
    recs = _ok(payload["records"])
    ax = fig.subplots()
    for impl in _impls(recs):
        pts = sorted((r["config"]["batch"], r["time_us"]) for r in recs if r["impl"] == impl)
        ax.plot(*zip(*pts), marker="o", label=impl)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("host µs per plan() (incl. copies to the GPU)")
    _legend(ax, fontsize=7)


def plot_w7(payload, fig):
    recs = [r for r in payload["records"] if r["status"] == "ok"]
    left, right = fig.subplots(1, 2)
    makespan = [r for r in recs if r["config"]["table"] == "makespan"]
    dists = list(dict.fromkeys(r["config"]["distribution"] for r in makespan))
    batches = sorted({r["config"]["batch"] for r in makespan})
    width = 0.8 / max(len(batches), 1)
    for i, batch in enumerate(batches):
        rows = {r["config"]["distribution"]: r for r in makespan if r["config"]["batch"] == batch}
        med = np.array([rows[d]["median"] if d in rows else np.nan for d in dists])
        lo = np.array([rows[d]["min"] if d in rows else np.nan for d in dists])
        hi = np.array([rows[d]["max"] if d in rows else np.nan for d in dists])
        x = np.arange(len(dists)) + (i - (len(batches) - 1) / 2) * width
        left.bar(x, med, width, yerr=[med - lo, hi - med], capsize=3, label=f"batch {batch}")
    left.set_xticks(np.arange(len(dists)), dists, rotation=20, ha="right", fontsize=8)
    left.set_ylabel("round-robin / planned makespan")
    left.axhline(1.0, color="k", ls="--", lw=1)
    _legend(left, fontsize=7)
    amp = [r for r in recs if r["config"]["table"] == "read_amplification"]
    if amp:
        seq_len = max(r["config"]["seq_len"] for r in amp)
        for budget in sorted({r["config"]["budget"] for r in amp if r["config"]["seq_len"] == seq_len}):
            rows = sorted((r["config"]["kernel_block_size"], r["ratio"], r["expected_ratio"]) for r in amp
                          if r["config"]["seq_len"] == seq_len and r["config"]["budget"] == budget)
            blocks, ratio, expected = zip(*rows)
            line = right.plot(blocks, ratio, "o", label=f"budget {budget}")[0]
            right.plot(blocks, expected, "--", color=line.get_color())
        right.set_xscale("log", base=2)
        right.set_xlabel("kernel block size (tokens)")
        right.set_ylabel("slots read / slots needed")
        right.set_title(f"Quest, seq_len {seq_len} (dashed: expectation)", fontsize=9)
        _legend(right, fontsize=7)


def plot_w8(payload, fig):
    recs = _ok(payload["records"])
    labels = _configs(recs)
    series = {impl: {config_label(r["config"]): r["time_us"] for r in recs if r["impl"] == impl}
              for impl in _impls(recs)}
    ax = fig.subplots()
    _bars(ax, labels, series, "host µs per call (tight loop)")
    ax.set_yscale("log")
    _legend(ax, fontsize=7, ncol=2)


def plot_w9(payload, fig):
    recs = [r for r in _ok(payload["records"]) if "new_tokens" not in r["config"]]  # the decode steps
    labels = _configs(recs)
    series = {impl: {config_label(r["config"]): r["time_us"] / 1e3 for r in recs if r["impl"] == impl}
              for impl in _impls(recs)}
    ax = fig.subplots()
    _bars(ax, labels, series, "ms per decode step")
    _legend(ax, fontsize=7)


def plot_w10(payload, fig):
    recs = _ok(payload["records"])
    cases = list(dict.fromkeys(r["config"]["case"] for r in payload["records"]))
    axes = np.atleast_1d(fig.subplots(1, max(len(cases), 1)))
    for ax, case in zip(axes, cases):
        rows = [r for r in recs if r["config"]["case"] == case]
        variants = list(dict.fromkeys(r["config"]["variant"] for r in payload["records"]
                                      if r["config"]["case"] == case and r["config"]["variant"] != "none"))
        series = {}
        for impl in _impls(rows):
            times = {r["config"]["variant"]: r["time_us"] for r in rows if r["impl"] == impl}
            if "none" in times:
                series[f"{impl} (none: {times['none']:.1f} µs)"] = {v: t / times["none"] for v, t in times.items()}
        _bars(ax, variants, series, "time / time with no variant (same implementation)")
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.margins(y=0.3)  # room for the legend above the bars
        ax.set_title(case)
        _legend(ax, fontsize=7)


def plot_w11(payload, fig):
    _fractions(payload, fig, "bound / time (bytes / copy bw or FLOPs / GEMM rate, the larger)")


PLOTS = {"w1_quest_decode": plot_w1, "w2_paged_decode": plot_w2, "w3_prefill": plot_w3, "w4_split_kv": plot_w4,
         "w5_cascade": plot_w5, "w6_plan_host": plot_w6, "w7_cpu_models": plot_w7, "w8_run_host": plot_w8,
         "w9_transformers": plot_w9, "w10_variants": plot_w10, "w11_mla_decode": plot_w11}


def draw(payload, path: Path, dpi: int = 90) -> Path:
    """Draw one workload's figure from its JSON payload into ``path``."""
    plt = _pyplot()
    fig = plt.figure(figsize=(12, 4.5))
    PLOTS[payload["workload"]](payload, fig)
    fig.suptitle(payload["title"] + (" (quick run)" if payload.get("quick") else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def draw_all(results_dir=RESULTS_DIR, dpi: int = 90) -> list:
    """A PNG beside every known workload's JSON in ``results_dir``; returns their paths."""
    results_dir = Path(results_dir)
    return [draw(payload, results_dir / f"{name}.png", dpi) for name, payload in load_results(results_dir).items()
            if name in PLOTS]


if __name__ == "__main__":
    for p in draw_all(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS_DIR):
        print(p)

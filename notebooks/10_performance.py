# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10. Performance: the H200 results, viewed anywhere
#
# The benchmark suite (`benchmarks/`) runs eleven workloads on an NVIDIA H200 — the site's *Benchmark results* page
# lists them with their targets — and writes one JSON file per workload under `benchmarks/results/`, with the
# environment it ran in and every figure. This notebook reads those files — it needs no GPU — and draws them with
# the suite's own plotting code.
#
# The method, the same for every figure: each implementation is **checked against the float64 reference** on the
# same inputs before it is timed (outputs poisoned with NaN first, so an unwritten element fails); L2 is flushed
# before every sample; times are CUDA-event medians of at least 100 samples, in **graph** mode (the call captured
# in a CUDA graph and replayed: GPU time) and **eager** mode (called from Python: what a user sees); and each is
# printed beside its **physical bound** — the bytes the work needs over the measured copy bandwidth, or its FLOPs
# over the measured matmul rate. Baselines (PyTorch SDPA, FlexAttention, FlashInfer) run in the same process on
# the same data.
#
# To reproduce on a GPU: `python3 -m benchmarks.run_all` (or `--quick`, or `--only w1,w3`).

# %%
import importlib.util
import os
import shutil
import sys
from pathlib import Path

# Without a GPU, the numba tier runs in Numba's CUDA simulator and the torch tier in Triton's interpreter.
# Both read these variables when they are first imported, so they are set before anything imports them.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

# The repository: the folder above this one (the notebook runs in notebooks/) or this one.
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "benchmarks" / "harness.py").is_file()), None)
if ROOT is None:
    raise FileNotFoundError(f"no benchmarks/ above {Path.cwd()}: run this notebook inside the repository")
# benchmarks/ is a folder of the repository, not an installed package: it is imported from there, by its path.
spec = importlib.util.spec_from_file_location("benchmarks", ROOT / "benchmarks" / "__init__.py")
sys.modules["benchmarks"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules["benchmarks"])
from benchmarks import harness, plots, report  # noqa: E402

# %% [markdown]
# ## The results on disk
#
# Dry runs (the suite's plumbing exercised on a CPU, with nothing timed) are left out: what remains was measured.

# %%
results_dir = ROOT / "benchmarks" / "results"
results = {}
if results_dir.is_dir():
    results = {name: payload for name, payload in harness.load_results(results_dir).items()
               if not payload.get("dry_run")}
if results:
    for name, payload in results.items():
        print(f"{name}: {len(payload['records'])} records, measured {payload['environment'].get('time_utc', '')}")
else:
    print(f"No benchmark results in {results_dir.relative_to(ROOT)} yet. They are measured on the H200 with "
          "`python3 -m benchmarks.run_all` and committed; until then this notebook has nothing measured to show, "
          "and it shows nothing rather than invent it. The CPU-only workload below runs here.")
gpu_results = {name: payload for name, payload in results.items() if payload.get("ceilings")}

# %% [markdown]
# ## The pictures
#
# One figure per workload measured on a GPU: latency against the Quest budget with the bound (W1), the fraction
# of copy bandwidth (W2), TFLOP/s (W3), speedups of split-KV and of the cascade (W4, W5), `plan()`'s host
# time (W6), the host time of one call in a tight loop (W8), a transformers model's decode step (W9), what
# each attention variant costs (W10), and the fraction of its bound MLA decode reaches (W11). The cell draws only
# what exists. Times are graph-mode (a replayed CUDA graph: GPU time) except
# where an implementation could not be captured: the numba tier's launches are Numba's, outside torch's graphs,
# so it is timed *queued*: each call made from Python behind a spin kernel long enough to hide its launch
# overhead, so the figure is its GPU time, as a graph's is (its eager time, launch overhead included, is in the
# records too). Curves timed another way than graph mode say so.

# %% tags=["needs-results"]
def mark_modes(fig, payload):
    """Label the curves of implementations timed other than in graph mode with their mode."""
    modes = {r["impl"]: r["time_mode"] for r in payload["records"]
             if r["status"] == "ok" and r.get("time_mode") in ("eager", "queued")}
    for ax in fig.axes:
        lines = [line for line in ax.get_lines() if line.get_label() in modes]
        for line in lines:
            line.set_label(f"{line.get_label()} ({modes[line.get_label()]})")
        if lines and "graph mode" in ax.get_ylabel() and "marked" not in ax.get_ylabel():
            ax.set_ylabel(ax.get_ylabel().replace("graph mode", "graph mode unless marked"))
        legend = ax.get_legend()
        if lines and legend is not None:
            ax.legend(fontsize=legend.get_texts()[0].get_fontsize())


for name, payload in gpu_results.items():
    if name not in plots.PLOTS:
        continue
    fig = plt.figure(figsize=(12, 4))
    plots.PLOTS[name](payload, fig)
    mark_modes(fig, payload)
    fig.suptitle(payload["title"] + (" (quick run)" if payload.get("quick") else ""), fontsize=10)
    fig.tight_layout()
    plt.show()
if not gpu_results:
    print("No GPU results to draw yet.")

# %% [markdown]
# ## The reference first
#
# A figure exists only for an implementation that matched the float64 reference. Records that did not run say
# why: `unavailable` (a missing library, a shape an API refuses), `incorrect` (failed the check: never timed),
# `error`, or `skipped` (the run's time budget ran out).

# %%
for name, payload in results.items():
    counts = {}
    for record in payload["records"]:
        counts[record["status"]] = counts.get(record["status"], 0) + 1
    print(f"{name:>16}: " + ", ".join(f"{count} {status}" for status, count in sorted(counts.items())))
if not results:
    print("Nothing measured yet.")

# %% [markdown]
# ## The tables
#
# The suite's own report, one table per workload: times in µs (graph mode, eager where marked `e`), the fraction
# of the physical bound in brackets. On workload 1 the numba and torch tiers appear side by side, so their
# achieved bandwidths can be compared. The torch tier's tile and schedule sweep (`tune.json`, written by
# `python3 -m benchmarks.tune`) is the tuner's record, not a workload, so it is left out here: the site's
# *Benchmark results* page links it, and `benchmarks/NOTES.md` says what was chosen from it.

# %%
for name, payload in results.items():
    if name not in report.ORDER:  # the tuning sweep
        continue
    # This notebook draws every figure from the records itself; the report's link to each committed PNG is
    # relative to benchmarks/results/, where neither the notebook nor its page on the site lies.
    display(Markdown("\n".join(line for line in report.section(payload, results_dir) if not line.startswith("!["))))
if not results:
    print("No tables yet.")

# %% [markdown]
# ## What it costs, modelled on this CPU
#
# Workload 7 needs no GPU: the scheduler's makespan simulation on 132 CTAs (the mechanism workload 4 measures)
# and the read-amplification model of workload 1's Quest pattern (why a kernel with 128-slot blocks reads several
# times the selected bytes). Here it runs in a small form — 10 trials, two sequence lengths — with the suite's
# own helpers, and is tabulated and drawn with the suite's own report and plot.

# %%
import numpy as np

import bsrattn as ba
from benchmarks import w7_cpu_models as w7

records = []
for distribution in ba.scheduler.DISTRIBUTIONS:
    for batch in w7.BATCHES:
        sim = ba.scheduler.simulate(distribution, batch, num_ctas=w7.NUM_CTAS, trials=10)
        records.append({"config": {"table": "makespan", "distribution": distribution, "batch": batch,
                                   "num_ctas": w7.NUM_CTAS, "trials": 10},
                        "impl": "plan vs round_robin", "status": "ok", "median": sim.median, "min": sim.min,
                        "max": sim.max})
rng = np.random.default_rng(0)
for seq_len in (4096, 32768):
    for budget in (b for b in w7.BUDGETS if b <= seq_len // w7.PAGE):
        layout = w7.quest_layout(rng, seq_len, budget)
        for block in w7.KERNEL_BLOCKS:
            amp = layout.read_amplification(block)
            records.append({"config": {"table": "read_amplification", "seq_len": seq_len, "budget": budget,
                                       "kernel_block_size": block, "heads": w7.HEADS},
                            "impl": f"block {block}", "status": "ok", "ratio": amp.ratio,
                            "expected_ratio": w7.expected_ratio(seq_len // w7.PAGE, budget, w7.PAGE, block)})
model = {"workload": w7.WORKLOAD, "title": w7.TITLE, "records": records}
display(Markdown("\n".join(report.table_w7(model))))

# %%
fig = plt.figure(figsize=(12, 4))
plots.plot_w7(model, fig)
fig.suptitle(model["title"] + " (small form, on this CPU)", fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Exercises
#
# The exercise of the course that goes with this notebook; `python -m bsrattn.exercises start` copies the stubs into a
# folder of your own (`./bsrattn-exercises`), and `python -m bsrattn.exercises list` names the whole course:
#
# - Exercise 17, **read-amplification** (`python -m bsrattn.exercises check 17`): Read amplification: the KV slots a
#   kernel of fixed block size reads to serve a layout, against those needed.

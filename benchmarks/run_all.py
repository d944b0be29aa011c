"""Run the benchmark suite with one command, then draw the plots and write the summary.

    python3 -m benchmarks.run_all --quick              # every workload, few configurations (~18 minutes on the H200)
    python3 -m benchmarks.run_all --only w1,w3          # selected workloads, full configurations
    python3 -m benchmarks.run_all --only w7             # the CPU-only workload, anywhere

Each workload runs in its own process (a CUDA error in one cannot poison the next), with a time budget after
which it starts no new configuration and a hard timeout after that; its JSON is rewritten after every
configuration, so what was measured survives either. Where FlashInfer is importable, its JIT modules are built
in a background process from the start (``baselines.py prebuild``), so the builds overlap the first workloads.
Then ``plots.py`` draws ``results/<workload>.png`` and ``report.py`` writes ``results/README.md``, from the JSON
alone. GPU workloads are skipped, with a message, on a machine without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import harness, plots, records, report

ROOT = Path(__file__).resolve().parents[1]  # where ``python -m benchmarks.<script>`` finds the package
WORKLOADS = {"w1": "w1_quest_decode", "w2": "w2_paged_decode", "w3": "w3_prefill", "w4": "w4_split_kv",
             "w5": "w5_cascade", "w6": "w6_plan_host", "w7": "w7_cpu_models", "w8": "w8_run_host",
             "w9": "w9_transformers", "w10": "w10_variants", "w11": "w11_mla_decode"}
CPU_ONLY = {"w7"}
QUICK_BUDGET_S = {"w1": 110, "w2": 95, "w3": 75, "w4": 35, "w5": 45, "w6": 25, "w7": 15, "w8": 25, "w9": 60,
                  "w10": 240, "w11": 240}
"""Shares of a --quick run, in seconds (965 together). Workload i may start configurations until the sum of the
shares up to and including its own has passed since the suite began: time one workload leaves unused goes to the
next, an overrun comes out of the next. W10's share is large: each of its variants is a kernel of its own for
every library, compiled the first time it runs; W11's too: its first calls compile the MLA kernels (the torch
tier's, 576 / 512 wide, and FlashInfer's fa2 and fa3 modules, built in the background from the start)."""
GRACE_S = 90
"""A workload still running this long after its deadline is killed (its JSON keeps what it had measured), so a
--quick run ends within the total + GRACE_S + plotting: about 18 minutes with every workload."""


def _has_gpu() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _start_prebuild(quick: bool, workloads, log):
    """FlashInfer's JIT builds in a separate process, fewer compile jobs than cores (the suite needs some)."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    env = dict(os.environ)
    env.setdefault("MAX_JOBS", str(max(1, (os.cpu_count() or 2) - 6)))
    cmd = [sys.executable, "-m", "benchmarks.baselines", "prebuild", "--workloads", ",".join(workloads)]
    cmd += ["--quick"] if quick else []
    # Its own process group, so the compilers it spawns end with it.
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


def _deadlines(selected, quick: bool, total, start: float):
    """Wall-clock deadline per workload: the cumulative --quick shares, scaled to ``total`` when given; None
    (no deadline) for a full run without ``total``."""
    if not quick and total is None:
        return {w: None for w in selected}
    shares = {w: QUICK_BUDGET_S[w] for w in selected}
    scale = total / sum(shares.values()) if total else 1.0
    ends = np.cumsum([shares[w] * scale for w in selected])
    return {w: start + float(end) for w, end in zip(selected, ends)}


def run_workload(key, *, quick, deadline, results, passthrough) -> dict:
    """Run one workload script in its own process; returns ``{workload, returncode, seconds}``."""
    cmd = [sys.executable, "-m", f"benchmarks.{WORKLOADS[key]}", "--results", str(Path(results).resolve())]
    cmd += passthrough
    if quick:
        cmd.append("--quick")
    timeout = None
    if deadline is not None:
        # Even past its deadline a workload starts its first configuration, so each one reports something.
        budget = max(deadline - time.time(), 1.0)
        cmd += ["--time-budget", f"{budget:.0f}"]
        timeout = budget + GRACE_S
    t0 = time.time()
    try:
        rc = subprocess.run(cmd, timeout=timeout, cwd=ROOT).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    return {"workload": WORKLOADS[key], "returncode": rc, "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few configurations per workload (fits a short GPU lease)")
    p.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads, e.g. w1,w3 (default all)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for all selected workloads together, split in the --quick proportions "
                        "(default for --quick: the sum of their shares; none for a full run)")
    p.add_argument("--results", type=Path, default=records.RESULTS_DIR)
    p.add_argument("--samples", type=int, default=None, help="timed samples per mode (default 300, quick 100)")
    p.add_argument("--impls", default=None, help="comma-separated glob patterns of implementations to run")
    p.add_argument("--no-prebuild", action="store_true", help="do not build FlashInfer's modules ahead")
    p.add_argument("--no-plots", action="store_true", help="skip the plots (the summary is still written)")
    args = p.parse_args(argv)
    selected = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in selected if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    gpu_needed = [w for w in selected if w not in CPU_ONLY]
    has_gpu = bool(gpu_needed) and _has_gpu()
    if gpu_needed and not has_gpu:
        print(f"no CUDA GPU here: skipping {', '.join(gpu_needed)}", file=sys.stderr)
        selected = [w for w in selected if w in CPU_ONLY]
    passthrough = []
    if args.samples:
        passthrough += ["--samples", str(args.samples)]
    if args.impls:
        passthrough += ["--impls", args.impls]
    deadlines = _deadlines(selected, args.quick, args.time_budget, time.time())
    log = tempfile.NamedTemporaryFile("w+", prefix="flashinfer_prebuild_", suffix=".log", delete=False)
    prebuild = None if args.no_prebuild or not has_gpu else _start_prebuild(args.quick, gpu_needed, log)
    outcomes = []
    bar = harness.Progress(len(selected), "suite")
    try:
        for key in selected:
            bar.note(WORKLOADS[key])
            outcomes.append(run_workload(key, quick=args.quick, deadline=deadlines[key], results=args.results,
                                         passthrough=passthrough))
            bar.update(f"{WORKLOADS[key]} {outcomes[-1]['seconds']:.0f} s")
    finally:
        bar.close()
        if prebuild is not None and prebuild.poll() is None:
            os.killpg(prebuild.pid, signal.SIGTERM)
            prebuild.wait(timeout=30)
    log.seek(0)
    prebuild_log = log.read().strip()
    log.close()
    os.unlink(log.name)
    if prebuild_log:
        print("FlashInfer prebuild:\n" + prebuild_log)
    drawn = []
    if not args.no_plots:
        try:
            drawn = plots.draw_all(args.results)
        except Exception as exc:  # the JSON is what matters; figures can be redrawn anywhere from it
            print(f"plots failed ({type(exc).__name__}: {exc}); redraw with python3 -m benchmarks.plots",
                  file=sys.stderr)
    summary = report.write_summary(args.results)
    for o in outcomes:
        print(f"{o['workload']:18} rc={o['returncode']!s:8} {o['seconds']:7.1f} s")
    print(f"plots: {', '.join(p.name for p in drawn) or 'none'}; summary: {summary}")
    return 0 if all(o["returncode"] == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

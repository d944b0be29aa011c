"""The results: one JSON file per workload under ``benchmarks/results/``, read back and summarised.

:func:`write_json` never leaves half a file; :func:`load_results` reads every workload's file; :func:`config_label`
and :func:`summary_table` are how a record is named and printed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def _jsonable(x):
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def write_json(path: Path, payload: dict) -> Path:
    """Write ``payload`` to ``path`` through a temporary file, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=_jsonable, allow_nan=True) + "\n")
    tmp.replace(path)
    return path


def load_results(results_dir=RESULTS_DIR) -> dict:
    """``{workload: payload}`` for every ``*.json`` in ``results_dir``."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))}


def config_label(config: dict) -> str:
    """A short text for a configuration: ``"seq_len=4096 budget=64"``."""
    return " ".join(f"{k}={v}" for k, v in config.items())


def _cell(x) -> str:
    return f"{x:9.1f}" if isinstance(x, (int, float)) else f"{'-':>9}"


def summary_table(records) -> str:
    """A plain text table of records, printed at the end of each script."""
    lines = [f"{'config':46} {'impl':26} {'graph µs':>9} {'eager µs':>9} {'host µs':>9} {'bound µs':>9} {'frac':>6}"
             f"  status"]
    for r in records:
        g, e, h = (r[key].get("median_us") if isinstance(r.get(key), dict) else None
                   for key in ("graph", "eager", "host"))
        frac = f"{r['fraction']:6.2f}" if "fraction" in r else f"{'-':>6}"
        status = r["status"] + (f": {r['reason'][:60]}" if r.get("reason") else "")
        lines.append(f"{config_label(r['config'])[:46]:46} {r['impl'][:26]:26} {_cell(g)} {_cell(e)} {_cell(h)} "
                     f"{_cell(r.get('bound_us'))} {frac}  {status}")
    return "\n".join(lines)

"""The markdown summary of ``benchmarks/results/``: one table per workload, each with the command that reproduces it.

Built from the JSON files alone (no GPU needed): ``python3 -m benchmarks.report [results_dir]`` writes
``<results_dir>/README.md``. Times are graph-mode medians in µs where the call could be captured, else the GPU
time of calls queued behind a spin (marked ``q``), or eager (marked ``e``); a cell that did not produce a time
says why in the notes under its table.
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.records import RESULTS_DIR, config_label, load_results

ORDER = ("w1_quest_decode", "w2_paged_decode", "w3_prefill", "w4_split_kv", "w5_cascade", "w6_plan_host",
         "w7_cpu_models", "w8_run_host", "w9_transformers", "w10_variants", "w11_mla_decode")
NO_SPLIT = "-no-split"
DETERMINISTIC = "-deterministic"
STATUS_MARK = {"unavailable": "n/a", "error": "error", "incorrect": "WRONG", "skipped": "skipped"}


def _mark(rec) -> str:
    """`` e`` for a time taken eagerly (from Python), `` q`` for GPU time queued behind a spin (a call no graph
    captures), nothing for graph-mode or host times."""
    return {"graph": "", "host": "", "queued": " q"}.get(rec.get("time_mode"), " e")


def _time(rec) -> str:
    return f"{rec['time_us']:.1f}{_mark(rec)}"


def _ok(rec) -> bool:
    return rec["status"] == "ok" and "time_us" in rec


class Table:
    """Records pivoted to rows (configurations, in first-seen order) x columns (implementations)."""

    def __init__(self, records, row_of=config_label):
        self.rows: dict = {}
        self.columns: list = []
        self.notes: dict = {}
        self.skipped: dict = {}
        for rec in records:
            row = row_of(rec["config"])
            self.rows.setdefault(row, {})
            if rec["impl"] == "*":  # a configuration the time budget left out
                self.skipped[row] = rec.get("reason", "")
                continue
            if rec["impl"] not in self.columns:
                self.columns.append(rec["impl"])
            self.rows[row][rec["impl"]] = rec
            if rec["status"] != "ok":
                self.notes.setdefault(f"{rec['impl']} ({rec['status']}): {rec.get('reason', '')}", row)

    def cell(self, row, impl, fmt=_time) -> str:
        rec = self.rows[row].get(impl)
        if rec is None:
            return "skipped" if row in self.skipped else "—"
        if rec["status"] == "ok":
            return fmt(rec) if "time_us" in rec else "ok"
        return STATUS_MARK.get(rec["status"], rec["status"])

    def first(self, row, key):
        """``key`` of the first record of ``row`` that has it (bounds are the same for every implementation)."""
        for rec in self.rows[row].values():
            if rec.get(key) is not None:
                return rec[key]
        return None


def markdown(header, lines) -> list:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(x) + " |" for x in lines]


def _notes(table: Table) -> list:
    if not table.notes:
        return []
    out = ["", "Notes (first configuration where each happened):", ""]
    out += [f"- {text[:300]} (at {row})" for text, row in table.notes.items()]
    return out


def _bound(table, row) -> str:
    b = table.first(row, "bound_us")
    return f"{b:.1f}" if b is not None else "—"


def _fraction(rec) -> str:
    return f"{_time(rec)} ({rec['fraction']:.2f})" if "fraction" in rec else _time(rec)


def _speedup(num, den) -> str:
    if num is None or den is None or not (_ok(num) and _ok(den)):
        return "—"
    return f"{num['time_us'] / den['time_us']:.2f}x"


def _best(recs):
    recs = [r for r in recs if r is not None and _ok(r)]
    return min(recs, key=lambda r: r["time_us"]) if recs else None


def table_timed(payload, extra=None) -> list:
    """Bound, then every implementation's time (fraction of the bound in brackets), plus ``extra`` columns."""
    table = Table(payload["records"])
    extra = extra or []
    header = ["configuration", "bound µs"] + table.columns + [name for name, _ in extra]
    lines = [[row, _bound(table, row)] + [table.cell(row, c, _fraction) for c in table.columns]
             + [fn(table, row) for _, fn in extra] for row in table.rows]
    return markdown(header, lines) + _notes(table)


def _vs_flashinfer(table, row) -> str:
    ours = table.rows[row].get("bsrattn-torch")
    best = _best([table.rows[row].get(c) for c in table.columns if c.startswith("flashinfer")])
    return _speedup(best, ours)


def _tbps(table, row) -> str:
    rec = table.rows[row].get("bsrattn-torch")
    return f"{rec['tb_per_s']:.2f}" if rec is not None and _ok(rec) and "tb_per_s" in rec else "—"


def _torch_tflops(table, row) -> str:
    rec = table.rows[row].get("bsrattn-torch")
    return f"{rec['tflop_per_s']:.0f}" if rec is not None and _ok(rec) and "tflop_per_s" in rec else "—"


def _tflops(rec) -> str:
    return (f"{rec['time_us']:.0f}{_mark(rec)} µs, {rec['tflop_per_s']:.0f} TF/s" if "tflop_per_s" in rec
            else _time(rec))


def table_w3(payload) -> list:
    table = Table(payload["records"])
    header = ["configuration", "bound µs"] + table.columns
    lines = [[row, _bound(table, row)] + [table.cell(row, c, _tflops) for c in table.columns] for row in table.rows]
    return markdown(header, lines) + _notes(table)


def table_w4(payload) -> list:
    table = Table(payload["records"])
    pairs = [(c[: -len(NO_SPLIT)], c) for c in table.columns if c.endswith(NO_SPLIT)]
    costs = [(c[: -len(DETERMINISTIC)], c) for c in table.columns if c.endswith(DETERMINISTIC)]
    others = [c for c in table.columns if all(c not in p for p in pairs + costs)]
    header = ["configuration"]
    for planned, unsplit in pairs:
        header += [f"{planned} µs", f"{unsplit} µs", "speedup"]
    for _, deterministic in costs:
        header += [f"{deterministic} µs", "deterministic / planned"]
    header += [f"{c} µs" for c in others]
    lines = []
    for row, recs in table.rows.items():
        line = [row]
        for planned, unsplit in pairs:
            line += [table.cell(row, planned), table.cell(row, unsplit), _speedup(recs.get(unsplit), recs.get(planned))]
        for planned, deterministic in costs:
            line += [table.cell(row, deterministic), _speedup(recs.get(deterministic), recs.get(planned))]
        lines.append(line + [table.cell(row, c) for c in others])
    return markdown(header, lines) + _notes(table)


def table_w5(payload) -> list:
    def library_speedup(prefix):
        def fn(tab, row):
            recs = tab.rows[row]
            cascade = _best([r for name, r in recs.items() if name.startswith(prefix) and "cascade" in name])
            plain = _best([r for name, r in recs.items() if name.startswith(prefix) and "plain" in name])
            return _speedup(plain, cascade)
        return fn

    def vs_flashinfer(tab, row):
        recs = tab.rows[row]
        ours = _best([r for name, r in recs.items() if name.startswith("bsrattn") and "cascade" in name])
        theirs = _best([r for name, r in recs.items() if name.startswith("flashinfer") and "cascade" in name])
        return _speedup(theirs, ours)

    return table_timed(payload, [("bsrattn plain/cascade", library_speedup("bsrattn")),
                                 ("FlashInfer plain/cascade", library_speedup("flashinfer")),
                                 ("FlashInfer cascade / bsrattn cascade", vs_flashinfer)])


def table_w6(payload) -> list:
    table = Table(payload["records"])
    header = ["configuration"] + [f"{c} µs" for c in table.columns]
    lines = [[row] + [table.cell(row, c) for c in table.columns] for row in table.rows]
    return markdown(header, lines) + _notes(table)


def table_w8(payload) -> list:
    """Host µs per call of a tight loop, and in brackets one isolated eager call's µs (host + GPU)."""
    table = Table(payload["records"])

    def host_and_eager(rec) -> str:
        eager = rec.get("eager", {}).get("median_us")
        return f"{rec['time_us']:.1f}" + (f" ({eager:.1f})" if eager is not None else "")

    header = ["configuration"] + table.columns
    lines = [[row] + [table.cell(row, c, host_and_eager) for c in table.columns] for row in table.rows]
    return (["Host µs per call in a tight loop (in brackets: one eager call after a flush, host + GPU, µs):", ""]
            + markdown(header, lines) + _notes(table))


def table_w9(payload) -> list:
    """Milliseconds per decode step (one token for every request of the batch), the best transformers row's over
    the best bsrattn row's, then the throughput runs' tokens per second."""
    steps = [r for r in payload["records"] if "new_tokens" not in r["config"]]
    table = Table(steps)

    def ms(rec) -> str:
        text = f"{rec['time_us'] / 1e3:.2f}"
        return text if rec.get("tokens_as_sdpa") is None else f"{text} ({rec['tokens_as_sdpa']:.2f})"

    def best_over_best(row):
        recs = table.rows[row]
        ours = _best(r for name, r in recs.items() if name.startswith("bsrattn"))
        return _speedup(_best(r for name, r in recs.items() if not name.startswith("bsrattn")), ours)

    header = ["configuration"] + [f"{c} ms" for c in table.columns] + ["best transformers / best bsrattn"]
    lines = [[row] + [table.cell(row, c, ms) for c in table.columns] + [best_over_best(row)] for row in table.rows]
    out = (["Host ms per decode step of the whole model (a token for each request), synchronized; in brackets the "
            "mean fraction of a request's new tokens before its first unlike SDPA's `generate`:", ""]
           + markdown(header, lines) + _notes(table))
    runs = Table([r for r in payload["records"] if "new_tokens" in r["config"]])
    if runs.rows:
        lines = [[row] + [runs.cell(row, c, lambda r: f"{r['tokens_per_s']:.0f}") for c in runs.columns]
                 for row in runs.rows]
        out += ["", "Tokens per second of a whole greedy run, prefill included:", ""]
        out += markdown(["configuration"] + [f"{c} tok/s" for c in runs.columns], lines) + _notes(runs)
    return out


def table_w10(payload) -> list:
    """Per case, each variant's time and in brackets its change over the same implementation's ``none`` row, then
    FlashInfer's best over bsrattn's."""
    out = ["Per case: µs per call, in brackets the change over the same implementation's `none` row (the call "
           "with no variant); `—`: that implementation is not given the variant (`w10_variants.py` says which "
           "FlashInfer has, and why not the others):", ""]
    for case in dict.fromkeys(r["config"]["case"] for r in payload["records"]):
        table = Table([r for r in payload["records"] if r["config"]["case"] == case], row_of=lambda c: c["variant"])

        def overhead(impl):
            none = table.rows.get("none", {}).get(impl)

            def fmt(rec) -> str:
                if rec is none or none is None or not _ok(none):
                    return _time(rec)
                return f"{_time(rec)} ({(rec['time_us'] / none['time_us'] - 1) * 100:+.0f}%)"
            return fmt

        header = ["variant"] + table.columns + ["FlashInfer best / bsrattn-torch"]
        lines = [[row] + [table.cell(row, c, overhead(c)) for c in table.columns] + [_vs_flashinfer(table, row)]
                 for row in table.rows]
        out += [f"**{case}**", ""] + markdown(header, lines) + _notes(table) + [""]
    return out[:-1]


def table_w7(payload) -> list:
    recs = [r for r in payload["records"] if r["status"] == "ok"]
    makespan = [r for r in recs if r["config"]["table"] == "makespan"]
    amp = [r for r in recs if r["config"]["table"] == "read_amplification"]
    out = []
    if makespan:
        batches = sorted({r["config"]["batch"] for r in makespan})
        dists = list(dict.fromkeys(r["config"]["distribution"] for r in makespan))
        cell = {(r["config"]["distribution"], r["config"]["batch"]): r for r in makespan}
        first = makespan[0]["config"]
        out += [f"Makespan, round-robin / planned ({first['num_ctas']} CTAs, {first['trials']} trials; median "
                f"(min–max)):", ""]
        lines = [[d] + [f"{cell[d, b]['median']:.2f}x ({cell[d, b]['min']:.2f}–{cell[d, b]['max']:.2f})"
                        if (d, b) in cell else "—" for b in batches] for d in dists]
        out += markdown(["distribution"] + [f"batch {b}" for b in batches], lines)
    if amp:
        blocks = sorted({r["config"]["kernel_block_size"] for r in amp})
        cell = {(r["config"]["seq_len"], r["config"]["budget"], r["config"]["kernel_block_size"]): r for r in amp}
        keys = list(dict.fromkeys((r["config"]["seq_len"], r["config"]["budget"]) for r in amp))
        out += ["", "Read amplification of a kernel with a fixed block size on the Quest pattern (slots read / "
                "needed; expected for uniform random pages in brackets):", ""]
        lines = [[str(s), str(b)] + [f"{cell[s, b, k]['ratio']:.2f} ({cell[s, b, k]['expected_ratio']:.2f})"
                                     if (s, b, k) in cell else "—" for k in blocks] for s, b in keys]
        out += markdown(["seq_len", "budget"] + [f"block {k}" for k in blocks], lines)
    return out


SECTIONS = {
    "w1_quest_decode": lambda p: table_timed(p, [("bsrattn-torch TB/s", _tbps)]),
    "w2_paged_decode": lambda p: table_timed(p, [("bsrattn-torch TB/s", _tbps),
                                                 ("FlashInfer best / bsrattn-torch", _vs_flashinfer)]),
    "w3_prefill": table_w3,
    "w4_split_kv": table_w4,
    "w5_cascade": table_w5,
    "w6_plan_host": table_w6,
    "w7_cpu_models": table_w7,
    "w8_run_host": table_w8,
    "w9_transformers": table_w9,
    "w10_variants": table_w10,
    "w11_mla_decode": lambda p: table_timed(p, [("bsrattn-torch TB/s", _tbps), ("bsrattn-torch TFLOP/s", _torch_tflops),
                                                ("FlashInfer best / bsrattn-torch", _vs_flashinfer)]),
}


def _environment(payload) -> str:
    env = payload.get("environment", {})
    gpu = env.get("gpu") or {}
    pk = env.get("packages", {})
    parts = [f"{gpu.get('name')} ({gpu.get('sms')} SMs, driver {gpu.get('driver')})" if gpu else "CPU only",
             f"torch {pk.get('torch')}", f"triton {pk.get('triton')}", f"numba-cuda {pk.get('numba-cuda')}",
             f"flashinfer {pk.get('flashinfer-python') or 'not installed'}",
             f"commit {(env.get('git_commit') or 'unknown')[:10]}{' (dirty)' if env.get('git_dirty') else ''}",
             env.get("time_utc", "")]
    text = "; ".join(parts)
    ceilings = payload.get("ceilings")
    if ceilings:
        text += (f". Ceilings measured in the same run: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s "
                 f"(read + written), bf16 GEMM {ceilings['gemm_flops_per_s'] / 1e12:.0f} TFLOP/s")
    return text


def section(payload, results_dir: Path) -> list:
    """One workload's markdown: title, command, environment, method line, table, notes, plot."""
    name = payload["workload"]
    lines = [f"## {payload['title']}", "", f"Reproduce: `{payload['command']}`" + (" (quick run)" if payload.get(
        "quick") else ""), "", f"Measured on: {_environment(payload)}.", ""]
    if payload.get("ceilings"):
        lines += [f"Times: median of {payload['samples']} samples in µs, graph mode (GPU time of calls queued "
                  "behind a spin where marked `q`, eager where marked `e`); "
                  "each implementation was checked against the float64 reference first. In brackets: bound / "
                  "time (the fraction of the physical bound achieved).", ""]
    lines += SECTIONS.get(name, table_timed)(payload)
    if (Path(results_dir) / f"{name}.png").exists():
        lines += ["", f"![{name}]({name}.png)"]
    return lines + [""]


def render(results: dict, results_dir: Path) -> str:
    """The whole README: a heading, how to rerun, then one section per workload present."""
    lines = ["# bsrattn benchmark results", "",
             "Generated by `python3 -m benchmarks.run_all` from the JSON files in this folder (see "
             "`benchmarks/README.md` for the method and how to run it on the H200). Workloads not run yet are "
             "listed at the end.", ""]
    for name in ORDER:
        if name in results:
            lines += section(results[name], results_dir)
    missing = [name for name in ORDER if name not in results]
    if missing:
        lines += ["## Not run yet", ""] + [f"- `python3 -m benchmarks.{name}`" for name in missing] + [""]
    return "\n".join(lines)


def write_summary(results_dir=RESULTS_DIR) -> Path:
    """Write ``<results_dir>/README.md`` from the JSON files there."""
    results_dir = Path(results_dir)
    path = results_dir / "README.md"
    path.write_text(render(load_results(results_dir), results_dir))
    return path


if __name__ == "__main__":
    print(write_summary(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS_DIR))

"""Timing and validation shared by every workload script: the suite's method (benchmarks/README.md), written once.

Every GPU figure goes through :meth:`Suite.measure`, which does, in this order:

1. **build** the implementation; one that cannot be built here (a missing tier, FlashInfer not importable, an
   API that refuses the shape) is recorded as ``unavailable: <reason>`` and the suite goes on;
2. **correctness first**: poison the output (NaN in the ``out`` buffer, NaN in the caching allocator's free
   blocks), run once, and compare sampled query rows with the float64 reference tier on the same inputs
   (:func:`bsrattn.testing.compare`, the tolerance table). A wrong answer is recorded as ``incorrect`` and
   never timed;
3. **eager**: flush L2 (zero a 256 MiB buffer), synchronize, then time one call from Python with CUDA events
   (the interval includes the host's launch cost, as a user sees it); median of ``samples`` (>= 100) after
   warm-up;
4. **graph**: capture the call in a ``torch.cuda.CUDAGraph``, check one replay the same way, then time
   replays, each after an L2 flush queued ahead of it (GPU time: the launch is hidden behind the flush);
   a call no graph can capture (the numba tier's) is instead timed **queued**: each call made from Python
   behind a spin kernel long enough to hide its host cost, so the events time its GPU work alone;
5. **bound**: bytes the work needs over the copy bandwidth, or FLOPs over the bf16 matmul rate, both measured
   in the same process; the fraction achieved is bound / measured time.

Host-side costs (``plan()``) go through :meth:`Suite.measure_host` (wall clock, including a device
synchronize so copies to the GPU are counted). Results are written after every configuration to
``benchmarks/results/<workload>.json`` with the environment and the ceilings, so a run cut short keeps what
it measured.

This module is the suite and the command line; each step's code is a module of its own: the check in
:mod:`benchmarks.correctness`, the eager and graph timing in :mod:`benchmarks.timing`, the environment, the
ceilings and the bound in :mod:`benchmarks.ceilings`, the JSON files and their summary in
:mod:`benchmarks.records`.

``--dry-run`` runs tiny shapes on the CPU, checks correctness only and times nothing: the plumbing of every
script can be exercised on a machine without a GPU (the tests do).
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import json
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import numpy as np

import bsrattn as ba
from benchmarks import ceilings, correctness, records, timing
from benchmarks.records import load_results  # noqa: F401  (the performance notebook and the docs read results here)

# FlashInfer reads this when it JIT-compiles; set before anything imports it.
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")


class Unavailable(Exception):
    """An implementation that cannot run here; the reason is recorded and the suite goes on."""


# ---- progress ---------------------------------------------------------------------------------------------
class Progress:
    """tqdm when it is importable, else one counter line per step on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done = total, desc, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)

    def update(self, note: str = ""):
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(1)
        else:
            print(f"[{self.desc}] {self.done}/{self.total} {note}", file=sys.stderr, flush=True)

    def note(self, text: str):
        if self._bar is not None:
            self._bar.set_postfix_str(text)

    def close(self):
        if self._bar is not None:
            self._bar.close()


def require_free(nbytes: int, what: str):
    """Raise :class:`Unavailable` unless the GPU has ``nbytes`` free (plus 2 GiB of headroom) for ``what``."""
    import torch

    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes + (2 << 30):
        raise Unavailable(f"{what} needs {nbytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text[:600]


# ---- bsrattn through its public API ----------------------------------------------------------------------
NOT_CAPTURED = {"numba": "not captured: numba launches on the legacy default stream, outside torch's capture"}


def bsrattn_build(tier: str, layout, q, k, v, *, plan: dict, out=None, run: dict | None = None,
                  kernel: str | None = None):
    """``build`` for :meth:`Suite.measure`: ``BatchAttention(tier, kernel).plan(layout, **plan)`` once, then
    ``run(q, k, v, out=out, **run)`` per call (the timed part); ``kernel="core"`` times the tier's core.

    The reference tier (dry runs) is given NumPy copies and no ``out``: it runs on NumPy arrays.
    """
    run = run or {}

    def build():
        attn = ba.BatchAttention(backend=tier, kernel=kernel)
        attn.plan(layout, **plan)
        if tier == "reference":
            arrays = [x.detach().cpu().numpy() for x in (q, k, v)]
            return lambda: attn.run(*arrays, **run)
        return lambda: attn.run(q, k, v, out=out, **run)

    return build


def measure_bsrattn(suite, config: dict, name: str, tier: str, layout, q, k, v, *, plan: dict, out=None,
                    run: dict | None = None, kernel: str | None = None, **checking):
    """:meth:`Suite.measure` of one bsrattn tier through ``BatchAttention`` (see :func:`bsrattn_build`)."""
    return suite.measure(config, name, bsrattn_build(tier, layout, q, k, v, plan=plan, out=out, run=run,
                                                     kernel=kernel),
                         out=out if tier != "reference" else None, graph=NOT_CAPTURED.get(tier, True), **checking)


# ---- the suite --------------------------------------------------------------------------------------------
def run_script(workload: str, title: str, run, doc: str, argv=None):
    """A workload script's ``main``: its suite from the command line, ``run(suite)``, then the JSON written."""
    suite = Suite.from_argv(workload, title, argv, doc=doc)
    run(suite)
    suite.finish()


def _patterns(text):
    """A comma-separated list of glob patterns, or None for none given."""
    return [p.strip() for p in text.split(",")] if text else None


def parser(description: str) -> argparse.ArgumentParser:
    """The options every workload script takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="few configurations (fits a short GPU lease)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU, correctness only, no timing; writes JSON only with --results")
    p.add_argument("--samples", type=int, default=None, help="timed samples per mode (default 300, quick 100)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 20, quick 10)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; configurations not started by then are recorded as skipped")
    p.add_argument("--results", type=Path, default=None, help=f"output folder (default {records.RESULTS_DIR})")
    p.add_argument("--impls", default=None, help="comma-separated glob patterns of implementations to run")
    p.add_argument("--configs", default=None,
                   help="comma-separated glob patterns of configuration labels to run ('batch=32 *'); the JSON keeps "
                        "the other configurations' records from an earlier run of the same commit on the same GPU")
    p.add_argument("--seed", type=int, default=0)
    return p


class Suite:
    """One workload's run: its options, environment, ceilings, records and JSON file.

    Parameters
    ----------
    workload : str
        File stem, e.g. ``"w1_quest_decode"``; results go to ``<results>/<workload>.json``.
    title : str
    args : argparse.Namespace
        From :func:`parser`.
    gpu : bool
        Whether the workload needs a CUDA GPU (all but workload 7).
    """

    def __init__(self, workload: str, title: str, args, *, gpu: bool = True):
        self.workload, self.title, self.args = workload, title, args
        self.quick, self.dry_run = bool(args.quick), bool(args.dry_run)
        self.samples = args.samples or (100 if self.quick else 300)
        self.warmup = args.warmup if args.warmup is not None else (10 if self.quick else 20)
        self.rng = np.random.default_rng(args.seed)
        self.patterns = _patterns(args.impls)
        self.config_patterns = _patterns(getattr(args, "configs", None))
        default_dir = None if self.dry_run else records.RESULTS_DIR
        self.results_dir = args.results if args.results is not None else default_dir
        self.records: list = []
        self.started = time.time()
        self.deadline = self.started + args.time_budget if args.time_budget else None
        self.gpu = gpu and not self.dry_run
        self.device = "cuda" if self.gpu else "cpu"
        self.ceilings = None
        self._flush = None
        self.environment = ceilings.environment(self.gpu)
        if self.gpu:
            import torch

            if not torch.cuda.is_available():
                raise SystemExit(f"{workload}: needs a CUDA GPU (none here); use --dry-run to check the plumbing")
            torch.manual_seed(args.seed)
            self.ceilings = ceilings.measure_ceilings(reps=10 if self.quick else 20)
            self._flush = torch.empty(timing.FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        self.kept = self._earlier_records()

    @classmethod
    def from_argv(cls, workload: str, title: str, argv=None, *, gpu: bool = True, doc: str | None = None):
        return cls(workload, title, parser(doc or title).parse_args(argv), gpu=gpu)

    # -- bookkeeping --
    @property
    def command(self) -> str:
        flags = " --quick" if self.quick else ""
        return f"python3 -m benchmarks.{self.workload}{flags}"

    def selected(self, impl: str) -> bool:
        return self.patterns is None or any(fnmatch.fnmatch(impl, p) for p in self.patterns)

    def _earlier_records(self) -> list:
        """Under ``--configs``, the records of an earlier run in this suite's JSON, when that run was of the same
        commit on the same GPU (a workload too long for one lease, run in parts); otherwise none."""
        path = None if self.results_dir is None else Path(self.results_dir) / f"{self.workload}.json"
        if self.config_patterns is None or path is None or not path.exists():
            return []
        earlier = json.loads(path.read_text())
        env = earlier.get("environment", {})
        same = ("git_commit", "gpu", "git_dirty")
        if any(env.get(key) != self.environment.get(key) for key in same) or earlier.get("quick") != self.quick:
            print(f"{path}: an earlier run of another commit, GPU or size; its records are not kept", flush=True)
            return []
        return earlier["records"]

    def chosen(self, config: dict) -> bool:
        """Whether ``config`` is among the configurations ``--configs`` selects (all, without it)."""
        label = records.config_label(config)
        return self.config_patterns is None or any(fnmatch.fnmatch(label, p) for p in self.config_patterns)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    def configs(self, items, config_of):
        """Yield ``(item, config)`` per item, ``config = config_of(item)`` being its record's configuration, with a
        progress bar; write the JSON after each; pass over those ``--configs`` does not choose; past the time budget,
        record the rest as skipped (the first one chosen always runs, so every workload reports something)."""
        items = list(items)
        bar = Progress(len(items), self.workload)
        try:
            started = 0
            for item in items:
                config = config_of(item)
                if not self.chosen(config):
                    bar.update(f"{records.config_label(config)}: not chosen")
                    continue
                started += 1
                if started > 1 and self.out_of_time():
                    self.records.append({"config": config, "impl": "*", "status": "skipped",
                                         "reason": "time budget spent before this configuration started"})
                    bar.update(f"{records.config_label(config)}: skipped (time budget)")
                    continue
                self._bar = bar
                yield item, config
                self.release(collect=True)
                self.write()
                bar.update(records.config_label(config))
        finally:
            bar.close()

    def release(self, collect: bool = False):
        """Return cached device memory (the largest configurations need most of the GPU); ``collect`` also runs
        the garbage collector, which costs a good fraction of a second with torch loaded (once per configuration).
        """
        if collect:
            gc.collect()
        if self.gpu:
            import torch

            torch.cuda.empty_cache()

    def add(self, record: dict) -> dict:
        self.records.append(record)
        return record

    def payload(self) -> dict:
        return {"workload": self.workload, "title": self.title, "command": self.command, "quick": self.quick,
                "dry_run": self.dry_run, "samples": self.samples, "warmup": self.warmup,
                "elapsed_s": round(time.time() - self.started, 1), "environment": self.environment,
                "ceilings": self.ceilings, "records": self._earlier_kept() + self.records}

    def _earlier_kept(self) -> list:
        """The kept records of an earlier run (:meth:`_earlier_records`) of configurations this run did not choose."""
        return [r for r in self.kept if not self.chosen(r["config"])]

    def write(self) -> Path | None:
        """Write ``<results>/<workload>.json`` atomically (nothing for a dry run without ``--results``)."""
        if self.results_dir is None:
            return None
        return records.write_json(Path(self.results_dir) / f"{self.workload}.json", self.payload())

    def finish(self, table=None) -> Path | None:
        """Write the JSON and print ``table(records)`` (default :func:`benchmarks.records.summary_table`): a remote
        run shows its end."""
        path = self.write()
        print((table or records.summary_table)(self.records), flush=True)
        if path is not None:
            print(f"wrote {path}", flush=True)
        return path

    # -- measuring --
    def _note(self, text):
        bar = getattr(self, "_bar", None)
        if bar is not None:
            bar.note(text)

    def _build(self, config: dict, impl: str, build, needs_cuda: bool, **fields):
        """``(record, fn)``: ``impl``'s record begun (with ``fields``) and ``fn = build()``. ``fn`` is None when the
        record is already final: ``impl`` filtered out (record None), or unavailable here, or failing to build
        (recorded, and the suite goes on)."""
        if not self.selected(impl):
            return None, None
        self._note(impl)
        rec = {"config": dict(config), "impl": impl, "status": "ok", **fields}
        if needs_cuda and not self.gpu:
            return self.add({**rec, "status": "unavailable", "reason": "needs a CUDA GPU (dry run on the CPU)"}), None
        try:
            return rec, build()
        except (Unavailable, ImportError, ba.BackendError) as exc:
            return self.add({**rec, "status": "unavailable", "reason": _short(exc)}), None
        except Exception as exc:  # a baseline that fails to build must not stop the suite
            return self.add({**rec, "status": "error", "stage": "build", "reason": _short(exc),
                             "traceback": traceback.format_exc(limit=6)}), None

    def measure(self, config: dict, impl: str, build, *, shape, rows, expected, dtype: str, bytes_needed=None,
                flops=None, graph=True, view=None, out=None, needs_cuda=False, host_loop=False) -> dict | None:
        """Build, check, then time ``impl`` on one configuration; returns the record (None if filtered out).

        Parameters
        ----------
        build : callable
            ``build() -> fn``; ``fn()`` runs one call and returns its output. Raise :class:`Unavailable` when
            the implementation cannot run here. Everything done in ``build`` (plans, copies the baseline is
            given ready) is outside the timed region.
        shape : tuple
            ``(nnz_qo, num_qo_heads, head_dim)``: the output is reshaped to it (after ``view``) to be checked.
        rows, expected : ``[n]`` and ``[n, num_qo_heads, head_dim]``
            Query rows checked and their float64 reference (:func:`reference_rows`).
        dtype : str
            Key of the tolerance table (the query dtype, or the fp8 KV dtype).
        bytes_needed, flops : int, optional
            The work's true cost, for the bound.
        graph : bool or str
            False or a reason string: no graph; the call is timed eagerly and queued
            (:func:`~benchmarks.timing.time_queued`), and the queued figure is the record's.
        view : callable, optional
            Output to canonical layout, applied outside the timed region.
        out : tensor, optional
            The output buffer ``fn`` writes into; filled with NaN before each checked run.
        needs_cuda : bool
            Recorded as unavailable in a dry run on the CPU.
        host_loop : bool
            Also time the host cost per call of a tight loop (:func:`~benchmarks.timing.time_host_loop`, in
            dry runs too); it is then the record's figure (``time_mode`` ``host``).
        """
        rec, fn = self._build(config, impl, build, needs_cuda, bytes=bytes_needed, flops=flops,
                              **ceilings.bound(self.ceilings, bytes_needed, flops))
        if fn is None:
            return rec
        checking = dict(shape=shape, rows=rows, expected=expected, dtype=dtype, view=view)
        stage = "check"
        try:
            if out is not None:
                correctness.fill_nan(out)
            if self.gpu:
                correctness.poison_allocator(int(np.prod(shape)) * 4)
            y = fn()
            rec["check"] = correctness.check_output(y, **checking)
            del y
            if not rec["check"]["ok"]:
                return self.add({**rec, "status": "incorrect", "reason": rec["check"]["message"]})
            if host_loop:
                stage = "host"
                rec["host"] = timing.time_host_loop(fn, sync=timing.synchronize if self.gpu else (lambda: None),
                                                    warmup=min(self.warmup, 2) if self.dry_run else self.warmup,
                                                    samples=3 if self.dry_run else self.samples)
                rec["time_us"], rec["time_mode"] = rec["host"]["median_us"], "host"
            if not self.gpu:
                return self.add(rec)
            stage = "eager"
            rec["eager"] = timing.time_eager(fn, flush=self._flush, warmup=self.warmup, samples=self.samples)
        except Exception as exc:
            self._recover()
            return self.add({**rec, "status": "error", "stage": stage, "reason": _short(exc),
                             "traceback": traceback.format_exc(limit=6)})
        if graph is not True:
            rec["graph"] = {"skipped": graph or "not capturable"}
            try:
                rec["queued"] = timing.time_queued(fn, flush=self._flush, warmup=self.warmup, samples=self.samples,
                                                   host_us=rec["eager"]["p90_us"])
            except Exception as exc:  # the eager figure stands
                self._recover()
                rec["queued"] = {"error": _short(exc)}
        else:
            try:
                rec["graph"] = timing.time_graph(fn, partial(self._check_graph, rec, checking), flush=self._flush,
                                                 warmup=self.warmup, samples=self.samples)
            except Exception as exc:  # a call that cannot be captured keeps its eager figure
                self._recover()
                rec["graph"] = {"error": _short(exc)}
            if not rec.get("check_graph", {"ok": True})["ok"]:
                rec.update(status="incorrect", reason="graph replay: " + rec["check_graph"]["message"])
        del fn
        self.release()
        mode = next((m for m in ("graph", "queued") if rec.get(m, {}).get("median_us")), "eager")
        best = rec[mode]["median_us"]
        if not host_loop:
            rec["time_us"] = best
            rec["time_mode"] = mode
        if "bound_us" in rec:
            rec["fraction"] = rec["bound_us"] / best
        if bytes_needed is not None:
            rec["tb_per_s"] = bytes_needed / best * 1e-6
        if flops is not None:
            rec["tflop_per_s"] = flops / best * 1e-6
        return self.add(rec)

    def _recover(self):
        import torch

        if self.gpu:
            try:
                torch.cuda.synchronize()
            except Exception as exc:
                print(f"{self.workload}: the CUDA context is unusable after an error ({_short(exc)})", file=sys.stderr)

    @staticmethod
    def _check_graph(rec, checking, y) -> bool:
        rec["check_graph"] = correctness.check_output(y, **checking)
        return rec["check_graph"]["ok"]

    def measure_timed(self, config: dict, impl: str, build, *, needs_cuda=False) -> dict | None:
        """Host times that ``fn()`` (``build() -> fn``) measures itself, ``fn() -> (samples in µs, fields)``: a
        whole ``generate`` timed around its own synchronisation, say; ``fields`` join the record."""
        rec, fn = self._build(config, impl, build, needs_cuda)
        if fn is None:
            return rec
        try:
            times, fields = fn()
        except Exception as exc:
            self._recover()
            return self.add({**rec, "status": "error", "stage": "host", "reason": _short(exc),
                             "traceback": traceback.format_exc(limit=6)})
        rec.update(fields, host=timing.stats(times), time_mode="host")
        rec["time_us"] = rec["host"]["median_us"]
        return self.add(rec)

    def measure_host(self, config: dict, impl: str, build, *, samples=None, needs_cuda=False) -> dict | None:
        """Host wall time of ``fn()`` (``build() -> fn``), with a device synchronize so copies are counted."""
        rec, fn = self._build(config, impl, build, needs_cuda)
        if fn is None:
            return rec
        sync = timing.synchronize if self.gpu else (lambda: None)
        n = samples or self.samples
        try:
            for _ in range(min(self.warmup, 5) if self.dry_run else self.warmup):
                fn()
            sync()
            times = []
            for _ in range(3 if self.dry_run else n):
                t0 = time.perf_counter_ns()
                fn()
                sync()
                times.append((time.perf_counter_ns() - t0) / 1e3)
        except Exception as exc:
            self._recover()
            return self.add({**rec, "status": "error", "stage": "host", "reason": _short(exc),
                             "traceback": traceback.format_exc(limit=6)})
        rec["host"] = timing.stats(times)
        rec["time_us"] = rec["host"]["median_us"]
        rec["time_mode"] = "host"
        return self.add(rec)
